"""Resume or start, unattended: which checkpoints of a save folder to try, and which to keep.

A save folder (`"ucp": {"save": {"dir": D}}`) holds one folder per tag, `global_step<N>`, and `latest`.
A tag folder is committed exactly when its index is (`ucp.format.folder`). `"load": "auto"` tries the
committed ones newest first (`candidates`), sets aside the newer ones that failed (`set_aside`), and
`"keep": N` removes all but the newest N after each
save commits (`prune`), never the one `latest` names nor one a reader holds (`ucp.format.folder.reading`).
Tag folders that never committed (a save killed mid-write) and are older than the newest committed one
are removed with them: nothing will ever complete them.

The save folder may be a prefix of an object store (`s3://bucket/prefix`): the same rules run over
`ucp.format.storage` (list, read, delete). There is no rename and no lock there: a checkpoint set aside is
copied to `<tag>.damaged/` and deleted, and a checkpoint is removed by deleting its index object first.
"""
from __future__ import annotations

import logging
import os
import re
import shutil

from ucp.errors import UcpError
from ucp.format.folder import INDEX_NAME, commit_latest, locked_for_removal, read_latest
from ucp.format.locations import Location, ObjectPath, location
from ucp.format.storage import delete, delete_tree, is_file, list_folders, move_tree

logger = logging.getLogger("ucp.elastic")

_STEP_TAG = re.compile(r"global_step(\d+)")


def candidates(save_dir: str | os.PathLike[str] | ObjectPath) -> list[Location]:
    """The committed checkpoints of `save_dir`, newest (highest step) first. A save killed between its index
    and `latest` leaves `latest` one behind: the newest committed is still the newest."""
    committed = [tag for tag in _tags(location(save_dir)) if is_file(tag / INDEX_NAME)]
    return sorted(committed, key=lambda tag: -tag_step(tag))


def set_aside(failed: list[Location], loaded: Location) -> list[Location]:
    """After a fallback to `loaded`: rename the newer checkpoints that failed their checks to `<tag>.damaged`
    (kept for a person to look at, never tried or removed again), so that training can save those steps anew,
    and point `latest` at `loaded`. Returns the new names."""
    moved: list[Location] = []
    for tag in failed:
        if isinstance(tag, ObjectPath):
            parent, name = _object_parent(tag), _name(tag)
            taken = set(list_folders(parent))
            target_name, n = name + ".damaged", 1
            while target_name in taken:
                target_name, n = f"{name}.damaged{n}", n + 1
            move_tree(tag, parent / target_name, last=INDEX_NAME)
            moved.append(parent / target_name)
            continue
        target = tag.with_name(tag.name + ".damaged")
        n = 1
        while target.exists():
            target, n = tag.with_name(f"{tag.name}.damaged{n}"), n + 1
        tag.rename(target)
        moved.append(target)
    commit_latest(_parent(loaded), _name(loaded))
    return moved


def prune(save_dir: str | os.PathLike[str] | ObjectPath, keep: int) -> list[Location]:
    """Remove all but the newest `keep` committed checkpoints of `save_dir`, and the abandoned partial ones
    older than the newest committed; returns what was removed. Never the one `latest` names, nor one being
    read. Each is uncommitted first (its index removed), so a crash midway leaves no folder that looks whole."""
    place = location(save_dir)
    committed = candidates(place)
    if not committed:
        return []
    latest, newest = _latest_name(place), max(tag_step(tag) for tag in committed)
    doomed = committed[keep:] + [tag for tag in _tags(place)
                                 if tag_step(tag) < newest and tag not in committed]
    removed: list[Location] = []
    for tag in doomed:
        if _name(tag) == latest:
            continue
        if isinstance(tag, ObjectPath):  # no readers' locks in an object store: uncommit, then delete
            delete(tag / INDEX_NAME)
            delete_tree(tag)
            removed.append(tag)
            continue
        with locked_for_removal(tag) as free:
            if not free:
                logger.info("ucp: keeping %s: a reader holds it", tag)
                continue
            (tag / INDEX_NAME).unlink(missing_ok=True)
            shutil.rmtree(tag, ignore_errors=True)
        removed.append(tag)
    return removed


def _tags(save_dir: Location) -> list[Location]:
    return [save_dir / name for name in list_folders(save_dir) if _STEP_TAG.fullmatch(name) is not None]


def _name(tag: Location) -> str:
    return tag.key.rpartition("/")[2] if isinstance(tag, ObjectPath) else tag.name


def _parent(tag: Location) -> Location:
    return _object_parent(tag) if isinstance(tag, ObjectPath) else tag.parent


def _object_parent(tag: ObjectPath) -> ObjectPath:
    return ObjectPath(tag.scheme, tag.bucket, tag.key.rpartition("/")[0])


def tag_step(tag: Location) -> int:
    """The step a tag folder `global_step<N>` names; -1 for any other name."""
    match = _STEP_TAG.fullmatch(_name(tag))
    return int(match.group(1)) if match is not None else -1


def _latest_name(save_dir: Location) -> str | None:
    try:
        return read_latest(save_dir)
    except (OSError, UcpError):  # no tag can be told from it: every committed one beyond `keep` may go
        return None
