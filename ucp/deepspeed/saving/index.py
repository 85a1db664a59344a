"""The index of a save: what each rank reports of the pieces it wrote, the index rank 0 builds from the reports
and the metadata it took with the snapshot (`ucp.deepspeed.saving.metadata`), and the local commit.

`index_of` runs on rank 0's writer thread once every rank wrote its pieces; `commit_folder` is the local commit:
the data files renamed into place, the index, then `latest`.
"""
from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ucp.deepspeed.saving.files import WrittenPiece, whole_crcs
from ucp.deepspeed.saving.snapshot import Prepared
from ucp.deepspeed.saving.writer import partial_path
from ucp.errors import SaveError
from ucp.format.crc import CHUNK_BYTES
from ucp.format.folder import commit_index, fsync_dir
from ucp.format.index import Index, RunRecord
from ucp.format.safetensors_stream import StoredTensor
from ucp.format.save_folder import replace_latest, unmark
from ucp.patterns import PatternSpec
from ucp.plan.index_builder import ParamRecord, WrittenFile, build_index
from ucp.storage.locations import Location

# What each rank's writer reports to rank 0: (key, start, numel, begin, end, segments) of each piece it wrote,
# or the error that stopped it.
RankReport = tuple[list[tuple[str, int, int, int, int, tuple[tuple[int, int, int], ...]]] | None, str | None]


def report_of(written: Sequence[WrittenPiece], prepared: Prepared) -> RankReport:
    """This rank's report of the pieces `write_pieces` wrote (in buffer order)."""
    return ([(w.key, p.start, p.numel, w.begin, w.end, w.segments)
             for w, p in zip(written, prepared.buffer.pieces)], None)


def commit_folder(prepared: Prepared, save_dir: Path, tag: str, reports: list[RankReport], meta: dict[str, Any]
                  ) -> None:
    """Rank 0's commit of a local save: the data files into place, then the index, then `latest`."""
    tag_dir = save_dir / tag
    index = index_of(prepared, tag_dir, reports, meta)
    for f in prepared.files.files:
        os.replace(partial_path(tag_dir, f.name), tag_dir / f.name)
    fsync_dir(tag_dir)
    commit_index(tag_dir, index)
    unmark(tag_dir)
    replace_latest(save_dir, tag)


def index_of(prepared: Prepared, tag_dir: Location, reports: list[RankReport], meta: dict[str, Any]) -> Index:
    """The index of the save the ranks' `reports` describe (each rank's pieces must tile every tensor)."""
    failed = [error for _, error in reports if error]
    if failed:
        raise SaveError(f"{tag_dir}: not committed, {failed[0]}")
    pieces = [WrittenPiece(key, begin, end, tuple((lo, hi, crc) for lo, hi, crc in segments))
              for report, _ in reports for key, _start, _numel, begin, end, segments in report or []]
    crcs = whole_crcs(prepared.files, pieces)
    params = [_param_record(p, prepared.patterns[p["name"]]) for p in meta["params"]]
    fingerprint = hashlib.sha256(f"{tag_dir}:{time.time_ns()}".encode()).hexdigest()[:32]
    run = RunRecord(meta["source"], meta["training"], meta["optimizer"], meta["lr_scheduler"], meta["client_state"])
    written = [WrittenFile(f.name, f.size, CHUNK_BYTES,
                           {k: StoredTensor(k, s.begin, s.end, crcs[k][0], tuple(crcs[k][1]))
                            for k, s in prepared.files.spans.items() if s.file == f.name})
               for f in prepared.files.files]
    return build_index(run, meta["aliases"], params, fingerprint, written)


def _param_record(p: dict[str, Any], pattern: PatternSpec) -> ParamRecord:
    """The parameter's index record; its pattern says how the ranks held it (as `ucp convert` records it)."""
    return ParamRecord(name=p["name"], kind=p["kind"], shape=tuple(p["shape"]), pattern=pattern,
                       dtypes=dict(p["states"]), model_dtype=p["model_dtype"], group=p["group"], step=p["step"])
