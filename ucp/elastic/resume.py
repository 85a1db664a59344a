"""Resume or start, unattended: which checkpoints of a save folder to try, and which to keep.

A save folder (`"ucp": {"save": {"dir": D}}`) holds one folder per tag, `global_step<N>`, and `latest`.
A tag folder is committed exactly when its index is (`ucp.format.folder`). `"load": "auto"` tries the
committed ones newest first (`candidates`), sets aside the newer ones that failed (`set_aside`), and
`"keep": N` removes all but the newest N after each
save commits (`prune`), never the one `latest` names nor one a reader holds (`ucp.format.folder.reading`).
Tag folders that never committed (a save killed mid-write) and are older than the newest committed one
are removed with them: nothing will ever complete them.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path

from ucp.errors import UcpError
from ucp.format.folder import INDEX_NAME, commit_latest, locked_for_removal, read_latest

logger = logging.getLogger("ucp.elastic")

_STEP_TAG = re.compile(r"global_step(\d+)")


def candidates(save_dir: str | os.PathLike[str]) -> list[Path]:
    """The committed checkpoints of `save_dir`, newest (highest step) first. A save killed between its index
    and `latest` leaves `latest` one behind: the newest committed is still the newest."""
    committed = [tag for tag in _tags(Path(save_dir)) if (tag / INDEX_NAME).is_file()]
    return sorted(committed, key=lambda tag: -tag_step(tag))


def set_aside(failed: list[Path], loaded: Path) -> list[Path]:
    """After a fallback to `loaded`: rename the newer checkpoints that failed their checks to `<tag>.damaged`
    (kept for a person to look at, never tried or removed again), so that training can save those steps anew,
    and point `latest` at `loaded`. Returns the new names."""
    moved = []
    for tag in failed:
        target = tag.with_name(tag.name + ".damaged")
        n = 1
        while target.exists():
            target, n = tag.with_name(f"{tag.name}.damaged{n}"), n + 1
        tag.rename(target)
        moved.append(target)
    commit_latest(loaded.parent, loaded.name)
    return moved


def prune(save_dir: str | os.PathLike[str], keep: int) -> list[Path]:
    """Remove all but the newest `keep` committed checkpoints of `save_dir`, and the abandoned partial ones
    older than the newest committed; returns what was removed. Never the one `latest` names, nor one being
    read. Each is uncommitted first (its index removed), so a crash midway leaves no folder that looks whole."""
    save_dir = Path(save_dir)
    committed = candidates(save_dir)
    if not committed:
        return []
    latest, newest = _latest_name(save_dir), max(tag_step(tag) for tag in committed)
    doomed = committed[keep:] + [tag for tag in _tags(save_dir)
                                 if not (tag / INDEX_NAME).is_file() and tag_step(tag) < newest]
    removed = []
    for tag in doomed:
        if tag.name == latest:
            continue
        with locked_for_removal(tag) as free:
            if not free:
                logger.info("ucp: keeping %s: a reader holds it", tag)
                continue
            (tag / INDEX_NAME).unlink(missing_ok=True)
            shutil.rmtree(tag, ignore_errors=True)
        removed.append(tag)
    return removed


def _tags(save_dir: Path) -> list[Path]:
    if not save_dir.is_dir():
        return []
    return [p for p in save_dir.iterdir()
            if p.is_dir() and not p.is_symlink() and _STEP_TAG.fullmatch(p.name) is not None]


def tag_step(tag: Path) -> int:
    """The step a tag folder `global_step<N>` names; -1 for any other name."""
    match = _STEP_TAG.fullmatch(tag.name)
    return int(match.group(1)) if match is not None else -1


def _latest_name(save_dir: Path) -> str | None:
    try:
        return read_latest(save_dir)
    except (OSError, UcpError):  # no tag can be told from it: every committed one beyond `keep` may go
        return None
