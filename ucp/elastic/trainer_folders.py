"""Which `checkpoint-N` folder of a Hugging Face Trainer's `output_dir` a restart resumes from, unattended.

The Trainer writes `checkpoint-N` in place: the model files, DeepSpeed's `global_stepN/` and `latest`, the RNG
states and, last, `trainer_state.json` (rank 0, after every rank's DeepSpeed files). A folder is complete when
its `trainer_state.json` reads and records step N and its DeepSpeed state opens with every rank's files (or it
holds a committed ucp index). A save cut short (a rank killed, the job preempted) leaves a folder that lacks one
of these, and so does a save still being written: neither is ever taken (`newest_complete`).

Once a restart resumes from an older folder, the newer incomplete ones are set aside as `damaged-checkpoint-N`
(`set_aside`): the Trainer would write its next `checkpoint-N` over the old files, and its `save_total_limit`
rotation, which keeps the highest N, would keep the damaged folder and delete the complete one a restart needs.
The new name does not start with `checkpoint-`, so neither transformers' `get_last_checkpoint` nor its rotation
sees it.
"""
from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path

from ucp.checkpoint import Checkpoint, open_checkpoint
from ucp.converters.trainer_folders import CHECKPOINT_RE, checkpoint_folders
from ucp.errors import UcpError
from ucp.format.folder import INDEX_NAME, LATEST_MAX_BYTES, LATEST_NAME, plain_tag
from ucp.format.save_folder import printable_prefix
from ucp.storage.fileio import read_regular

TRAINER_STATE = "trainer_state.json"
TRAINER_STATE_MAX_BYTES = 64 << 20  # a log_history of millions of steps; bounds what a damaged file makes us read
SET_ASIDE_PREFIX = "damaged-"


def missing_files(folder: Path) -> str | None:
    """What a `checkpoint-N` folder lacks of the files a resume reads, or None when they are all there."""
    if not (folder / TRAINER_STATE).is_file():
        return f"it has no {TRAINER_STATE}"
    if (folder / INDEX_NAME).is_file():
        return None
    latest = folder / LATEST_NAME
    if latest.is_symlink():  # never followed: it may reach any file on the machine, which a warning would quote
        return f"its '{LATEST_NAME}' is a symbolic link, which ucp never follows"
    if not latest.is_file():
        return f"it has no '{LATEST_NAME}' file"
    try:
        raw = read_regular(str(latest), follow=False, limit=LATEST_MAX_BYTES)
    except (UcpError, OSError):
        return f"its '{LATEST_NAME}' is larger than {LATEST_MAX_BYTES} bytes or unreadable, not a tag name"
    tag = raw.decode("utf-8", errors="replace").strip()
    tag_folder = folder / tag
    if not tag or not plain_tag(tag) or not tag_folder.is_dir():
        return f"its '{LATEST_NAME}' names {printable_prefix(raw.strip())}, which it does not hold"
    return None


def not_a_folder(output_dir: Path) -> str | None:
    """One line naming the first `checkpoint-N` entry of `output_dir` that is not a folder (a file, a link that
    reaches none, a link loop), which "auto" could not resume from and the Trainer could not save or rotate
    into; None when there is none."""
    try:
        names = sorted(os.listdir(output_dir))
    except OSError:
        return None
    for name in names:
        entry = output_dir / name
        if CHECKPOINT_RE.search(name) and not entry.is_dir():
            kind = "a symbolic link that reaches no folder" if entry.is_symlink() else "a file"
            return (f'"ucp": {{"load": "auto"}}: {entry} is {kind}, not a checkpoint folder; the Trainer saves and '
                    f"rotates its checkpoint-N folders there: move it out of {output_dir}")
    return None


def incomplete(folder: Path) -> str | None:
    """Why `folder` cannot be resumed from (`missing_files`, an unreadable `trainer_state.json` or one that records
    another step, a DeepSpeed state that does not open with every rank's files), or None."""
    missing = missing_files(folder)
    if missing is not None:
        return missing
    state_file = folder / TRAINER_STATE
    try:
        if state_file.stat().st_size > TRAINER_STATE_MAX_BYTES:
            return f"its {TRAINER_STATE} is larger than {TRAINER_STATE_MAX_BYTES} bytes"
        state = json.loads(state_file.read_bytes())
    except (OSError, ValueError) as exc:
        return f"its {TRAINER_STATE} does not read as JSON ({exc})"
    match = CHECKPOINT_RE.search(folder.name)
    step = state.get("global_step") if isinstance(state, dict) else None
    if match is not None and step != int(match.group(1)):
        return f"its {TRAINER_STATE} records step {step!r}, not {match.group(1)}"
    return opened_state(folder)[1]


def opened_state(folder: Path) -> tuple[Checkpoint | None, str | None]:
    """The checkpoint in `folder` (DeepSpeed's plan of every rank file, or the ucp index), or why it does not open."""
    try:
        return open_checkpoint(folder), None
    except (UcpError, OSError, ValueError, RuntimeError, EOFError, zipfile.BadZipFile) as exc:
        return None, f"its DeepSpeed state does not open ({exc})"


def newest_complete(output_dir: str | os.PathLike[str]) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete `checkpoint-N` of `output_dir` (None: none is, or there is none), and each newer
    folder passed over with why."""
    root = Path(output_dir)
    if not root.is_dir():
        return None, []
    return first_complete(reversed(checkpoint_folders(root)), incomplete)


def first_complete(newest_first: Iterable[Path],
                   incomplete: Callable[[Path], str | None]) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The first of `newest_first` that `incomplete` finds nothing wrong with (None: none), and each folder
    before it passed over with why: what "auto" takes, for the Trainer's and for Accelerate's folders."""
    passed: list[tuple[Path, str]] = []
    for folder in newest_first:
        why = incomplete(folder)
        if why is None:
            return folder, passed
        passed.append((folder, why))
    return None, passed


def set_aside(folders: list[Path]) -> list[Path]:
    """Rename each folder to `damaged-<name>` (`damaged-<name>.K` when taken), kept for a person to look at and
    seen by neither the Trainer nor "auto" again; the new names."""
    moved = []
    for folder in folders:
        target, n = folder.with_name(SET_ASIDE_PREFIX + folder.name), 1
        while target.exists():
            target, n = folder.with_name(f"{SET_ASIDE_PREFIX}{folder.name}.{n}"), n + 1
        folder.rename(target)
        moved.append(target)
    return moved
