"""Which rank of a job writes which elements of each full tensor, and under which pattern: pure planning.

Every rank reports what it holds of each tensor (`Holding`): the box of the full tensor its module
holds (a TP shard, or all of it), the run of that box's flattened elements its ZeRO partition keeps
(or all of it, `whole`), and which outer piece and inner rank it is (TP rank and DP rank, as `ucp
convert` numbers a checkpoint's rank files). Every rank then computes the same plan from all reports:

* each element of each full tensor is written by one rank: of the copies of a box (a tensor
  replicated over TP ranks is one box held by each TP rank, each partitioned over its own DP ranks),
  the copy of the lowest outer rank writes it, each rank its own run; a box held whole by several
  ranks (with the other boxes of a fused shard they hold) is written by one of them, chosen to balance
  bytes (`writers`);
* a rank's run of a box is a run of the full tensor when the box spans whole rows (a column-parallel
  shard), else one run per row of the box it crosses (`box_runs`);
* the pattern is the one `ucp convert` records for the same engine's checkpoint, from the same
  fragments (`pattern_of`, through `ucp.patterns.recognize.recognize_outer`).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ucp.format.boxes import Box
from ucp.patterns import Hints, PatternSpec
from ucp.patterns.recognize import FragmentInfo, recognize_outer


@dataclass(frozen=True)
class Shard:
    """A Megatron-style TP shard as a rank's module holds it, and DeepSpeed's checkpoint records it: the pattern is
    read from these (as `ucp convert` reads it), the elements are written from the boxes the shard's pieces fill."""

    tp_rank: int
    stage: int
    shape: tuple[int, ...]
    start: int    # the rank's ZeRO run of the flattened shard
    numel: int


@dataclass(frozen=True)
class Holding:
    """What global rank `rank` holds of tensor `name`: elements [start, start + numel) of its box, flattened;
    and what the tensor is, which a rank that does not hold it (another pipeline stage) learns from here."""

    name: str
    rank: int
    box: Box          # of the full tensor
    start: int
    numel: int
    whole: bool       # holds every element of the box, as the other ranks sharing the box do
    outer: int        # the outer piece's rank (TP rank, pipeline stage, stage x T + TP rank under an mpu; else 0)
    inner: int        # the rank among the ranks sharing the box (its DP rank)
    kind: str = "param"                          # "param", "frozen" or "buffer"
    shape: tuple[int, ...] = ()                  # of the full tensor
    states: tuple[tuple[str, str], ...] = ()     # (state, stored dtype) in state order
    group: int | None = None                     # optimizer param group (trainable tensors)
    model_dtype: str = "float32"
    view_offset: int = 0                         # where these elements start in the rank's live run of the tensor
    shard: Shard | None = None                   # the Megatron TP shard these elements are a piece of


def tensors(holdings: Iterable[Holding]) -> list[Holding]:
    """One holding per tensor, the whole model's, the same list on every rank: trainable tensors first, then
    frozen ones and buffers, each in the order ranks report them (rank order, first seen), as `ucp convert`
    lists a pipeline's stages."""
    seen: dict[str, Holding] = {}
    for h in holdings:
        seen.setdefault(h.name, h)
    return sorted(seen.values(), key=lambda h: h.kind != "param")


def entries(model: Sequence[Holding]) -> list[tuple[Holding, str, str]]:
    """(tensor, state, stored dtype) of every state of `model`'s tensors, state-major: every trainable tensor's
    fp32, then each moment, then frozen weights and buffers, each in model order (`ucp.deepspeed.saving.files`),
    so a rank's ZeRO run of one state lands in one contiguous byte range."""
    order = list(dict.fromkeys(s for h in model if h.kind == "param" for s, _ in h.states))
    out = [(h, s, dict(h.states)[s]) for s in order for h in model if h.kind == "param"]
    out += [(h, s, dtype) for kind in ("frozen", "buffer") for h in model if h.kind == kind for s, dtype in h.states]
    return out


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_runs(shape: Sequence[int], box: Box, start: int, numel: int) -> list[tuple[int, int, int]]:
    """(first element in the flattened full tensor, first element in the run, count) of each contiguous run of
    elements [start, start + numel) of `box` (flattened) in the full tensor of `shape`."""
    if numel <= 0:
        return []
    extents = [hi - lo for lo, hi in box]
    # the trailing dims the box spans whole are contiguous with each other: a row of `row` elements
    inner = len(shape)
    while inner > 0 and extents[inner - 1] == shape[inner - 1]:
        inner -= 1
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    if inner == 0:
        return [(start, 0, numel)]
    row = extents[inner - 1] * strides[inner - 1]  # elements of one contiguous row of the box
    runs = []
    cursor = start
    while cursor < start + numel:
        index, within = divmod(cursor, row)
        n = min(row - within, start + numel - cursor)
        # the row's coordinates in the box, outer dims first, then its place in the full tensor
        coords, rest = [], index
        for d in reversed(range(inner - 1)):
            rest, c = divmod(rest, extents[d])
            coords.append(c)
        coords.reverse()
        first = sum((box[d][0] + c) * strides[d] for d, c in enumerate(coords))
        first += box[inner - 1][0] * strides[inner - 1] + within
        runs.append((first, cursor - start, n))
        cursor += n
    return runs


def writers(holdings: Iterable[Holding], element_bytes: dict[str, int]) -> set[tuple[str, int]]:
    """(name, rank) of every holding that writes its elements: each element of each tensor once.

    For each box, the holdings of its lowest outer rank write; of those, a partitioned run is written by its
    holder; the boxes of a tensor held whole by the same ranks (one box, or each box of a fused TP shard) by one
    of those ranks (any copy), the one with the fewest bytes so far, largest first: a writer writes every box of
    the tensor it holds. `element_bytes` gives each name's bytes per element over all its states.
    """
    boxes: dict[tuple[str, Box], list[Holding]] = {}
    for h in holdings:
        boxes.setdefault((h.name, h.box), []).append(h)
    out: set[tuple[str, int]] = set()
    load: dict[int, int] = {}
    whole: dict[tuple[str, tuple[int, ...]], int] = {}  # (name, the ranks holding its boxes whole) -> bytes
    for (name, box), held in boxes.items():
        if all(h.whole for h in held):
            ranks = tuple(sorted({h.rank for h in held}))
            whole[(name, ranks)] = whole.get((name, ranks), 0) + math.prod(hi - lo for lo, hi in box) * \
                element_bytes[name]
            continue
        first = min(h.outer for h in held)
        for h in held:
            if h.outer == first and h.numel > 0:
                out.add((name, h.rank))
                load[h.rank] = load.get(h.rank, 0) + h.numel * element_bytes[name]
    for (name, ranks), size in sorted(whole.items(), key=lambda w: (-w[1], w[0])):
        rank = min(ranks, key=lambda r: (load.get(r, 0), r))
        out.add((name, rank))
        load[rank] = load.get(rank, 0) + size
    return out


def pattern_of(name: str, shape: Sequence[int], holdings: Sequence[Holding], hints: Hints | None) -> PatternSpec:
    """The pattern `ucp convert` records for `name` held as `holdings` (of every rank), under `hints` (what the
    engine declares of its TP layout; None without model parallelism)."""
    by_outer: dict[int, list[Holding]] = {}
    for h in holdings:
        by_outer.setdefault(h.outer, []).append(h)
    outer = []
    for rank in sorted(by_outer):
        held = sorted(by_outer[rank], key=lambda h: h.inner)
        piece = tuple(hi - lo for lo, hi in held[0].box)
        if held[0].whole:
            infos = [FragmentInfo(0, piece)]
        else:
            infos = [FragmentInfo(h.inner, (h.numel,), h.start) for h in held if h.numel > 0]
        outer.append((rank, piece, infos))
    return recognize_outer(name, tuple(shape), outer, hints)

