"""Retention: what `"ucp": {"save": {"keep": N}}` removes after each save commits (`retain`, which the engine's
checkpoint life, `ucp.deepspeed.life`, gives the saver to run after each commit).

`prune` keeps the newest N committed checkpoints of the save folder (newest by the step each index records,
`ucp.format.save_folder`), never the one `latest` names nor one a reader holds (`ucp.format.folder.reading`).
Tag folders that never committed (a save killed mid-write: ucp's partial-save marker, `ucp.format.save_folder`) and
are older than the newest committed one are removed with them: nothing will ever complete them. A folder the
listing passes over is never removed, nor any folder that is not ucp's, whatever its name (another tool's
checkpoint, such as DeepSpeed's `global_step1/` with no ucp index): that is said once, at warning level.

In an object store (`s3://bucket/prefix`) there is no lock: a checkpoint is removed by deleting its index object
first.
"""
from __future__ import annotations

import logging

from ucp.errors import UcpError
from ucp.format.folder import INDEX_NAME, locked_for_removal, read_latest
from ucp.format.save_folder import (
    committed_tags,
    foreign_why,
    is_ucp_index,
    is_ucp_partial,
    pass_over,
    remove_ours,
    step_tags,
    tag_step,
)
from ucp.storage.layer import is_file
from ucp.storage.locations import Location

logger = logging.getLogger("ucp.elastic")
save_log = logging.getLogger("ucp.save")  # retention is part of each save: what it could not remove is said there


def retain(save_dir: Location, keep: int) -> None:
    """Retention after a commit (the saver's `after_commit`, on rank 0's writer thread): `prune`; a checkpoint that
    cannot be removed stays, said in the log (the save stands)."""
    try:
        removed = prune(save_dir, keep)
    except (OSError, UcpError) as exc:
        save_log.warning("ucp: keeping old checkpoints in %s: %s", save_dir, exc)
        return
    for tag in removed:
        save_log.info("ucp: removed %s (\"keep\": %d)", tag, keep)


def prune(save_dir: Location, keep: int) -> list[Location]:
    """Remove all but the newest `keep` committed checkpoints of `save_dir`, and the abandoned partial ones
    older than the newest committed; returns what was removed. Never the one `latest` names, nor one being
    read, nor one passed over (module docstring). Each is uncommitted first (its index removed), so a crash
    midway leaves no folder that looks whole."""
    committed, _ = committed_tags(save_dir)
    if not committed:
        return []
    latest, newest = _latest_name(save_dir), tag_step(committed[0])
    doomed = committed[keep:]
    for tag in step_tags(save_dir):
        if tag_step(tag) >= newest or tag in committed:
            continue
        if not is_file(tag / INDEX_NAME) and is_ucp_partial(tag):  # a ucp save that never committed
            doomed.append(tag)
        elif not is_ucp_index(tag):  # another tool's, another job's, or unknown: never removed
            pass_over(tag, foreign_why(tag))
    removed: list[Location] = []
    for tag in doomed:
        if tag.name == latest:
            continue
        with locked_for_removal(tag) as free:  # free at once in an object store, which has no readers' locks
            if not free:
                logger.info("ucp: keeping %s: a reader holds it", tag)
                continue
            remove_ours(tag)  # marked ucp's, uncommitted, then removed: one cut short is finished by the next
        removed.append(tag)
    return removed


def _latest_name(save_dir: Location) -> str | None:
    try:
        return read_latest(save_dir)
    except (OSError, UcpError):  # no tag can be told from it: every committed one beyond `keep` may go
        return None
