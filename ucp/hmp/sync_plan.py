"""The gradient sync across replicas of unequal TP size, planned: which piece of which gradient every rank
reduces with which ranks, and with what weight. Pure, no torch (`ucp.hmp.grad_sync` does the I/O).

Every partitioned parameter is cut along its TP dim into the layout's global split k
(`choose_global_split`: every TP size divides it, so every rank's slice is a run of whole splits).
Split i is held by exactly one rank of each replica, the TP rank of the stage that runs the
parameter's layer and covers split i; those ranks, and only those, reduce split i. Consecutive
splits held by the same ranks form one piece. A tensor every TP rank holds whole (norms,
row-parallel biases) is one piece reduced among all its holders, each weighted by 1/TP of its
replica's weight, so the sum stays one replica-weighted copy; that needs its gradient to be the same on
every TP rank of a replica, which Megatron's TP operators (all-reduce of the input gradient before a
column-parallel layer) make it.

Weights: replica r computed the mean gradient g_r over its n_r of the step's B samples;
sum_r (n_r / B) g_r is the mean over all B samples, the gradient a homogeneous data-parallel step
takes. Each rank sends and receives its own slices only: O(its parameters) per step.
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from ucp.format.boxes import part_bounds
from ucp.hmp.layout import Layout, LayoutError, ParamSpec, choose_global_split


@dataclass(frozen=True)
class Piece:
    """A part of one rank's gradient of `name`: elements [lo, hi) of its local slice along `dim`, or all of it
    (dim None), multiplied by `weight` before the sum."""

    name: str
    dim: int | None
    lo: int
    hi: int
    weight: float


@dataclass(frozen=True)
class Bucket:
    """The pieces one rank reduces (one sum, in this order on every member) with the ranks of `group`."""

    group: tuple[int, ...]
    pieces: tuple[Piece, ...]


def sync_split(layout: Layout) -> int:
    """The global split the sync cuts gradients in; every TP size of the layout must divide it."""
    k = choose_global_split(layout.tp_sizes)
    left = [t for t in layout.tp_sizes if k % t]
    if left:
        raise LayoutError(f"TP sizes {list(layout.tp_sizes)}: their least common multiple exceeds 64, so TP {left[0]} "
                          "does not own whole splits; the gradient sync needs TP sizes whose lcm is at most 64 "
                          "(powers of two)")
    return k


def sync_groups(layout: Layout, table: Iterable[ParamSpec]) -> tuple[tuple[int, ...], ...]:
    """Every group of two or more ranks the sync reduces in, in one order: each rank creates all of them."""
    k = sync_split(layout)
    return tuple(sorted({tuple(sorted(holders)) for spec in table for holders, _ in _runs(layout, spec, k)
                         if len(holders) > 1}))


def rank_buckets(layout: Layout, table: Iterable[ParamSpec], rank: int, samples: Sequence[int]) -> tuple[Bucket, ...]:
    """`rank`'s pieces by group (groups in `sync_groups` order), weighted by the samples of each replica.

    `samples[i]` is how many of the step's samples replica i computed its mean gradient over.
    """
    if len(samples) != len(layout.replicas) or any(not isinstance(n, int) or n < 1 for n in samples):
        raise LayoutError(f"samples {list(samples)}: need one positive sample count per replica "
                          f"({len(layout.replicas)} replicas)")
    total = sum(samples)
    k = sync_split(layout)
    where = layout.placement(rank)
    by_group: dict[tuple[int, ...], list[Piece]] = {}
    for spec in table:
        for holders, local in _runs(layout, spec, k):
            if rank not in holders or len(holders) == 1:
                continue
            weight = samples[where.replica] / total
            if spec.dim is None:
                weight /= where.tp_size
            lo, hi = local[rank]
            by_group.setdefault(tuple(sorted(holders)), []).append(Piece(spec.name, spec.dim, lo, hi, weight))
    return tuple(Bucket(group, tuple(by_group[group])) for group in sorted(by_group))


def _runs(layout: Layout, spec: ParamSpec, k: int) -> Iterator[tuple[tuple[int, ...], dict[int, tuple[int, int]]]]:
    """The pieces of `spec`: (the ranks holding it, each rank's local element range along the TP dim).

    A replicated tensor is one piece held by every rank of every replica's stage running it,
    with its whole element count as the range.
    """
    stages = [replica.stages[layout.stage_of(i, spec.layer)] for i, replica in enumerate(layout.replicas)]
    if spec.dim is None:
        whole = (0, math.prod(spec.shape))
        holders = tuple(r for stage in stages for r in stage.ranks)
        yield holders, {r: whole for r in holders}
        return
    size = spec.shape[spec.dim]
    first, current = 0, None
    for i in range(k + 1):
        owners = tuple(stage.ranks[i * stage.tp // k] for stage in stages) if i < k else None
        if owners != current:
            if current is not None:
                yield from _run(stages, current, first, i, k, size)
            first, current = i, owners


def _run(stages: list, owners: tuple[int, ...], first: int, stop: int, k: int,
         size: int) -> Iterator[tuple[tuple[int, ...], dict[int, tuple[int, int]]]]:
    lo, hi = first * size // k, stop * size // k
    if hi == lo:  # fewer elements than splits: this run of splits is empty
        return
    local = {}
    for stage, rank in zip(stages, owners):
        start, _ = part_bounds(size, stage.tp, stage.ranks.index(rank))
        local[rank] = (lo - start, hi - start)
    yield owners, local
