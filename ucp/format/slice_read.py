"""Which bytes hold a box of a stored tensor: pure planning, no torch, no I/O.

A state stored split-major along dim `d` (docs/FORMAT.md, "Splits") keeps every run of
consecutive splits in one byte range, so a box that cuts only dim `d` is one read: exactly its
bytes when its edges fall on split boundaries (any TP rank whose group size divides the
checkpoint's split count), else the covering splits, narrowed after the read. A row-major state
serves a box cut along dim 0 the same way. Anything else is read whole and narrowed.

A ZeRO partition is a run of a box's elements in row-major order (`plan_flat_read`): one exact
read when the box is contiguous in storage (row-major, cut along dim 0 at most; or exactly one split
of split-major storage, e.g. a row-parallel TP shard), else none (read the box and narrow).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ucp.format.boxes import Box, split_bounds
from ucp.format.byte_ranges import ByteRange
from ucp.format.index import DTYPE_SIZES, StoredState


@dataclass(frozen=True)
class SliceRead:
    """One read for one (parameter, state) box, and how to turn its bytes into the box.

    The bytes hold consecutive blocks along `dim` whose element boundaries are `bounds` (one
    block, the whole tensor, when `dim` is None); joined along `dim` they give the tensor
    narrowed to `[bounds[0], bounds[-1])` there, which `narrow` (dim, start, length) cuts to the
    box when the read is not `exact`.
    """

    key: tuple[str, str]
    range: ByteRange
    dim: int | None
    bounds: tuple[int, ...]
    narrow: tuple[tuple[int, int, int], ...]
    whole: bool       # the range is the whole stored state (its CRC-32 can be checked)

    @property
    def exact(self) -> bool:
        return not self.narrow


def plan_slice_read(key: tuple[str, str], stored: StoredState, box: Box) -> SliceRead:
    """The read that serves `box` of `stored`."""
    shape, begin, end, file = stored.shape, stored.begin, stored.end, stored.file
    itemsize = DTYPE_SIZES[stored.dtype]
    whole = ByteRange(file, begin, end)
    cut = [d for d, (lo, hi) in enumerate(box) if (lo, hi) != (0, shape[d])]
    dim, count = stored.splits or (0, 0)  # count 0: row-major, one split per index along dim 0
    reordered = dim > 0 and count > 1  # stored bytes are not in row-major order
    layout: tuple[int | None, tuple[int, ...]] = (None, ())
    if reordered:
        layout = (dim, tuple(split_bounds(shape[dim], count)))
    if not cut:
        return SliceRead(key, whole, *layout, (), True)
    if any(lo == hi for lo, hi in box):  # a TP rank of a dim smaller than its group holds nothing
        return SliceRead(key, ByteRange(file, begin, begin), None, (), (), False)
    if cut != [dim]:
        return SliceRead(key, whole, *layout, tuple((d, box[d][0], box[d][1] - box[d][0]) for d in cut), True)
    # Cut along the stored split dim (row-major storage is split-major along dim 0, a split per row).
    size = shape[dim]
    count = count or size
    lo, hi = box[dim]
    first, last = _covering(lo, hi, size, count)
    a, b = first * size // count, last * size // count
    row = math.prod(shape) // size * itemsize  # bytes per index along `dim`, across the other dims
    rng = ByteRange(file, begin + a * row, begin + b * row)
    bounds = tuple(split_bounds(size, count)[first:last + 1]) if reordered else (a, b)
    narrow = () if (a, b) == (lo, hi) else ((dim, lo - a, hi - lo),)
    return SliceRead(key, rng, dim, bounds, narrow, (rng.begin, rng.end) == (begin, end))


def plan_flat_read(key: tuple[str, str], stored: StoredState, box: Box, start: int, numel: int) -> SliceRead | None:
    """The exact read of elements [start, start + numel) of `box` flattened, or None when they are not contiguous."""
    shape, begin, end, file = stored.shape, stored.begin, stored.end, stored.file
    itemsize = DTYPE_SIZES[stored.dtype]
    if numel == 0:
        return SliceRead(key, ByteRange(file, begin, begin), None, (), (), False)
    if stored.splits and stored.splits[0] > 0 and stored.splits[1] > 1:
        first = _split_start(box, shape, stored.splits)
        if first is None:
            return None
    elif any((lo, hi) != (0, n) for (lo, hi), n in zip(box[1:], shape[1:])):
        return None
    else:
        first = box[0][0] * math.prod(shape[1:]) if shape else 0
    first = begin + (first + start) * itemsize
    rng = ByteRange(file, first, first + numel * itemsize)
    return SliceRead(key, rng, None, (), (), (rng.begin, rng.end) == (begin, end))


def _split_start(box: Box, shape: tuple[int, ...], splits: tuple[int, int]) -> int | None:
    """Where `box` starts in split-major storage (in elements) when it is exactly one split: a split is
    stored as its own row-major block, so any run of its elements is contiguous. None otherwise."""
    dim, count = splits
    if any((lo, hi) != (0, n) for d, ((lo, hi), n) in enumerate(zip(box, shape)) if d != dim):
        return None
    bounds = split_bounds(shape[dim], count)
    if box[dim] not in zip(bounds, bounds[1:]):
        return None
    return box[dim][0] * (math.prod(shape) // shape[dim])  # the splits before it: box[dim][0] indices along dim


def _covering(lo: int, hi: int, size: int, count: int) -> tuple[int, int]:
    """The fewest consecutive splits [first, last) of `size` cut in `count` that cover [lo, hi)."""
    def bound(i: int) -> int:
        return i * size // count

    first = lo * count // size
    while bound(first + 1) <= lo and first < count:
        first += 1
    while bound(first) > lo:
        first -= 1
    last = -(-hi * count // size)
    while last > first + 1 and bound(last - 1) >= hi:
        last -= 1
    while bound(last) < hi:
        last += 1
    return first, last
