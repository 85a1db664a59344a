"""Layout maths (ucp.hmp.layout): property tests over random models and plans, HMP and uneven PP included.

For every parameter and every DP replica, the boxes the replica's ranks own tile the tensor
exactly once; replicated tensors are held whole by exactly the TP group of the stage that runs
their layer; slices expressed in splits match their boxes; ZeRO shards tile each box among peers.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucp.hmp.layout import (
    Layout,
    LayoutError,
    ParamSpec,
    Replica,
    Stage,
    choose_global_split,
    part_bounds,
    split_bounds,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layouts(draw, max_layers: int = 8) -> Layout:
    """Random HMP layouts: replicas with their own stage count, uneven stage boundaries, TP sizes per stage."""
    num_layers = draw(st.integers(1, max_layers))
    sizes = []
    for _ in range(draw(st.integers(1, 4))):
        p = draw(st.integers(1, min(num_layers, 3)))
        cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=p - 1, max_size=p - 1))) if p > 1 else []
        bounds = [0, *cuts, num_layers]
        tps = [draw(st.integers(1, 5)) for _ in range(p)]
        sizes.append((list(zip(bounds, bounds[1:])), tps, draw(st.integers(1, 4))))
    world = sum(sum(tps) for _, tps, _ in sizes)
    order = draw(st.permutations(list(range(world))))  # ranks in any order, not just contiguous
    replicas, next_rank = [], 0
    for spans, tps, micro in sizes:
        stages = []
        for span, t in zip(spans, tps):
            stages.append(Stage(span, tuple(order[next_rank:next_rank + t])))
            next_rank += t
        replicas.append(Replica(tuple(stages), micro))
    return Layout(num_layers, tuple(replicas), draw(st.sampled_from([0, 1, 2, 3])))


@st.composite
def tables(draw, num_layers: int) -> list[ParamSpec]:
    table = []
    for i in range(draw(st.integers(1, 6))):
        shape = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=3)))
        dim = draw(st.one_of(st.none(), st.integers(0, len(shape) - 1)))
        layer = draw(st.integers(-1, num_layers))
        table.append(ParamSpec(f"p{i}", shape, dim, layer))
    return table


@st.composite
def cases(draw):
    layout = draw(layouts())
    return layout, draw(tables(layout.num_layers))


def _holders(layout: Layout, replica: Replica, spec: ParamSpec):
    return [(rank, layout.slice_of(rank, spec)) for rank in replica.ranks
            if layout.slice_of(rank, spec) is not None]


@SETTINGS
@given(cases())
def test_owned_slices_tile_every_parameter_once_per_replica(case):
    layout, table = case
    for replica in layout.replicas:
        for spec in table:
            holders = _holders(layout, replica, spec)
            assert holders, f"{spec.name}: nobody in the replica holds it"
            if spec.dim is None:
                # Replicated: held whole by exactly the TP group of one stage, the one running its layer.
                stages = {layout.placement(r).stage for r, _ in holders}
                assert len(stages) == 1
                assert sorted(r for r, _ in holders) == sorted(replica.stages[stages.pop()].ranks)
                assert all(s.replicated and s.box == tuple((0, n) for n in spec.shape) for _, s in holders)
                continue
            count = np.zeros(spec.shape, dtype=np.int64)
            for _, s in holders:
                count[tuple(slice(a, b) for a, b in s.box)] += 1
            assert (count == 1).all(), f"{spec.name}: coverage {count.min()}..{count.max()}"


@SETTINGS
@given(cases())
def test_slices_in_splits_match_their_boxes(case):
    layout, table = case
    k = layout.split_count()
    assert k == math.lcm(*layout.tp_sizes)   # TP sizes up to 5: their lcm stays within the bound
    for rank in range(layout.world_size):
        for name, s in layout.rank_slices(rank, table, k).items():
            spec = next(p for p in table if p.name == name)
            if spec.dim is None:
                assert s.splits is None
                continue
            bounds = split_bounds(spec.shape[spec.dim], k)
            assert (bounds[s.splits[0]], bounds[s.splits[1]]) == s.box[spec.dim]
            assert s.splits[1] - s.splits[0] == k // layout.placement(rank).tp_size


@SETTINGS
@given(cases())
def test_zero_shards_tile_each_box_among_its_peers(case):
    layout, table = case
    for spec in table:
        kept: dict[tuple, np.ndarray] = {}
        for rank in range(layout.world_size):
            s = layout.slice_of(rank, spec)
            shard = layout.zero_shard(rank, spec)
            assert (s is None) == (shard is None)
            if s is None:
                continue
            w = layout.placement(rank)
            numel = math.prod(b - a for a, b in s.box)
            key = (w.tp_size, w.tp_rank)
            kept.setdefault(key, np.zeros(numel, dtype=np.int64))[shard[0]:shard[1]] += 1
        for key, count in kept.items():
            peers = sum(1 for r in layout.replicas
                        if r.stages[layout.stage_of(layout.replicas.index(r), spec.layer)].tp == key[0])
            assert (count == (1 if layout.zero_stage else peers)).all(), (spec, key)


@SETTINGS
@given(layouts())
def test_json_round_trip(layout):
    assert Layout.from_json(layout.to_json()) == layout
    assert Layout.from_json(json.dumps(layout.to_json())) == layout


def test_homogeneous_uses_megatron_rank_order():
    layout = Layout.homogeneous(dp=2, tp=2, pp=2, num_layers=5, zero_stage=1, micro_batches=3)
    assert [[s.ranks for s in r.stages] for r in layout.replicas] == [[(0, 1), (4, 5)], [(2, 3), (6, 7)]]
    assert [s.layers for s in layout.replicas[0].stages] == [(0, 2), (2, 5)]
    assert layout.world_size == 8 and layout.tp_sizes == (2,)
    w = ParamSpec("w", (4, 6), 1, 4)
    assert layout.slice_of(5, w).box == ((0, 4), (3, 6))
    assert layout.slice_of(1, w) is None                        # stage 0 does not run layer 4
    assert layout.zero_shard(5, w) == (0, 6) and layout.zero_shard(7, w) == (6, 12)   # DP peers 5 and 7


def test_hmp_slices_by_hand():
    # replica 0: TP2 for layers 0-2, TP1 for layer 3; replica 1: TP3 for everything
    layout = Layout(4, (Replica((Stage((0, 3), (0, 1)), Stage((3, 4), (2,))), 2),
                        Replica((Stage((0, 4), (3, 4, 5)),), 1)))
    emb = ParamSpec("embed", (10, 4), 0, -1)
    head = ParamSpec("head", (10, 4), 0, 4)
    row = ParamSpec("layers.1.fc2", (4, 6), 1, 1)
    assert [layout.slice_of(r, emb).box for r in (0, 1, 3, 4, 5)] == [
        ((0, 5), (0, 4)), ((5, 10), (0, 4)), ((0, 3), (0, 4)), ((3, 6), (0, 4)), ((6, 10), (0, 4))]
    assert layout.slice_of(2, emb) is None and layout.slice_of(2, head).box == ((0, 10), (0, 4))
    assert layout.slice_of(1, row, global_split=6).splits == (3, 6)
    assert layout.slice_of(4, row, global_split=6).splits == (2, 4)
    assert layout.slice_of(4, row, global_split=4).splits is None   # 3 does not divide 4: not whole splits
    assert layout.split_count() == 6


def test_choose_global_split():
    assert choose_global_split([1, 2, 4, 8]) == 8
    assert choose_global_split([2, 3]) == 6
    assert choose_global_split([8, 7, 5], bound=64) == 56    # 8 then 7; 5 would take it to 280
    assert choose_global_split([]) == 1
    with pytest.raises(LayoutError):
        choose_global_split([0])


def test_part_and_split_bounds_agree_when_tp_divides_the_split():
    for size in range(0, 30):
        for k in (1, 2, 4, 6, 12):
            bounds = split_bounds(size, k)
            for t in (t for t in range(1, k + 1) if k % t == 0):
                for r in range(t):
                    assert part_bounds(size, t, r) == (bounds[r * k // t], bounds[(r + 1) * k // t])


@pytest.mark.parametrize("data, message", [
    ({"num_layers": 2, "replicas": [{"micro_batches": 1, "stages": [{"layers": [0, 1], "ranks": [0]}]}]},
     "stages end at layer 1"),
    ({"num_layers": 2, "replicas": [{"micro_batches": 1, "stages": [{"layers": [0, 1], "ranks": [0]},
                                                                    {"layers": [2, 2], "ranks": [1]}]}]},
     "must start at layer 1"),
    ({"num_layers": 1, "replicas": [{"micro_batches": 1, "stages": [{"layers": [0, 1], "ranks": [0, 0]}]}]},
     "rank 0 appears twice"),
    ({"num_layers": 1, "replicas": [{"micro_batches": 1, "stages": [{"layers": [0, 1], "ranks": [1]}]}]},
     "ranks must be 0..0"),
    ({"num_layers": 1, "replicas": [{"micro_batches": 0, "stages": [{"layers": [0, 1], "ranks": [0]}]}]},
     "0 micro-batches"),
    ({"num_layers": 1, "zero_stage": 4, "replicas": [{"micro_batches": 1, "stages": [{"layers": [0, 1],
                                                                                      "ranks": [0]}]}]},
     '"zero_stage": 4 must be an integer from 0 to 3'),
    ({"num_layers": 1, "replicas": [{"stages": []}]}, "replica 0: has no 'micro_batches'"),
    ("[1, 2", "the layout: not JSON"),
])
def test_bad_layouts_are_named_errors(data, message):
    with pytest.raises(LayoutError, match=message):
        Layout.from_json(data)


def test_bad_spec_and_rank():
    layout = Layout.homogeneous(1, 2, 1, 1)
    with pytest.raises(LayoutError, match="partition dim 2 is outside its shape"):
        layout.slice_of(0, ParamSpec("w", (3, 4), 2, 0))
    with pytest.raises(LayoutError, match="rank 5 is not in this layout"):
        layout.placement(5)
    with pytest.raises(LayoutError, match="every stage needs at least one layer"):
        Layout.homogeneous(1, 1, 3, 2)
