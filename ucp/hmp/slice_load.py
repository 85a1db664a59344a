"""Load one rank's slices of a ucp checkpoint under any layout, heterogeneous ones included.

    loaded = ucp.hmp.load_slices(layout, rank, "/ckpt/ucp", model_table)
    loaded.tensors["model.layers.3.mlp.up_proj.weight"]["fp32"]   # this rank's box, in its shape

The layout (`ucp.hmp.layout`) says which box of which parameter the rank holds; `ucp.format.slice_read`
turns each box into one byte range (exactly the box's bytes when the checkpoint is split-major
with a split count the rank's TP size divides); touching ranges are merged (`coalesce`) and read
with one positional read each. This is the loader behind the HMP reference model
(`support.reference_tp`) without DeepSpeed; with DeepSpeed, `ucp.deepspeed`'s hook takes the same layout
(`"layout"` config key, `ucp.deepspeed.placement`) and plans its reads with the same `ucp.format.slice_read`.

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
from ucp.errors import UcpError
from ucp.format.checked_read import read_checked
from ucp.format.fileio import ReadCounter
from ucp.format.safetensors_stream import TORCH_DTYPES
from ucp.format.slice_read import SliceRead, plan_flat_read, plan_slice_read
from ucp.format.splits import box_of_read
from ucp.hmp.layout import Layout, OwnedSlice, ParamSpec


class ModelMismatchError(UcpError):
    """The model's parameter table does not match the checkpoint it loads from."""


@dataclass
class LoadedSlices:
    """A rank's slices: tensors[name][state] in the box's shape, and what touched storage."""

    slices: dict[str, OwnedSlice]
    tensors: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    shards: dict[str, tuple[int, int]] = field(default_factory=dict)  # ZeRO: flat [start, stop) of the box kept
    bytes_read: int = 0
    bytes_checked_extra: int = 0  # of bytes_read: read only to check whole chunks around a partial read
    read_calls: int = 0
    share_bytes: int = 0     # bytes of the boxes themselves: what an exact loader must read
    tensors_touched: int = 0  # (parameter, state) pairs read


def load_slices(layout: Layout, rank: int, path: str | os.PathLike, table: Iterable[ParamSpec],
                states: Sequence[str] = ("fp32",), *, verify: bool = True) -> LoadedSlices:
    """`states` of every parameter of `table` that `rank` holds under `layout`, from the checkpoint at `path`."""
    ckpt = AtomicCheckpoint(path)
    global_split = ckpt.index.get("splits", {}).get("global_split") or layout.split_count()
    table = list(table)
    _check(ckpt, table, states)
    owned = layout.rank_slices(rank, table, global_split)
    out = LoadedSlices(owned)
    if layout.zero_stage:
        specs = {spec.name: spec for spec in table}
        out.shards = {name: layout.zero_shard(rank, specs[name]) for name in owned}
    reads: list[SliceRead] = []
    for name, piece in owned.items():
        for state in states:
            entry = ckpt.index["params"][name]["states"][state]
            itemsize = TORCH_DTYPES[entry["dtype"]].itemsize
            shard = out.shards.get(name) if state != "fp32" else None
            if shard is None:
                out.share_bytes += math.prod(b - a for a, b in piece.box) * itemsize
                reads.append(plan_slice_read((name, state), entry, piece.box, itemsize))
            else:
                out.share_bytes += (shard[1] - shard[0]) * itemsize
                reads.append(plan_flat_read((name, state), entry, piece.box, shard[0], shard[1] - shard[0], itemsize)
                             or plan_slice_read((name, state), entry, piece.box, itemsize))
    counter = ReadCounter()
    model = ckpt.model
    chunks, out.bytes_checked_extra = read_checked(
        ckpt.path, {r.key: (model.params[r.key[0]].states[r.key[1]], r.range) for r in reads}, model.chunk_bytes,
        counter, verify)
    for r in reads:
        name, state = r.key
        entry = ckpt.index["params"][name]["states"][state]
        raw = chunks[r.key]
        flat = raw.view(TORCH_DTYPES[entry["dtype"]])
        shard = out.shards.get(name) if state != "fp32" else None
        if shard is not None and r.dim is None and not r.narrow and not r.whole:
            value = flat  # an exact read of the shard
        else:
            value = box_of_read(flat, entry["shape"], r, tuple(b - a for a, b in owned[name].box))
            if shard is not None:
                value = value.reshape(-1)[shard[0]:shard[1]].clone()
        out.tensors.setdefault(name, {})[state] = value
    out.bytes_read, out.read_calls, out.tensors_touched = counter.bytes, counter.calls, len(reads)
    return out


def _check(ckpt: AtomicCheckpoint, table: list[ParamSpec], states: Sequence[str]) -> None:
    params = ckpt.index["params"]
    for spec in table:
        if spec.name not in params:
            raise ModelMismatchError(f"{ckpt.path}: has no parameter '{spec.name}', which the model has; was it "
                                     "saved from another model?")
        saved = tuple(params[spec.name]["shape"])
        if saved != spec.shape:
            raise ModelMismatchError(f"{spec.name}: the checkpoint holds shape {saved}, the model {spec.shape}")
        missing = [s for s in states if s not in params[spec.name]["states"]]
        if missing:
            raise ModelMismatchError(f"{spec.name}: the checkpoint has no state '{missing[0]}' (has "
                                     f"{', '.join(params[spec.name]['states'])})")
