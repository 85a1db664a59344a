"""Load one rank's slices of a ucp checkpoint under any layout, heterogeneous ones included.

    loaded = ucp.hmp.load_slices(layout, rank, "/ckpt/ucp", model_table)
    loaded.tensors["model.layers.3.mlp.up_proj.weight"]["fp32"]   # this rank's box, in its shape

The layout (`ucp.hmp.layout`) says which box of which parameter the rank holds; `ucp.format.slice_read`
turns each box into one byte range (exactly the box's bytes when the checkpoint is split-major
with a split count the rank's TP size divides); touching ranges are merged (`coalesce`) and read
with one positional read each. This is the loader behind the HMP reference model
(`support.reference_tp`) without DeepSpeed; with DeepSpeed, `ucp.deepspeed`'s hook takes the same layout
(`"layout"` config key, `ucp.deepspeed.engine.placement`) and plans its reads with the same `ucp.format.slice_read`.

ZeRO: when the layout's `zero_stage` is 1 or more, a rank keeps only its part of each optimizer
state (`Layout.zero_shard`: a run of its box's elements, row-major, cut among the ranks of every
replica holding the same box), returned flat. Weights ("fp32") stay whole boxes: the model needs
them, and a rank's fp32 master partition is a part of them. A shard is one exact read when the box
is contiguous in storage (cut along dim 0); a row-parallel box is read whole and narrowed.

Integrity: a read that covers a whole stored state is checked against its CRC-32; a partial read
(a TP slice) cannot be and is not, as with ZeRO partitions in `ucp.deepspeed`; `ucp verify` checks
every tensor whole.
"""
from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from ucp.checkpoint import AtomicCheckpoint
from ucp.errors import CheckpointMismatchError
from ucp.format.box_read import BoxWant, read_boxes
from ucp.format.index import DTYPE_SIZES
from ucp.hmp.layout import Layout, OwnedSlice, ParamSpec
from ucp.storage.fileio import ReadCounter


@dataclass
class LoadedSlices:
    """A rank's slices: tensors[name][state] in the box's shape, and what touched storage."""

    slices: dict[str, OwnedSlice]
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    shards: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # ZeRO: flat [start, stop) of the box kept
    bytes_read: int = 0
    bytes_checked_extra: int = 0  # of bytes_read: read only to check whole chunks around a partial read
    read_calls: int = 0
    share_bytes: int = 0     # bytes of the boxes themselves: what an exact loader must read
    tensors_touched: int = 0  # (parameter, state) pairs read


def load_slices(layout: Layout, rank: int, path: str | os.PathLike, table: Iterable[ParamSpec],
                states: Sequence[str] = ("fp32",), *, verify: bool = True) -> LoadedSlices:
    """`states` of every parameter of `table` that `rank` holds under `layout`, from the checkpoint at `path`."""
    ckpt = AtomicCheckpoint(path)
    global_split = ckpt.index.global_split or layout.split_count()
    table = list(table)
    _check(ckpt, table, states)
    owned = layout.rank_slices(rank, table, global_split)
    out = LoadedSlices(owned)
    if layout.zero_stage:
        specs = {spec.name: spec for spec in table}
        out.shards = {name: layout.zero_shard(rank, specs[name]) for name in owned}
    index = ckpt.index
    wants = {}
    for name, piece in owned.items():
        for state in states:
            stored = index.params[name].states[state]
            itemsize = DTYPE_SIZES[stored.dtype]
            shard = out.shards.get(name) if state != "fp32" else None
            out.share_bytes += (shard[1] - shard[0] if shard else math.prod(b - a for a, b in piece.box)) * itemsize
            wants[(name, state)] = BoxWant(stored, piece.box, shard)
    counter = ReadCounter()
    values, out.bytes_checked_extra = read_boxes(ckpt.path, wants, index.chunk_bytes, counter, verify)
    for (name, state), value in values.items():
        if wants[(name, state)].run is not None and value.untyped_storage().nbytes() > value.nbytes:
            value = value.clone()  # a shard cut from a larger read: do not keep the whole read alive
        out.tensors.setdefault(name, {})[state] = value
    out.bytes_read, out.read_calls, out.tensors_touched = counter.bytes, counter.calls, len(wants)
    return out


def _check(ckpt: AtomicCheckpoint, table: list[ParamSpec], states: Sequence[str]) -> None:
    ckpt.check_headers()  # the index's dtypes and shapes are the files' own
    params = ckpt.index.params
    for spec in table:
        if spec.name not in params:
            raise CheckpointMismatchError(f"{ckpt.path}: has no parameter '{spec.name}', which the model has; was it "
                                          "saved from another model?")
        saved = params[spec.name].shape
        if saved != spec.shape:
            raise CheckpointMismatchError.shape(spec.name, saved, spec.shape, ckpt.path)
        missing = [s for s in states if s not in params[spec.name].states]
        if missing:
            raise CheckpointMismatchError(f"{spec.name}: the checkpoint has no state '{missing[0]}' (has "
                                          f"{', '.join(params[spec.name].states)})")
