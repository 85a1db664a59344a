"""Resume or start, unattended: which checkpoints of a save folder to try, and which to keep.

A save folder (`"ucp": {"save": {"dir": D}}`) holds one folder per tag, `global_step<N>`, and `latest`.
A tag folder is committed exactly when its index is (`ucp.format.folder`). `"load": "auto"` tries the
committed ones newest first (`candidates`), sets aside the newer ones that failed (`set_aside`), and
`"keep": N` removes all but the newest N after each
save commits (`prune`), never the one `latest` names nor one a reader holds (`ucp.format.folder.reading`).
Tag folders that never committed (a save killed mid-write) and are older than the newest committed one
are removed with them: nothing will ever complete them.

"Newest" is by the step each index records (`indexed_step`), never by the folder's name alone: a save names
its folder `global_step<step>`, so a committed folder whose name says another step (`global_step003`, or
`global_step99999999999999999999` holding step 2), or whose index cannot be read, is passed over, with a
warning when "auto" lists the folder: never loaded, never removed, left for a person to look at. Two
folders cannot then claim one step. Symbolic links are never listed (`storage.list_folders`), so nothing
outside the save folder is read or removed through one.

The save folder may be a prefix of an object store (`s3://bucket/prefix`): the same rules run over
`ucp.format.storage` (list, read, delete). There is no rename and no lock there: a checkpoint set aside is
copied to `<tag>.damaged/` and deleted, and a checkpoint is removed by deleting its index object first.
"""
from __future__ import annotations

import logging
import re

from ucp.errors import CorruptCheckpointError, UcpError
from ucp.format.fields import Fields
from ucp.format.folder import INDEX_NAME, commit_latest, index_max_bytes, locked_for_removal, read_latest
from ucp.format.index import FORMAT_NAME, MAX_STEP
from ucp.format.locations import Location
from ucp.format.storage import delete, delete_tree, is_file, list_folders, list_names, move_tree, read_json

logger = logging.getLogger("ucp.elastic")

_STEP_TAG = re.compile(r"global_step(\d+)")


def candidates(save_dir: Location) -> list[Location]:
    """The committed checkpoints of `save_dir`, newest (highest step its index records) first; those passed over
    are named in a warning each (module docstring). A save killed between its index and `latest` leaves `latest`
    one behind: the newest committed is still the newest."""
    sound, passed = _committed(save_dir)
    for problem in passed:
        logger.warning("ucp: %s", problem)
    return sound


def indexed_step(tag: Location) -> int:
    """The step the committed index of tag folder `tag` records (`training.global_steps`), which must be the
    one its name says, written as a save writes it; else one `CorruptCheckpointError` naming the folder."""
    fix = "ucp passes over it (never loads or removes it): move it out of the folder, or restore it from a copy"
    index = tag / INDEX_NAME
    raw = read_json(index, index_max_bytes(), fix)
    if raw is None:
        raise CorruptCheckpointError(f"{index}: missing; {fix}")
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{index}: not a {FORMAT_NAME} index; {fix}")
    training = Fields("index", raw, index, fix).get("training", (dict,))
    step = Fields("index.training", training, index, fix).count("global_steps", limit=MAX_STEP)
    if tag.name != f"global_step{step}":
        raise CorruptCheckpointError(f"{tag}: its index records step {step}, not the step its name says (a save "
                                     f"names it global_step{step}); {fix}")
    return step


def _committed(place: Location) -> tuple[list[Location], list[str]]:
    """The committed tag folders whose index records the step their name says, newest first; and why each other
    committed one is passed over."""
    sound: list[tuple[int, Location]] = []
    passed: list[str] = []
    for tag in _tags(place):
        if not is_file(tag / INDEX_NAME):
            continue
        try:
            sound.append((indexed_step(tag), tag))
        except UcpError as exc:
            passed.append(str(exc))
    return [tag for _, tag in sorted(sound, key=lambda st: -st[0])], passed


def set_aside(failed: list[Location], loaded: Location) -> list[Location]:
    """After a fallback to `loaded`: rename the newer checkpoints that failed their checks to `<tag>.damaged`
    (kept for a person to look at, never tried or removed again), so that training can save those steps anew,
    and point `latest` at `loaded`. Returns the new names."""
    moved: list[Location] = []
    for tag in failed:
        parent = tag.parent
        taken = set(list_names(parent)) | set(list_folders(parent))
        target_name, n = tag.name + ".damaged", 1
        while target_name in taken:
            target_name, n = f"{tag.name}.damaged{n}", n + 1
        move_tree(tag, parent / target_name, last=INDEX_NAME)
        moved.append(parent / target_name)
    commit_latest(loaded.parent, loaded.name)
    return moved


def prune(save_dir: Location, keep: int) -> list[Location]:
    """Remove all but the newest `keep` committed checkpoints of `save_dir`, and the abandoned partial ones
    older than the newest committed; returns what was removed. Never the one `latest` names, nor one being
    read, nor one passed over (module docstring). Each is uncommitted first (its index removed), so a crash
    midway leaves no folder that looks whole."""
    committed, _ = _committed(save_dir)
    if not committed:
        return []
    latest, newest = _latest_name(save_dir), tag_step(committed[0])
    doomed = committed[keep:] + [tag for tag in _tags(save_dir)
                                 if tag_step(tag) < newest and not is_file(tag / INDEX_NAME)]
    removed: list[Location] = []
    for tag in doomed:
        if tag.name == latest:
            continue
        with locked_for_removal(tag) as free:  # free at once in an object store, which has no readers' locks
            if not free:
                logger.info("ucp: keeping %s: a reader holds it", tag)
                continue
            delete(tag / INDEX_NAME)  # uncommitted first
            delete_tree(tag)
        removed.append(tag)
    return removed


def _tags(save_dir: Location) -> list[Location]:
    return [save_dir / name for name in list_folders(save_dir) if _STEP_TAG.fullmatch(name) is not None]


def tag_step(tag: Location) -> int:
    """The step a tag folder `global_step<N>` names; -1 for any other name."""
    match = _STEP_TAG.fullmatch(tag.name)
    return int(match.group(1)) if match is not None else -1


def _latest_name(save_dir: Location) -> str | None:
    try:
        return read_latest(save_dir)
    except (OSError, UcpError):  # no tag can be told from it: every committed one beyond `keep` may go
        return None
