"""The gradient sync across unequal replicas, planned (ucp.hmp.sync_plan): simulated on random layouts.

Each replica gets a random full gradient; every rank holds its slices of its replica's gradient; the
buckets are applied as the all-reduce would (weighted pieces summed over the group, in place on every
member). Every rank must end with its slices of sum_r (n_r / B) G_r, the homogeneous step's gradient,
and send no more than its own slices. Negative controls: an unweighted average, and a plan with one
bucket left out, must fail the same check.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from ucp.hmp.layout import Layout, LayoutError, ParamSpec, Replica, Stage
from ucp.hmp.sync_plan import Bucket, Piece, rank_buckets, sync_groups
from unit.test_layout import layouts, tables

TP2_TP1 = Layout(2, (Replica((Stage((0, 2), (0, 1)),), 5), Replica((Stage((0, 2), (2,)),), 3)))
TABLE = [ParamSpec("embed", (13, 4), 0, -1), ParamSpec("norm", (4,), None, 0), ParamSpec("fc2", (4, 6), 1, 1)]


def simulate(layout: Layout, table: list[ParamSpec], samples: list[int], seed: int = 0,
             drop: int | None = None) -> tuple[dict, dict]:
    """(what each rank holds after the planned sync, what it should hold): {(rank, name): tensor}."""
    g = torch.Generator().manual_seed(seed)
    grads = [{s.name: torch.randn(s.shape, generator=g, dtype=torch.float64) for s in table} for _ in layout.replicas]
    held, want = {}, {}
    for rank in range(layout.world_size):
        replica = layout.placement(rank).replica
        for name, owned in layout.rank_slices(rank, table).items():
            box = tuple(slice(a, b) for a, b in owned.box)
            held[rank, name] = grads[replica][name][box].clone()
            want[rank, name] = sum(n / sum(samples) * grads[r][name] for r, n in enumerate(samples))[box]
    plans = {rank: rank_buckets(layout, table, rank, samples) for rank in range(layout.world_size)}
    if drop is not None:
        plans[drop] = plans[drop][1:]
    sums = {}
    for rank, buckets in plans.items():  # every member adds its weighted pieces to the group's sum, in order
        for bucket in buckets:
            flat = torch.cat([_view(held, rank, p).reshape(-1) * p.weight for p in bucket.pieces])
            sums[bucket.group] = sums.get(bucket.group, 0) + flat
    for rank, buckets in plans.items():
        for bucket in buckets:
            start = 0
            for piece in bucket.pieces:
                view = _view(held, rank, piece)
                view.copy_(sums[bucket.group][start:start + view.numel()].view_as(view))
                start += view.numel()
    return held, want


def _view(held: dict, rank: int, piece) -> torch.Tensor:
    t = held[rank, piece.name]
    return t if piece.dim is None else t.narrow(piece.dim, piece.lo, piece.hi - piece.lo)


def _close(held: dict, want: dict) -> bool:
    return all(torch.allclose(held[k], want[k], rtol=1e-12, atol=1e-12) for k in want)


def _pow2(layout: Layout) -> Layout:
    """The layout with every TP size rounded down to a power of two (ranks renumbered): what the sync supports."""
    replicas, rank = [], 0
    for r in layout.replicas:
        stages = []
        for s in r.stages:
            t = 1 << (s.tp.bit_length() - 1)
            stages.append(Stage(s.layers, tuple(range(rank, rank + t))))
            rank += t
        replicas.append(Replica(tuple(stages), r.micro_batches))
    return Layout(layout.num_layers, tuple(replicas))


def test_tp2_and_tp1_reduce_each_half_with_the_tp1_rank():
    assert sync_groups(TP2_TP1, TABLE) == ((0, 1, 2), (0, 2), (1, 2))
    rank2 = {b.group: b for b in rank_buckets(TP2_TP1, TABLE, 2, [5, 3])}
    # the TP1 rank sends rows 0-5 of the embedding to rank 0 and rows 6-12 to rank 1, weighted 3/8
    assert [(p.name, p.lo, p.hi, p.weight) for p in rank2[(0, 2)].pieces] == [("embed", 0, 6, 3 / 8),
                                                                              ("fc2", 0, 3, 3 / 8)]
    assert [(p.name, p.lo, p.hi) for p in rank2[(1, 2)].pieces] == [("embed", 6, 13), ("fc2", 3, 6)]
    # the norm, whole on every rank: TP2's ranks count half of their replica's weight each
    assert rank_buckets(TP2_TP1, TABLE, 0, [5, 3])[0] == Bucket((0, 1, 2), (Piece("norm", None, 0, 4, 5 / 8 / 2),))
    assert rank2[(0, 1, 2)].pieces == (Piece("norm", None, 0, 4, 3 / 8),)
    held, want = simulate(TP2_TP1, TABLE, [5, 3])
    assert _close(held, want)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layouts(max_layers=4).map(_pow2).flatmap(lambda lay: tables(lay.num_layers).map(lambda t: (lay, t))))
def test_every_rank_ends_with_the_homogeneous_gradient_sending_only_its_slices(case):
    layout, table = case
    samples = [1 + (3 * i) % 5 for i in range(len(layout.replicas))]
    held, want = simulate(layout, table, samples)
    assert _close(held, want)
    for rank in range(layout.world_size):
        sent = sum(math.prod(_piece_shape(layout, table, rank, p)) for b in rank_buckets(layout, table, rank, samples)
                   for p in b.pieces)
        owned = sum(math.prod(b - a for a, b in s.box) for s in layout.rank_slices(rank, table).values())
        assert sent <= owned


def _piece_shape(layout, table, rank, piece) -> tuple[int, ...]:
    spec = next(s for s in table if s.name == piece.name)
    if piece.dim is None:
        return spec.shape
    shape = [b - a for a, b in layout.slice_of(rank, spec).box]
    shape[piece.dim] = piece.hi - piece.lo
    return tuple(shape)


def test_negative_controls_fail_the_same_check():
    held, want = simulate(TP2_TP1, TABLE, [5, 3])
    assert _close(held, want)
    unweighted, _ = simulate(TP2_TP1, TABLE, [1, 1])  # a plain average of unequal shares
    assert not _close(unweighted, want)
    dropped, _ = simulate(TP2_TP1, TABLE, [5, 3], drop=2)  # rank 2 leaves one of its groups out
    assert not _close(dropped, want)


def test_one_replica_needs_no_sync():
    alone = Layout(2, (Replica((Stage((0, 2), (0, 1)),), 4),))
    assert sync_groups(alone, [s for s in TABLE if s.dim is not None]) == ()
    assert rank_buckets(alone, [s for s in TABLE if s.dim is not None], 0, [4]) == ()


def test_bad_input_is_refused_in_one_line():
    with pytest.raises(LayoutError, match=r"samples \[8\]: need one positive sample count per replica \(2"):
        rank_buckets(TP2_TP1, TABLE, 0, [8])
    odd = Layout(1, (Replica((Stage((0, 1), tuple(range(11))),), 1),
                     Replica((Stage((0, 1), tuple(range(11, 18))),), 1)))
    with pytest.raises(LayoutError, match="TP 7 does not own whole splits"):
        sync_groups(odd, TABLE)
