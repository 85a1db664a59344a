"""The tag folders of a save folder (`"ucp": {"save": {"dir": D}}`): one `global_step<N>` per save, and `latest`.

A tag folder is committed exactly when its index is (`ucp.format.folder`). "Newest" is by the step each index
records (`indexed_step`), never by the folder's name alone: a save names its folder `global_step<step>`, so a
committed folder whose name says another step (`global_step003`, or `global_step99999999999999999999` holding
step 2), or whose index cannot be read, is passed over: never loaded, never removed, left for a person to look
at. Two folders cannot then claim one step. Symbolic links are never listed (`storage.list_folders`), so nothing
outside the save folder is read or removed through one. `ucp.elastic.resume` and `ucp.elastic.retention` both
list a save folder through this module.

What ucp may remove or replace in a folder it saves into (disk or memory tier): only what it wrote itself.

A tag folder is ucp's when it holds a committed ucp index (`ucp_index.json` of the ucp format) or ucp's own
partial-save marker (`ucp_saving`, written into a tag folder before any data file and removed once its index is
committed). Anything else (another tool's checkpoint such as DeepSpeed's `global_step1/`, another job's, a folder
of notes, a regular file or a link, whatever its name) is never removed, written into or replaced: it is passed
over with one warning (`pass_over`, once per path and process), and where a save would have to write into it the
save folder is refused in one line at the start (`check_save_folder`). `latest` is replaced only when it names a
ucp checkpoint or nothing (`latest_is_ours`).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import stat
from pathlib import Path

from ucp.errors import ConfigError, CorruptCheckpointError, SaveError, UcpError
from ucp.format.fields import Fields
from ucp.format.folder import INDEX_NAME, LATEST_MAX_BYTES, LATEST_NAME, commit_latest, index_max_bytes, plain_tag
from ucp.format.index import FORMAT_NAME, MAX_STEP
from ucp.storage.layer import (
    delete,
    delete_tree,
    is_file,
    is_remote,
    list_folders,
    list_names,
    make_folder,
    read_json,
    read_small,
    write_whole,
)
from ucp.storage.locations import Location

_STEP_TAG = re.compile(r"global_step(\d+)")


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


def committed_tags(save_dir: Location) -> tuple[list[Location], list[str]]:
    """The committed tag folders whose index records the step their name says, newest first; and why each other
    committed one is passed over."""
    sound: list[tuple[int, Location]] = []
    passed: list[str] = []
    for tag in step_tags(save_dir):
        if not is_file(tag / INDEX_NAME):
            continue
        try:
            sound.append((indexed_step(tag), tag))
        except UcpError as exc:
            passed.append(str(exc))
    return [tag for _, tag in sorted(sound, key=lambda st: -st[0])], passed


def step_tags(save_dir: Location) -> list[Location]:
    """Every folder of `save_dir` named `global_step<N>`, committed or not."""
    return [save_dir / name for name in list_folders(save_dir) if _STEP_TAG.fullmatch(name) is not None]


def tag_step(tag: Location) -> int:
    """The step a tag folder `global_step<N>` names; -1 for any other name."""
    match = _STEP_TAG.fullmatch(tag.name)
    return int(match.group(1)) if match is not None else -1


# -- what ucp may remove or replace: only what it wrote itself -------------------------------------------------------

PARTIAL_MARKER = "ucp_saving"  # ucp's partial-save marker: this tag folder is a ucp save being written
QUOTE_MAX = 40  # the most characters of a file's content an error or a warning quotes

logger = logging.getLogger("ucp.save")
_said: set[str] = set()  # what `pass_over` already said, in this process


def printable_prefix(raw: bytes) -> str:
    """At most QUOTE_MAX printable characters of `raw`, for a message: the rest, and anything unprintable, is
    left out and its size said instead (a secret or a 10 MB file never reaches a log line)."""
    text = raw.decode("utf-8", errors="replace")
    head = "".join(c if c.isprintable() else "?" for c in text[:QUOTE_MAX])
    return repr(head) if len(raw) <= QUOTE_MAX and head == text else f"{head!r}... ({len(raw)} bytes)"


def pass_over(path: Location, why: str) -> None:
    """Say once, at warning level, that ucp leaves `path` alone and why."""
    say_once(path, f"ucp: {path}: {why}; ucp never removes or replaces it, move it away if it is not needed")


def say_once(path: Location, line: str) -> None:
    """Log `line` at warning level, the first time something is said of `path` in this process (a folder passed
    over at every save is said at the first)."""
    if str(path) in _said:
        return
    _said.add(str(path))
    logger.warning("%s", line)


def is_ucp_index(tag: Location) -> bool:
    """Whether `tag` holds an index of the ucp format (committed), whatever step it records."""
    if not is_file(tag / INDEX_NAME):
        return False
    try:
        raw = read_json(tag / INDEX_NAME, index_max_bytes(), "")
    except (UcpError, OSError):
        return False
    return isinstance(raw, dict) and raw.get("format") == FORMAT_NAME


def is_ucp_partial(tag: Location) -> bool:
    """Whether `tag` holds ucp's partial-save marker (a ucp save was being written into it)."""
    return is_file(tag / PARTIAL_MARKER)


def is_ours(tag: Location) -> bool:
    """Whether tag folder `tag` is ucp's (module docstring); a link or a file at `tag` never is."""
    if not is_remote(tag) and (os.path.islink(tag) or not os.path.isdir(tag)):
        return False
    return is_ucp_index(tag) or is_ucp_partial(tag)


def foreign_why(tag: Location) -> str:
    """Why `tag` is not ucp's, in a few words."""
    if not is_remote(tag):
        try:
            mode = os.lstat(tag).st_mode
        except OSError:
            return "not readable"
        if stat.S_ISLNK(mode):
            return "a symbolic link, not a ucp checkpoint"
        if not stat.S_ISDIR(mode):
            return "a file, not a ucp checkpoint"
    return f"not a ucp checkpoint (no {INDEX_NAME} of the ucp format)"


def claim_tag(tag: Location, leader: bool = True) -> None:
    """Make tag folder `tag` for a save and mark it ucp's (`PARTIAL_MARKER`) before any data file is written into
    it; one `SaveError` when something that is not ucp's stands at its name (never written into). Every rank of a
    local save claims (a rank's mark comes before its own data files, so a folder another rank is making is empty
    or marked); in an object store only the `leader`, whose objects make the folder."""
    if is_remote(tag) and not leader:
        return
    problem = foreign_problem(tag)
    if problem is not None:
        raise SaveError(problem)
    make_folder(tag)
    if is_remote(tag):
        write_whole(tag / PARTIAL_MARKER, b"")
    else:
        os.close(os.open(tag / PARTIAL_MARKER, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))


def remove_ours(tag: Location) -> None:
    """Remove ucp's tag folder `tag` so that a removal cut short (a node lost, a job killed) leaves a folder still
    marked ucp's, which the next removal finishes: the marker first, then the index (uncommitted), the rest, the
    marker last."""
    if is_remote(tag):
        write_whole(tag / PARTIAL_MARKER, b"")
        delete(tag / INDEX_NAME)
        delete_tree(tag)
        return
    os.close(os.open(tag / PARTIAL_MARKER, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644))
    (tag / INDEX_NAME).unlink(missing_ok=True)
    for entry in os.scandir(tag):
        if entry.name == PARTIAL_MARKER:
            continue
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)
    shutil.rmtree(tag, ignore_errors=True)


def foreign_problem(tag: Location) -> str | None:
    """Why a save may not write at `tag` (something not ucp's stands there), or None (`claim_tag`'s test)."""
    if _stands(tag) and not is_ours(tag) and not _empty_folder(tag):
        return (f"{tag}: {foreign_why(tag)}, where ucp saves this step; ucp never writes into what it did not "
                "write: move it away, or save into a folder of ucp's own")
    return None


def fresh_tag(tag: Path) -> None:
    """An empty local tag folder `tag`, marked ucp's, in place of the ucp copy (of the same name) that was there:
    a memory copy rebuilt from peers. One `SaveError` when what stands there is not ucp's (`foreign_problem`)."""
    problem = foreign_problem(tag)
    if problem is not None:
        raise SaveError(problem)
    if os.path.isdir(tag):
        remove_ours(tag)
    claim_tag(tag)


def unmark(tag: Location) -> None:
    """Remove the partial-save marker once `tag`'s index is committed."""
    delete(tag / PARTIAL_MARKER)


def latest_is_ours(save_dir: Location) -> bool:
    """Whether `<save_dir>/latest` names a ucp checkpoint or nothing (absent, or naming a tag that is not there):
    the only `latest` ucp replaces."""
    pointer = save_dir / LATEST_NAME
    if not is_remote(pointer) and not os.path.lexists(pointer):
        return True
    try:
        raw = read_small(pointer, limit=LATEST_MAX_BYTES, follow=False)
    except (UcpError, OSError):
        return False
    if raw is None:
        return True
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return False
    if not plain_tag(tag):
        return False
    return not _stands(save_dir / tag) or is_ours(save_dir / tag)


def replace_latest(save_dir: Location, tag: str) -> bool:
    """Point `<save_dir>/latest` at committed `tag` when the `latest` there is ucp's (`latest_is_ours`); else
    leave it, said once; whether it was replaced."""
    if not latest_is_ours(save_dir):
        pass_over(save_dir / LATEST_NAME, "names what is not a ucp checkpoint (another tool's)")
        return False
    commit_latest(save_dir, tag)
    return True


def check_save_folder(save_dir: Location, start_step: int | None, say: bool = True,
                      what: str = '"ucp": {"save": {"dir": ...}}') -> None:
    """Before training: refuse in one `ConfigError` a save folder ucp cannot save into without writing into what
    it did not write: not a folder (a file, a link loop), a `latest` naming another tool's checkpoint, or (once
    the step training starts from is known, `start_step`) something not ucp's named `global_step<N>` for a later
    step (a later save would need the name). Such things named for earlier steps are passed over (`pass_over`,
    when `say`)."""
    problem = save_folder_problem(save_dir, start_step, say)
    if problem is not None:
        raise ConfigError(f"{what}: {problem}")


def save_folder_problem(save_dir: Location, start_step: int | None, say: bool = True) -> str | None:
    """What `check_save_folder` refuses, or None."""
    if not is_remote(save_dir):
        if os.path.lexists(save_dir) and not os.path.isdir(save_dir):
            kind = "a symbolic link that reaches no folder" if os.path.islink(save_dir) else "a file"
            return f"{save_dir} is {kind}, not a folder; choose a folder of ucp's own"
        if not os.path.lexists(save_dir):
            return None
    if not latest_is_ours(save_dir):
        return (f"{save_dir / LATEST_NAME} names what is not a ucp checkpoint (another tool's, such as DeepSpeed's); "
                f"ucp never replaces it: save into a folder of ucp's own (e.g. {save_dir / 'ucp'})")
    if start_step is None:
        return None
    for name in sorted(set(list_names(save_dir)) | set(list_folders(save_dir))):
        tag = save_dir / name
        step = tag_step(tag)
        if step < 0 or is_ours(tag):
            continue
        if step > start_step:
            return (f"{tag}: {foreign_why(tag)}, and a later save of this job is named so; ucp never writes into "
                    "what it did not write: move it away, or save into a folder of ucp's own")
        if say:
            pass_over(tag, foreign_why(tag))
    return None


def _empty_folder(path: Location) -> bool:
    """Whether `path` is an empty local folder (a save's folder another rank has just made), not a link."""
    if not isinstance(path, Path):
        return False
    try:
        return not os.path.islink(path) and os.path.isdir(path) and not os.listdir(path)
    except OSError:
        return False


def _stands(path: Location) -> bool:
    """Whether anything (a link included, even a broken one) stands at `path`."""
    if is_remote(path):
        return is_file(path / INDEX_NAME) or bool(list_names(path)) or bool(list_folders(path))
    return os.path.lexists(path)

