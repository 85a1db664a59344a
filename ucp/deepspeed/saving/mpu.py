"""Where the pieces of a Megatron-style TP shard go in the full tensor: pure planning for saves from engines with
an `mpu` (tensor parallelism), inside a `PipelineModule` or not.

Such a module declares its TP layout with Megatron-DeepSpeed's pattern lists in `universal_checkpoint_info`,
which `ucp convert` reads with `ucp.converters.deepspeed.lists`; `tp_layout` reads them the same way, so a
save and a conversion see one layout. A shard is one box of the full tensor (a column- or row-parallel
split, a replicated copy) or several (a fused QKV or gate/up weight: a block of rows of each
sub-parameter), and a vocabulary-parallel shard's padding rows are in no box. `place_shards` turns every
rank's `Holding` of a shard (its ZeRO run of the flattened shard) into one `Holding` per box it fills, each
with the run of that box it holds and where that run starts in the rank's live run (`view_offset`).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

from ucp.converters.deepspeed.lists import checkpoint_layouts
from ucp.deepspeed.saving.plan import Holding
from ucp.errors import UnsupportedLayoutError
from ucp.format.boxes import Box
from ucp.patterns import Hints, Pattern

Shape = tuple[int, ...]


def tp_layout(name: str, shapes: Sequence[Shape], uc_info: dict | None, trainable: bool) -> tuple[Shape, Hints]:
    """The full shape of `name` and how its TP shards of `shapes` (in TP rank order) join, as `ucp convert` reads
    the module's `universal_checkpoint_info`; what it does not declare, from the shapes as the converter does
    (split along the one dim where they differ; shards of one shape are copies of one tensor)."""
    shapes = [tuple(s) for s in shapes]
    declared = checkpoint_layouts(uc_info or {}, "the engine's universal_checkpoint_info",
                                  {name} if trainable else set())(name, shapes)
    if declared is not None:
        return declared
    differ = [d for d in range(len(shapes[0])) if len({s[d] for s in shapes}) > 1]
    if not differ:
        return shapes[0], Hints(pattern=Pattern.REPLICATE)
    if len(differ) == 1 and differ[0] < 2 and len({len(s) for s in shapes}) == 1:
        dim = differ[0]
        full = (*shapes[0][:dim], sum(s[dim] for s in shapes), *shapes[0][dim + 1:])
        return full, Hints(pattern=Pattern.SHARD_V if dim == 0 else Pattern.SHARD_H)
    raise UnsupportedLayoutError(f"{name}: its TP shards have shapes {shapes} and the model's "
                                 "universal_checkpoint_info declares no layout for it; declare it there (as "
                                 "Megatron-DeepSpeed's pattern lists do) to save it with ucp")


def pieces(name: str, full: Shape, hints: Hints, shapes: Sequence[Shape], tp_rank: int) -> list[tuple[int, Box]]:
    """(first element in the flattened shard, box of the full tensor) of each piece of TP rank `tp_rank`'s shard
    under `hints`, in shard order; padding rows belong to no piece."""
    shard = tuple(shapes[tp_rank])
    pattern = hints.pattern
    if pattern in (Pattern.REPLICATE, Pattern.PARTIAL):
        return [(0, tuple((0, n) for n in full))]
    if pattern in (Pattern.SHARD_V, Pattern.SHARD_H):
        dim = 0 if pattern is Pattern.SHARD_V else 1
        lo = sum(s[dim] for s in shapes[:tp_rank])
        hi = min(lo + shard[dim], full[dim])
        if hi <= lo:
            return []  # every row of this shard is padding
        if dim == 0 and hi - lo < shard[0] and tp_rank < len(shapes) - 1:
            raise UnsupportedLayoutError(f"{name}: TP rank {tp_rank} holds padding rows before another rank's; ucp "
                                         "places vocabulary padding at the end of the last shard only")
        return [(0, tuple((lo, hi) if d == dim else (0, n) for d, n in enumerate(full)))]
    if pattern is Pattern.SHARD_NC and hints.dim == 0 and hints.sub_widths is not None:
        row = math.prod(shard[1:])
        out, cursor, begin = [], 0, 0
        for widths in hints.sub_widths:
            lo = begin + sum(widths[:tp_rank])
            out.append((cursor * row, ((lo, lo + widths[tp_rank]), *((0, n) for n in full[1:]))))
            cursor += widths[tp_rank]
            begin += sum(widths)
        return out
    raise UnsupportedLayoutError(f"{name}: declared {pattern.value if pattern else 'no pattern'} along dim "
                                 f"{hints.dim}; ucp places TP shards split along dim 0 or 1, or fused along dim 0")


def place_shards(every: Sequence[Holding], uc_info: dict | None) -> list[Holding]:
    """`every` (each rank's holdings, in rank order) with each holding of a Megatron TP shard replaced by one
    holding per box of the full tensor that its ZeRO run fills; other holdings as they are."""
    shapes: dict[str, dict[int, Shape]] = {}
    for h in every:
        if h.shard is not None:
            shapes.setdefault(h.name, {}).setdefault(h.shard.tp_rank, h.shard.shape)
    layouts = {name: tp_layout(name, [by_rank[r] for r in sorted(by_rank)], uc_info, _trainable(every, name))
               for name, by_rank in shapes.items()}
    out = []
    for h in every:
        if h.shard is None:
            out.append(h)
            continue
        ordered = [shapes[h.name][r] for r in sorted(shapes[h.name])]
        full, hints = layouts[h.name]
        end = h.shard.start + h.shard.numel
        for first, box in pieces(h.name, full, hints, ordered, h.shard.tp_rank):
            size = math.prod(hi - lo for lo, hi in box)
            lo, hi = max(h.shard.start, first), min(end, first + size)
            out.append(Holding(h.name, h.rank, box, max(0, lo - first), max(0, hi - lo), h.whole, h.outer, h.inner,
                               h.kind, full, h.states, h.group, h.model_dtype, max(0, lo - h.shard.start), h.shard))
    return out


def first_stage_only(every: Sequence[Holding]) -> list[Holding]:
    """`every` without the holdings of a Megatron TP shard on a later pipeline stage than the first that holds its
    tensor: `ucp convert` reads a tensor on several stages (a tied module) from its first stage, whose copy may
    differ from the others' (a tied module's parameter that is not the tied weight drifts on each stage)."""
    first: dict[str, int] = {}
    for h in every:
        if h.shard is not None:
            first[h.name] = min(first.get(h.name, h.shard.stage), h.shard.stage)
    return [h for h in every if h.shard is None or h.shard.stage == first[h.name]]


def _trainable(every: Sequence[Holding], name: str) -> bool:
    return any(h.name == name and h.kind == "param" for h in every)
