"""The one read executor of loaders: boxes of stored states, or runs of a box's elements, read with as
few positional reads as the storage allows and checked before anything is returned.

The DeepSpeed hook (`ucp.deepspeed.loading.source`) and `ucp.hmp.load_slices` both read through here.
Each wanted box becomes one planned read (`slice_read`: exactly its bytes when they are contiguous
in storage, else the covering splits, else the whole tensor), touching reads of a file are
coalesced, every byte read is checked against the index's checksums (`checked_read`), and the bytes
are cut to the box.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ucp.format.boxes import Box
from ucp.format.checked_read import Key, OpenChunk, read_checked
from ucp.format.index import StoredState
from ucp.format.safetensors_stream import TORCH_DTYPES
from ucp.format.slice_read import SliceRead, plan_flat_read, plan_slice_read
from ucp.format.splits import box_of_read
from ucp.storage.fileio import ReadCounter
from ucp.storage.locations import Location


@dataclass(frozen=True)
class BoxWant:
    """What a loader wants of one stored state: `box` of the full tensor, or just elements
    `run` = [lo, hi) of the box flattened row-major (a ZeRO partition). `whole` reads the whole tensor
    and cuts it in memory, as DeepSpeed's own `load_universal` does (no redundancy bypass)."""

    stored: StoredState
    box: Box
    run: tuple[int, int] | None = None
    whole: bool = False


def read_boxes(root: Location, wants: dict[Key, BoxWant], chunk_bytes: int, counter: ReadCounter,
               verify: bool = True, open_chunks: list[OpenChunk] | None = None, crcs: dict[Key, int] | None = None,
               again: dict[Key, int] | None = None) -> tuple[dict[Key, torch.Tensor], int]:
    """Each want's box (a tensor of the box's shape) or run (1-D), from the checkpoint folder `root`; and
    how many bytes were read beyond the wanted ones to check them (`verify`). With `open_chunks`, the chunks
    a read holds only part of are left there for `checked_read.close_chunks`; `crcs` and `again` record the
    CRC-32 of each want's read and check a second read against it (`checked_read.read_checked`)."""
    plans = {key: _plan(key, want) for key, want in wants.items()}
    chunks, extra = read_checked(root, {key: (want.stored, plans[key].range) for key, want in wants.items()},
                                 chunk_bytes, counter, verify, open_chunks, crcs, again)
    return {key: _cut(chunks[key], want, plans[key]) for key, want in wants.items()}, extra


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def _plan(key: Key, want: BoxWant) -> SliceRead:
    if want.whole:
        return plan_slice_read(key, want.stored, full_box(want.stored.shape))
    if want.run is not None:
        exact = plan_flat_read(key, want.stored, want.box, want.run[0], want.run[1] - want.run[0])
        if exact is not None:
            return exact
    return plan_slice_read(key, want.stored, want.box)


def _cut(raw: torch.Tensor, want: BoxWant, read: SliceRead) -> torch.Tensor:
    flat = raw.view(TORCH_DTYPES[want.stored.dtype])
    if want.run is not None and read.dim is None and not read.narrow and flat.numel() == want.run[1] - want.run[0]:
        return flat  # the read was exactly the run
    read_box = full_box(want.stored.shape) if want.whole else want.box
    tensor = box_of_read(flat, want.stored.shape, read, tuple(hi - lo for lo, hi in read_box))
    if want.whole:
        for dim, (lo, hi) in enumerate(want.box):
            tensor = tensor.narrow(dim, lo, hi - lo)
    return tensor if want.run is None else tensor.reshape(-1)[want.run[0]:want.run[1]]
