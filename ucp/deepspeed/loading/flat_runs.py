"""The ZeRO partition of a state planned from a DeepSpeed checkpoint, as runs of its source files.

A planned state (`ucp.plan.plan.StateSource`) whose fragments tile its flattened tensor lets a
rank read just its partition's bytes from the rank files, as it would from a converted checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

from ucp.format.byte_ranges import ByteRange
from ucp.patterns.types import Pattern
from ucp.plan.plan import Piece, StateSource


@dataclass(frozen=True)
class FlatRun:
    """Elements [start, start + piece.numel) of a state's flattened (padded) tensor, stored as `piece`."""

    start: int
    piece: Piece


def flat_runs(source: StateSource) -> tuple[FlatRun, ...] | None:
    """The runs that tile the flattened tensor of a planned state, in order, all of one dtype; None
    when the state is stored otherwise (TP shards, replicated copies, nested pieces): read it whole."""
    spec, fragments = source.spec, source.fragments
    if source.groups is not None or len({f.piece.dtype for f in fragments}) != 1:
        return None
    if spec.flat and spec.padded_size is not None and spec.pattern in (Pattern.UNIQUE, Pattern.SHARD_V):
        offsets = [f.info.offset for f in fragments if f.info.offset is not None]
        if len(offsets) != len(fragments):
            return None
        return tuple(FlatRun(offset, f.piece) for offset, f in zip(offsets, fragments))
    if (spec.pattern == Pattern.UNIQUE and len(fragments) == 1 and spec.padded_size is None
            and fragments[0].piece.numel == spec.numel):
        return (FlatRun(0, fragments[0].piece),)  # one whole tensor, row-major
    return None


def run_reads(runs: tuple[FlatRun, ...], lo: int, hi: int, itemsize: int) -> list[ByteRange]:
    """The byte ranges that hold elements [lo, hi) of the flattened tensor, in element order."""
    out = []
    for run in runs:
        a, b = max(lo, run.start), min(hi, run.start + run.piece.numel)
        if a < b:
            first = run.piece.byte_offset + (a - run.start) * itemsize
            out.append(ByteRange(run.piece.path, first, first + (b - a) * itemsize))
    if sum(r.nbytes for r in out) != (hi - lo) * itemsize:
        raise ValueError(f"elements [{lo}, {hi}) are not covered by the runs in {runs[0].piece.path}")
    return out
