"""Parallel layouts and what each rank owns: pure maths, no torch.

A `Layout` lists data-parallel replicas. Each replica is a pipeline of stages; each stage is one
tensor-parallel group (its global ranks, in TP order) that runs a contiguous range of layers.
Replicas may differ in TP sizes, in stage count and in stage boundaries, and take different
numbers of micro-batches: Elastor's heterogeneous model parallelism (HMP). A homogeneous
DP×TP×PP plan is the special case `Layout.homogeneous(...)`; `zero_stage` says whether optimizer
states are further sharded across the replicas that hold the same slice (ZeRO-1 and up).

From a layout and a model's parameter table (`ParamSpec`: name, shape, TP partition dim, layer),
`slice_of` gives every rank its slice of every parameter as a box and, for a checkpoint cut into
`global_split` splits along the partition dim, as a run of splits. Loaders take their slices from
here and nowhere else.

Cutting rule: rank `r` of a TP group of size `t` owns elements `[r*D//t, (r+1)*D//t)` of the
partition dim (size `D`); split `i` of `k` covers `[i*D//k, (i+1)*D//k)`. When `t` divides `k`,
rank `r`'s elements are exactly splits `[r*k/t, (r+1)*k/t)`, whatever `D`.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cached_property

from ucp.errors import UcpError
from ucp.format.boxes import Box, part_bounds, split_bounds
from ucp.storage.json_file import parse_json, shown


class LayoutError(UcpError):
    """A layout is malformed, or does not fit the model it is applied to."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter as a parallel plan sees it.

    `dim` is the dimension tensor parallelism cuts (0 for column-parallel and vocab-parallel
    weights, 1 for row-parallel weights), or None for a tensor every TP rank holds whole (norms,
    row-parallel biases). `layer` is the transformer layer the parameter belongs to; -1 puts it
    with the first layer (embeddings), any value past the last layer with the last (final norm,
    LM head).
    """

    name: str
    shape: tuple[int, ...]
    dim: int | None
    layer: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Stage:
    layers: tuple[int, int]  # [first, stop)
    ranks: tuple[int, ...]   # the TP group, in TP order

    @property
    def tp(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Replica:
    stages: tuple[Stage, ...]
    micro_batches: int

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for s in self.stages for r in s.ranks)


@dataclass(frozen=True)
class Placement:
    """Where one rank sits: its replica, its stage in that replica's pipeline, its TP position."""

    replica: int
    stage: int
    tp_rank: int
    tp_size: int


@dataclass(frozen=True)
class OwnedSlice:
    """A rank's slice of one parameter.

    `box` is the part of the full tensor it holds. `splits` is that part as splits `[a, b)` of
    the partition dim when it is a whole number of splits (None for a replicated parameter, which
    is held whole). `replicated` marks tensors every rank of the TP group holds whole.
    """

    box: Box
    splits: tuple[int, int] | None
    replicated: bool


@dataclass(frozen=True)
class Layout:
    num_layers: int
    replicas: tuple[Replica, ...]
    zero_stage: int = 0

    def __post_init__(self) -> None:
        _validate(self)

    # -- construction and JSON -------------------------------------------------------------------

    @classmethod
    def homogeneous(cls, dp: int, tp: int, pp: int, num_layers: int, *, zero_stage: int = 0,
                    micro_batches: int = 1) -> Layout:
        """DP×TP×PP in Megatron's rank order (TP fastest, then DP, then PP), layers split as evenly as possible."""
        for label, value in (("dp", dp), ("tp", tp), ("pp", pp)):
            if value < 1:
                raise LayoutError(f"{label}={value}: every degree must be at least 1")
        if pp > num_layers:
            raise LayoutError(f"pp={pp} stages for {num_layers} layers: every stage needs at least one layer")
        bounds = split_bounds(num_layers, pp)
        replicas = tuple(
            Replica(tuple(Stage((bounds[s], bounds[s + 1]), tuple(range((s * dp + d) * tp, (s * dp + d + 1) * tp)))
                          for s in range(pp)), micro_batches)
            for d in range(dp))
        return cls(num_layers, replicas, zero_stage)

    @classmethod
    def one_stage(cls, tp_sizes: Iterable[int], micro_batches: Iterable[int], num_layers: int) -> Layout:
        """One single-stage replica per TP size, each with its micro-batches, ranks in order (TP fastest)."""
        replicas, rank = [], 0
        for tp, count in zip(tp_sizes, micro_batches, strict=True):
            replicas.append(Replica((Stage((0, num_layers), tuple(range(rank, rank + tp))),), count))
            rank += tp
        return cls(num_layers, tuple(replicas))

    def to_json(self) -> dict:
        return {"num_layers": self.num_layers, "zero_stage": self.zero_stage,
                "replicas": [{"micro_batches": r.micro_batches,
                              "stages": [{"layers": list(s.layers), "ranks": list(s.ranks)} for s in r.stages]}
                             for r in self.replicas]}

    @classmethod
    def from_json(cls, data: object) -> Layout:
        """A layout from `to_json()`'s dict, or its JSON text; every value checked (an int in its range, a list
        where a list belongs), so that a hand-edited or damaged layout is one line, never a traceback."""
        fields = parse_json(data, "the layout", LayoutError, _LAYOUT_FIX) if isinstance(data, str) else data
        if isinstance(fields, dict) and "plans" in fields and "replicas" not in fields:
            raise LayoutError("the layout is `ucp plan --json`'s output, which lists plans: give one plan's "
                              '"layout" (e.g. plans[0]["layout"])')
        fields = _object(fields, "the layout", ("num_layers", "replicas"), ("zero_stage",))
        replicas = []
        for i, r in enumerate(_list(fields["replicas"], '"replicas"', MAX_RANKS)):
            r = _object(r, f"replica {i}", ("stages", "micro_batches"), ())
            stages = []
            for j, st in enumerate(_list(r["stages"], f"replica {i} \"stages\"", MAX_LAYERS)):
                where = f"replica {i} stage {j}"
                st = _object(st, where, ("layers", "ranks"), ())
                layers = _list(st["layers"], f'{where} "layers"', 2)
                if len(layers) != 2:
                    raise LayoutError(f'{where} "layers": {len(layers)} values; give [first, stop)')
                stages.append(Stage((_int(layers[0], f'{where} "layers"', 0, MAX_LAYERS),
                                     _int(layers[1], f'{where} "layers"', 0, MAX_LAYERS)),
                                    tuple(_int(x, f'{where} "ranks"', 0, MAX_RANKS - 1)
                                          for x in _list(st["ranks"], f'{where} "ranks"', MAX_RANKS))))
            replicas.append(Replica(tuple(stages), _int(r["micro_batches"], f'replica {i} "micro_batches"', 0,
                                                        MAX_MICRO_BATCHES)))
        return cls(_int(fields["num_layers"], '"num_layers"', 1, MAX_LAYERS), tuple(replicas),
                   _int(fields.get("zero_stage", 0), '"zero_stage"', 0, 3))

    # -- queries -----------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return sum(len(r.ranks) for r in self.replicas)

    @property
    def tp_sizes(self) -> tuple[int, ...]:
        """The distinct TP group sizes, ascending."""
        return tuple(sorted({s.tp for r in self.replicas for s in r.stages}))

    @cached_property
    def _placements(self) -> dict[int, Placement]:
        return {rank: Placement(i, j, k, s.tp)
                for i, r in enumerate(self.replicas) for j, s in enumerate(r.stages) for k, rank in enumerate(s.ranks)}

    def placement(self, rank: int) -> Placement:
        try:
            return self._placements[rank]
        except KeyError:
            raise LayoutError(f"rank {rank} is not in this layout (ranks 0..{self.world_size - 1})") from None

    def stage_of(self, replica: int, layer: int) -> int:
        """The stage of `replica` that runs `layer` (clamped to the model: -1 is the first, past the end the last)."""
        layer = min(max(layer, 0), self.num_layers - 1)
        for j, stage in enumerate(self.replicas[replica].stages):
            if stage.layers[0] <= layer < stage.layers[1]:
                return j
        raise LayoutError(f"replica {replica} runs no stage holding layer {layer}")  # unreachable after _validate

    def slice_of(self, rank: int, spec: ParamSpec, global_split: int | None = None) -> OwnedSlice | None:
        """What `rank` holds of `spec`, or None when its stage does not run the parameter's layer.

        `global_split` is the split count the slice is expressed in (default: `self.split_count()`).
        """
        _check_spec(spec)
        where = self.placement(rank)
        if self.stage_of(where.replica, spec.layer) != where.stage:
            return None
        full = tuple((0, n) for n in spec.shape)
        if spec.dim is None:
            return OwnedSlice(full, None, True)
        k = global_split or self.split_count()
        size = spec.shape[spec.dim]
        lo, hi = part_bounds(size, where.tp_size, where.tp_rank)
        box = full[:spec.dim] + ((lo, hi),) + full[spec.dim + 1:]
        splits = None
        if k % where.tp_size == 0:
            splits = (where.tp_rank * k // where.tp_size, (where.tp_rank + 1) * k // where.tp_size)
        return OwnedSlice(box, splits, False)

    def rank_slices(self, rank: int, table: Iterable[ParamSpec],
                    global_split: int | None = None) -> dict[str, OwnedSlice]:
        """Every parameter of `table` that `rank` holds, with its slice."""
        out = {}
        for spec in table:
            owned = self.slice_of(rank, spec, global_split)
            if owned is not None:
                out[spec.name] = owned
        return out

    def zero_shard(self, rank: int, spec: ParamSpec) -> tuple[int, int] | None:
        """The flat range of `rank`'s own slice whose optimizer states it keeps, or None if it holds none of `spec`.

        ZeRO stage 0 keeps them all. From stage 1 on they are cut evenly, in rank order, among the
        peers of `rank`: the ranks of every replica that hold the parameter at the same TP size and
        TP position (so the same box). Peers of a homogeneous layout are its DP group.
        """
        mine = self.slice_of(rank, spec)
        if mine is None:
            return None
        numel = math.prod(b - a for a, b in mine.box)
        if self.zero_stage == 0:
            return (0, numel)
        where = self.placement(rank)
        peers = []
        for i, replica in enumerate(self.replicas):
            stage = replica.stages[self.stage_of(i, spec.layer)]
            if stage.tp == where.tp_size:
                peers.append(stage.ranks[where.tp_rank])
        return part_bounds(numel, len(peers), sorted(peers).index(rank))

    def split_count(self, bound: int = 64) -> int:
        """The global split this layout alone asks for: see `choose_global_split`."""
        return choose_global_split(self.tp_sizes, bound)

    def describe(self) -> str:
        """One line per replica: its micro-batches and each stage's TP size and layers."""
        lines = []
        for i, r in enumerate(self.replicas):
            stages = " | ".join(f"TP{s.tp} layers {s.layers[0]}-{s.layers[1] - 1} ranks {_span(s.ranks)}"
                                for s in r.stages)
            lines.append(f"replica {i} ({r.micro_batches} micro-batches): {stages}")
        return "\n".join(lines)


def choose_global_split(tp_sizes: Iterable[int], bound: int = 64) -> int:
    """A split count every given TP size divides (their lcm), so every rank owns whole splits.

    When the lcm exceeds `bound`, sizes are taken largest first while the lcm stays within it; a
    size left out still loads correctly, reading the splits that cover its slice.
    """
    split = 1
    for t in sorted(set(tp_sizes), reverse=True):
        if t < 1:
            raise LayoutError(f"TP size {t}: must be at least 1")
        if math.lcm(split, t) <= bound:
            split = math.lcm(split, t)
    return split


MAX_LAYERS = 1 << 20
MAX_RANKS = 1 << 24
MAX_MICRO_BATCHES = 1 << 30
_LAYOUT_FIX = ("expected {'num_layers': L, 'replicas': [{'micro_batches': M, 'stages': [{'layers': [a, b], "
               "'ranks': [...]}]}]}, as `Layout.to_json()` or `ucp plan --json` writes")


def _object(value: object, where: str, required: tuple[str, ...], optional: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise LayoutError(f"{where}: a JSON {type(value).__name__}, not an object; {_LAYOUT_FIX}")
    for key in value:
        if key not in required + optional:
            raise LayoutError(f"{where}: unknown key {str(key)[:40]!r}; known: {', '.join(required + optional)}")
    for key in required:
        if key not in value:
            raise LayoutError(f"{where}: has no {key!r}; {_LAYOUT_FIX}")
    return value


def _list(value: object, where: str, most: int) -> list:
    if not isinstance(value, list):
        raise LayoutError(f"{where}: {shown(value)} is not a list; {_LAYOUT_FIX}")
    if len(value) > most:
        raise LayoutError(f"{where}: {len(value)} entries, more than the {most} a layout may have")
    return value


def _int(value: object, where: str, least: int, most: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
        raise LayoutError(f"{where}: {shown(value)} must be an integer from {least} to {most}")
    return value


def _span(ranks: tuple[int, ...]) -> str:
    if list(ranks) == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))


def _check_spec(spec: ParamSpec) -> None:
    if spec.dim is not None and not 0 <= spec.dim < len(spec.shape):
        raise LayoutError(f"{spec.name}: partition dim {spec.dim} is outside its shape {list(spec.shape)}")


def _validate(layout: Layout) -> None:
    if layout.num_layers < 1:
        raise LayoutError(f"num_layers={layout.num_layers}: a model has at least one layer")
    if not layout.replicas:
        raise LayoutError("a layout needs at least one replica")
    if layout.zero_stage not in (0, 1, 2, 3):
        raise LayoutError(f"zero_stage={layout.zero_stage}: use 0, 1, 2 or 3")
    seen: list[int] = []
    for i, replica in enumerate(layout.replicas):
        if replica.micro_batches < 1:
            raise LayoutError(f"replica {i}: {replica.micro_batches} micro-batches; every replica needs at least one")
        if not replica.stages:
            raise LayoutError(f"replica {i}: has no stages")
        expect = 0
        for j, stage in enumerate(replica.stages):
            first, stop = stage.layers
            if first != expect or stop <= first:
                raise LayoutError(f"replica {i} stage {j}: layers [{first}, {stop}) must start at layer {expect} and "
                                  "hold at least one layer; stages cover the layers in order, without gaps")
            if not stage.ranks:
                raise LayoutError(f"replica {i} stage {j}: has no ranks")
            expect = stop
            seen.extend(stage.ranks)
        if expect != layout.num_layers:
            raise LayoutError(f"replica {i}: stages end at layer {expect}, the model has {layout.num_layers}")
    if sorted(seen) != list(range(len(seen))):
        counts = Counter(seen)  # linear: a layout of 60,000 ranks is checked in milliseconds
        dup = sorted(r for r, n in counts.items() if n > 1)
        raise LayoutError(f"ranks must be 0..{len(seen) - 1}, each in exactly one stage" +
                          (f"; rank {dup[0]} appears twice" if dup else f"; got {sorted(seen)}"))
