"""Decide a parameter's pattern from what its fragments look like, plus any declared hints.

The recognizer sees only metadata (ranks, piece shapes, flat offsets), never bytes, so it runs in
the planner before any tensor is read. When the metadata admits more than one reading it raises
`AmbiguousPatternError` naming the parameter and the hint that settles it.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ucp.errors import AmbiguousPatternError
from ucp.patterns.types import Pattern, PatternSpec


@dataclass(frozen=True)
class FragmentInfo:
    """What the recognizer knows of one fragment.

    shape:  the shape of the piece as stored.
    offset: for 1-D runs of a flattened tensor (ZeRO partitions), where the run starts in the
            flattened, padded full tensor; None for pieces that keep their own shape.
    """

    rank: int
    shape: tuple[int, ...]
    offset: int | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Hints:
    """Declared knowledge about one parameter, e.g. from DeepSpeed's `universal_checkpoint_info`."""

    pattern: Pattern | None = None
    dim: int | None = None
    padded_dim_size: int | None = None
    sub_widths: tuple[tuple[int, ...], ...] | None = None


_FIX = ("declare it in the model's universal_checkpoint_info (e.g. tp_replicated_parameter_patterns, "
        "parameter_with_row_parallelism_patterns) or pass --pattern '{name}=<pattern>'")


def recognize(name: str, shape: Sequence[int], fragments: Sequence[FragmentInfo],
              hints: Hints | None = None) -> PatternSpec:
    """The PatternSpec under which `fragments`, ordered by rank, rebuild a tensor of `shape`."""
    shape = tuple(int(s) for s in shape)
    if not fragments:
        raise AmbiguousPatternError(f"{name}: no rank holds any part of this parameter")
    if hints is not None and hints.pattern is not None:
        return _from_hints(name, shape, fragments, hints, hints.pattern)
    if all(f.offset is not None for f in fragments):
        return _recognize_flat(name, shape, fragments)
    if any(f.offset is not None for f in fragments):
        raise AmbiguousPatternError(f"{name}: mixes flat and shaped fragments; {_FIX.format(name=name)}")
    return _recognize_shaped(name, shape, fragments)


@dataclass(frozen=True)
class OuterPiece:
    """One outer piece of a nested layout and the fragments that hold it.

    A tensor-parallel rank's shard, or a pipeline stage's copy of a tied weight, is an outer piece;
    ZeRO then partitions each one over its data-parallel ranks into `fragments`.
    """

    rank: int
    shape: tuple[int, ...]
    fragments: tuple[FragmentInfo, ...]


def recognize_nested(name: str, shape: Sequence[int], pieces: Sequence[OuterPiece],
                     hints: Hints | None = None) -> PatternSpec:
    """The PatternSpec under which outer `pieces`, ordered by rank, each rebuilt from its own
    fragments, rebuild a tensor of `shape`.

    The outer layout is recognized as shaped fragments of the pieces' shapes (`hints` apply to
    it); the inner layout from each piece's fragments, which must all be held the same way. An
    outer split becomes SHARD_HY; any other outer pattern keeps its name and nests `inner`.
    """
    shape = tuple(int(s) for s in shape)
    if not pieces:
        raise AmbiguousPatternError(f"{name}: no rank holds any part of this parameter")
    inner = [recognize(name, p.shape, p.fragments) for p in pieces]
    if all(s.flat and s.pattern in (Pattern.UNIQUE, Pattern.SHARD_V) for s in inner):
        # ZeRO cuts every piece at its own partition boundaries: one piece may sit in one rank's
        # partition, the next straddle two. A single flat run is a flat split into one run.
        inner = [dataclasses.replace(s, pattern=Pattern.SHARD_V) for s in inner]
    kinds = sorted({f"{s.pattern.value}{' (flat)' if s.flat else ''}" for s in inner})
    if len(kinds) > 1:
        raise AmbiguousPatternError(f"{name}: its outer pieces are held in different ways ({', '.join(kinds)}); "
                                    "the checkpoint's partition metadata is inconsistent")
    outer = recognize(name, shape, [FragmentInfo(p.rank, tuple(p.shape)) for p in pieces], hints)
    shard_shapes = tuple(tuple(p.shape) for p in pieces)
    if outer.pattern in (Pattern.SHARD_V, Pattern.SHARD_H):
        return PatternSpec(Pattern.SHARD_HY, shape, dim=outer.dim, padded_size=outer.padded_size, inner=inner[0],
                           shard_shapes=shard_shapes)
    return dataclasses.replace(outer, inner=inner[0], shard_shapes=shard_shapes)


Held = tuple[int, tuple[int, ...], Sequence[FragmentInfo]]  # (outer rank, piece shape, its fragments in rank order)


def outer_kind(shape: Sequence[int], outer: Sequence[Held], hints: Hints | None = None) -> str:
    """How outer pieces hold a tensor: "single" (one piece of the full shape, no hints: its fragments are the
    tensor's own), "whole" (every piece held whole, e.g. ZeRO-0 TP shards: one fragment per outer rank) or
    "nested" (each piece partitioned again, e.g. by ZeRO)."""
    if len(outer) == 1 and tuple(outer[0][1]) == tuple(shape) and hints is None:
        return "single"
    if all(len(infos) == 1 and tuple(infos[0].shape) == tuple(piece) and infos[0].offset is None
           for _, piece, infos in outer):
        return "whole"
    return "nested"


def recognize_outer(name: str, shape: Sequence[int], outer: Sequence[Held], hints: Hints | None = None
                    ) -> PatternSpec:
    """The PatternSpec of a tensor held as outer pieces (TP shards, pipeline stages' or EP ranks' copies), each
    as its own fragments: the converters' and the asynchronous saver's single rule, so that a save from a live
    engine records the pattern `ucp convert` of the same engine's checkpoint records."""
    kind = outer_kind(shape, outer, hints)
    if kind == "single":
        return recognize(name, shape, list(outer[0][2]))
    if kind == "whole":
        return recognize(name, shape, [FragmentInfo(rank, tuple(piece)) for rank, piece, _ in outer], hints)
    return recognize_nested(name, shape, [OuterPiece(rank, tuple(piece), tuple(infos)) for rank, piece, infos in outer],
                            hints)


def _recognize_flat(name: str, shape: tuple[int, ...], fragments: Sequence[FragmentInfo]) -> PatternSpec:
    numel = math.prod(shape)
    if len(fragments) > 1 and all(f.offset == 0 and f.numel == numel for f in fragments):
        return PatternSpec(Pattern.REPLICATE, shape, flat=True)
    ordered = sorted(fragments, key=lambda f: f.offset or 0)  # every flat fragment has its offset
    if [f.rank for f in ordered] != sorted(f.rank for f in fragments):
        raise AmbiguousPatternError(f"{name}: flat fragments are not in rank order; the checkpoint's "
                                    "partition metadata is inconsistent")
    cursor = 0
    for f in ordered:
        if f.offset != cursor:
            raise AmbiguousPatternError(
                f"{name}: flat fragments leave a gap or overlap at element {cursor} "
                f"(rank {f.rank} starts at {f.offset}); a rank file may be missing")
        cursor += f.numel
    if cursor < numel:
        raise AmbiguousPatternError(f"{name}: fragments cover {cursor} of {numel} elements; "
                                    "a rank file may be missing")
    if len(fragments) == 1:
        return PatternSpec(Pattern.UNIQUE, shape, flat=True, padded_size=cursor)
    return PatternSpec(Pattern.SHARD_V, shape, flat=True, padded_size=cursor)


def _recognize_shaped(name: str, shape: tuple[int, ...], fragments: Sequence[FragmentInfo]) -> PatternSpec:
    shapes = [f.shape for f in fragments]
    if len(fragments) == 1:
        if shapes[0] != shape:
            raise AmbiguousPatternError(f"{name}: its only fragment has shape {shapes[0]}, the parameter "
                                        f"{shape}; {_FIX.format(name=name)}")
        return PatternSpec(Pattern.UNIQUE, shape)
    if all(s == shape for s in shapes):
        # Identical shapes could also be partial sums; only a hint can say so (Hints(pattern=PARTIAL)).
        return PatternSpec(Pattern.REPLICATE, shape)
    candidates = [d for d in range(len(shape)) if _concatenates(shapes, shape, d)]
    if len(candidates) == 1:
        dim = candidates[0]
        if dim > 1:
            raise AmbiguousPatternError(f"{name}: split along dim {dim}; {_FIX.format(name=name)}")
        return PatternSpec(Pattern.SHARD_V if dim == 0 else Pattern.SHARD_H, shape, dim=dim)
    raise AmbiguousPatternError(
        f"{name}: fragment shapes {shapes} do not determine how they form {shape}; {_FIX.format(name=name)}")


def _concatenates(shapes: Sequence[tuple[int, ...]], full: tuple[int, ...], dim: int) -> bool:
    if any(len(s) != len(full) for s in shapes):
        return False
    for d in range(len(full)):
        if d != dim and any(s[d] != full[d] for s in shapes):
            return False
    return sum(s[dim] for s in shapes) == full[dim]


def _from_hints(name: str, shape: tuple[int, ...], fragments: Sequence[FragmentInfo], hints: Hints,
                pattern: Pattern) -> PatternSpec:
    if pattern in (Pattern.REPLICATE, Pattern.PARTIAL, Pattern.UNIQUE):
        bad = [f.rank for f in fragments if f.shape != shape and f.offset is None]
        if bad:
            raise AmbiguousPatternError(f"{name}: declared {pattern.value} but ranks {bad} hold a different "
                                        f"shape than {shape}")
        return PatternSpec(pattern, shape)
    if pattern in (Pattern.SHARD_V, Pattern.SHARD_H):
        dim = 0 if pattern is Pattern.SHARD_V else 1
        total = sum(f.shape[dim] for f in fragments)
        if total < shape[dim] or (total > shape[dim] and hints.padded_dim_size != total):
            raise AmbiguousPatternError(f"{name}: declared {pattern.value} but pieces sum to {total} along "
                                        f"dim {dim}, not {shape[dim]}")
        return PatternSpec(pattern, shape, dim=dim, padded_size=total if total > shape[dim] else None)
    if pattern is Pattern.SHARD_NC:
        if hints.sub_widths is None or hints.dim is None:
            raise AmbiguousPatternError(f"{name}: shard_nc needs the sub-parameter widths and dim")
        held = [sum(w[r] for w in hints.sub_widths) if all(len(w) == len(fragments) for w in hints.sub_widths)
                else None for r in range(len(fragments))]
        if held != [f.shape[hints.dim] if len(f.shape) > hints.dim else None for f in fragments]:
            raise AmbiguousPatternError(f"{name}: declared shard_nc with sub-parameter widths "
                                        f"{[list(w) for w in hints.sub_widths]}, which do not fill its pieces "
                                        f"{[f.shape for f in fragments]} along dim {hints.dim}")
        return PatternSpec(pattern, shape, dim=hints.dim, sub_widths=hints.sub_widths)
    raise AmbiguousPatternError(f"{name}: hint {pattern.value} is not enough to rebuild it; {_FIX.format(name=name)}")
