"""The writer thread of a disk save, by the kind of store the save folder is on.

A local folder (`write_local`): every rank pwrites its snapshot at its final offsets in the shared data files
(`ucp.deepspeed.saving.writer.write_pieces`), fsyncs them, and reports per-piece CRCs to rank 0 over the saver's own
gloo group (the training thread owns the training group); rank 0 renames the data files into place, commits the
index, then points `<dir>/latest` at the new tag (`ucp.deepspeed.saving.index.commit_folder`), and tells the other
ranks the outcome.

An object store or another fsspec filesystem (`write_object`), which takes no writes at offsets: each rank writes
a local staging copy and uploads it through the `Store` protocol's shared uploads, one multipart upload per data
file, each part by one rank (`ucp.deepspeed.saving.uploads`); rank 0 completes the uploads before the index object
and `latest`.

After a commit, rank 0 calls the saver's `after_commit` (retention, `ucp.elastic.retention.retain`, which
`ucp.deepspeed.life` sets).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ucp import collectives
from ucp.deepspeed.saving.files import bytes_to_send, plan_parts
from ucp.deepspeed.saving.index import RankReport, commit_folder, index_of, report_of
from ucp.deepspeed.saving.snapshot import Prepared
from ucp.deepspeed.saving.writer import write_pieces
from ucp.errors import SaveError
from ucp.format.folder import commit_index
from ucp.format.save_folder import replace_latest, unmark
from ucp.storage.locations import Location, ObjectPath

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger("ucp.save")


class SavingGroup(Protocol):
    """The ranks that save one checkpoint, as the writer thread sees them (`ucp.deepspeed.saving.saver.Saver`)."""

    rank: int
    ranks: list[int]
    group: ProcessGroup | None  # the writer thread's own gloo group (None: this rank alone)
    after_commit: Callable[[Location], None] | None  # on rank 0, after each committed save

    @property
    def leader(self) -> bool: ...


def write_local(saver: SavingGroup, prepared: Prepared, save_dir: Path, tag: str, meta: dict[str, Any] | None,
                event: torch.cuda.Event | None) -> None:
    """Write this rank's pieces into `<save_dir>/<tag>`; rank 0 commits once every rank wrote (module docstring)."""
    tag_dir = save_dir / tag
    report: RankReport = (None, None)
    try:
        if event is not None:  # the device-to-host copies into the pinned buffer are done
            event.synchronize()
        report = report_of(write_pieces(tag_dir, prepared.files.files, prepared.buffer, headers=saver.leader),
                           prepared)
    except Exception as exc:  # reported to rank 0, which then does not commit
        report = (None, f"rank {saver.rank}: {type(exc).__name__}: {exc}")
    reports: list[RankReport] | None = collectives.gather_objects(report, saver.ranks[0], saver.group)
    outcome = None
    if reports is not None and meta is not None:  # rank 0 of the group: it took the metadata and gathers
        try:
            commit_folder(prepared, save_dir, tag, reports, meta)
        except Exception as exc:
            outcome = str(exc) if isinstance(exc, SaveError) else f"{tag_dir}: {type(exc).__name__}: {exc}"
    if saver.leader and outcome is None and saver.after_commit is not None:
        saver.after_commit(save_dir)
    outcome = collectives.broadcast_object(outcome, saver.ranks[0], saver.group)
    if outcome is not None:
        raise SaveError(f"{outcome}; {save_dir / 'latest'} still names the previous checkpoint (fix the cause "
                        f"and save again, or delete the incomplete {tag_dir})")
    logger.info("ucp: saved %s", tag_dir)


def write_object(saver: SavingGroup, prepared: Prepared, save_dir: ObjectPath, tag: str, meta: dict[str, Any] | None,
                 event: torch.cuda.Event | None) -> None:
    """`write_local` into an object store (`ucp.deepspeed.saving.uploads`): stage, exchange the bytes of shared parts,
    upload each rank's parts, then rank 0 completes the uploads and writes the index object, then `latest`.
    On a store without S3's multipart uploads (another fsspec protocol) each file is one part, written whole
    by its uploader (`storage.part_bytes`). Every rank takes the same branch at each collective, whatever
    failed where."""
    from ucp.deepspeed.saving import uploads as object_save

    tag_dir, files, me = save_dir / tag, prepared.files.files, saver.ranks.index(saver.rank)
    step = object_save.part_size(save_dir, files)
    staging, written, error = None, None, None
    uploads: dict[str, str] = {}
    etags: list[tuple[str, int, str]] = []
    try:
        runs = [(r.file, r.begin, r.end) for r in prepared.buffer.runs]
        parts = plan_parts(files, collectives.all_gather_objects(runs, saver.group), step)
        sends: list[list[tuple[str, int, bytes]]] = [[] for _ in saver.ranks]
        try:
            staging = object_save.staging_dir()
            if event is not None:
                event.synchronize()
            written = write_pieces(staging, files, prepared.buffer, headers=True)
            for uploader, name, begin, end in bytes_to_send(parts, runs, me, step):
                sends[uploader] += object_save.read_ranges(staging, [(name, begin, end)])
        except Exception as exc:
            error = f"rank {saver.rank}: {type(exc).__name__}: {exc}"
        got = collectives.all_to_all_objects([(error, mine) for mine in sends], saver.group)
        error = error or next((e for e, _ in got if e), None)  # every rank knows whether any failed
        if error is None and staging is not None:  # staged (no error) on every rank
            opened: dict[str, str] | str = {}
            if saver.leader:
                try:
                    opened = object_save.open_uploads(save_dir, tag_dir, files)
                except Exception as exc:
                    opened = f"rank {saver.rank}: {type(exc).__name__}: {exc}"
            opened = collectives.broadcast_object(opened, saver.ranks[0], saver.group)
            if isinstance(opened, str):
                error = opened
            else:
                uploads = dict(opened)
                try:
                    object_save.write_ranges(staging, [piece for _, theirs in got for piece in theirs])
                    etags = object_save.upload_mine(staging, tag_dir, uploads, parts, me)
                except Exception as exc:
                    error = f"rank {saver.rank}: {type(exc).__name__}: {exc}"
        report: RankReport = (None, error) if error is not None or written is None else report_of(written, prepared)
        reports = collectives.gather_objects((report, etags), saver.ranks[0], saver.group)
        outcome = None
        if reports is not None and meta is not None:
            try:
                index = index_of(prepared, tag_dir, [r for r, _ in reports], meta)
                object_save.complete(tag_dir, uploads, [e for _, mine in reports for e in mine], parts)
                commit_index(tag_dir, index)
                unmark(tag_dir)
                replace_latest(save_dir, tag)
            except Exception as exc:
                outcome = str(exc) if isinstance(exc, SaveError) else f"{tag_dir}: {type(exc).__name__}: {exc}"
            finally:
                object_save.abort(tag_dir, uploads)  # whatever is still open: the save failed
            if outcome is None and saver.after_commit is not None:
                saver.after_commit(save_dir)
        outcome = collectives.broadcast_object(outcome, saver.ranks[0], saver.group)
    finally:
        object_save.remove_staging(staging)
    if outcome is not None:
        raise SaveError(f"{outcome}; {save_dir / 'latest'} still names the previous checkpoint (fix the cause "
                        "and save again; the next save removes what this one left)")
    logger.info("ucp: saved %s", tag_dir)
