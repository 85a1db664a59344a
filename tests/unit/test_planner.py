"""Strategy search (ucp.hmp.strategy): hand-checked small cases, exhaustive search on tiny clusters, and
invariants of every plan returned for counts that divide nothing.
"""
from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from ucp.hmp.layout import Layout, Replica, Stage
from ucp.hmp.model_shapes import ModelConfig, ModelConfigError, load_model_config
from ucp.hmp.strategy import (
    CostModel,
    PlanError,
    StagePlan,
    Workload,
    _powers_of_two,
    deal,
    estimate,
    replica_speeds,
    search,
    tp_sizes,
)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "models"
TINY = ModelConfig("tiny", hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4, num_kv_heads=4,
                   vocab_size=8)
PEAK = 312e12 * 0.5


def _flops(model: ModelConfig, seq: int) -> tuple[float, float]:
    """(one layer, the LM head): forward + backward FLOPs of one micro-batch of one sequence, by hand."""
    h, i = model.hidden_size, model.intermediate_size
    matmul = 2 * h * h + 2 * model.kv_dim * h + 3 * h * i
    return 3 * seq * (2 * matmul + 4 * seq * h), 3 * seq * 2 * h * model.vocab_size


def _tiny_memory(seq: int) -> float:
    """Bytes one GPU needs for the whole tiny model at TP1 without ZeRO (what no smaller plan reaches)."""
    h, i, kv = TINY.hidden_size, TINY.intermediate_size, TINY.kv_dim
    act = 2 * (6 * h + 2 * kv + 3 * i) * seq
    return TINY.num_params * 18 + TINY.num_layers * act + 4 * seq * TINY.vocab_size


def test_ample_memory_picks_pure_data_parallelism():
    seq = 16
    cost = CostModel(gpu_memory_gib=1e6, dp_bandwidth_gbs=1e12, reserve_gib=0)
    best = search(TINY, 4, cost, Workload(global_batch=8, seq_len=seq)).plans[0]
    assert best.dp == 4 and [(r.stages, r.micro_batches, r.count) for r in best.replicas] == [
        ((StagePlan(1, 4),), 2, 4)]
    layer, head = _flops(TINY, seq)
    sync = 2 * 3 / 4 * TINY.num_params * 4 / 1e21
    assert best.step_time_s == pytest.approx(2 * (4 * layer + head) / PEAK + sync, rel=1e-12)


@pytest.mark.parametrize("batch, expected", [
    # Two micro-batches: a 2-stage pipeline idles half the time (3 slots for 2), TP2 costs only 5 %.
    (2, [((StagePlan(2, 4),), 2, 1)]),
    # Sixty-four: the bubble is 1 slot in 65, less than TP's 5 %.
    (64, [((StagePlan(1, 2), StagePlan(1, 2)), 64, 1)]),
])
def test_memory_for_two_gpus_picks_tp_or_pp_by_batch(batch, expected):
    seq = 16
    gib = 0.75 * _tiny_memory(seq) / (1 << 30)    # one GPU cannot hold the model, half of it fits
    cost = CostModel(gpu_memory_gib=gib, zero_stage=0, reserve_gib=0)
    work = Workload(global_batch=batch, seq_len=seq)
    best = search(TINY, 2, cost, work).plans[0]
    assert [(r.stages, r.micro_batches, r.count) for r in best.replicas] == expected
    layer, head = _flops(TINY, seq)
    if expected[0][0][0].tp == 2:
        by_hand = batch * (4 * layer + head) * 1.05 / (2 * PEAK)
    else:
        by_hand = (batch + 1) * (2 * layer + head) / PEAK
    assert best.step_time_s == pytest.approx(by_hand, rel=1e-12)
    with pytest.raises(PlanError, match="no plan fits tiny"):
        search(TINY, 1, cost, work)


def _all_layouts(gpus: int, layers: int, batch: int, sizes: list[int]):
    """Every layout of exactly `gpus` GPUs: replicas of stage TP sizes from `sizes`, all layer splits, all
    micro-batch splits (ranks numbered in order)."""
    def pipelines(n):
        if n == 0:
            yield ()
            return
        for t in sizes:
            if t <= n:
                for rest in pipelines(n - t):
                    yield (t,) + rest

    def partitions(n, smallest=1):
        if n == 0:
            yield ()
            return
        for first in range(smallest, n + 1):
            for rest in partitions(n - first, first):
                yield (first,) + rest

    for part in partitions(gpus):
        for pipes in itertools.product(*[[p for p in pipelines(n) if len(p) <= layers] for n in part]):
            for splits in itertools.product(*[list(itertools.combinations(range(1, layers), len(p) - 1))
                                              for p in pipes]):
                for micro in itertools.combinations(range(1, batch), len(pipes) - 1):
                    mb = [b - a for a, b in zip((0, *micro), (*micro, batch))]
                    replicas, rank = [], 0
                    for pipe, cuts, m in zip(pipes, splits, mb):
                        bounds = (0, *cuts, layers)
                        stages = []
                        for t, a, b in zip(pipe, bounds, bounds[1:]):
                            stages.append(Stage((a, b), tuple(range(rank, rank + t))))
                            rank += t
                        replicas.append(Replica(tuple(stages), m))
                    yield Layout(layers, tuple(replicas), 1)


@pytest.mark.parametrize("gpus", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("memory", [0.35, 0.6, 1.5])
@pytest.mark.parametrize("bandwidth", [0.05, 50])
def test_search_matches_exhaustive_enumeration(gpus, memory, bandwidth):
    """Against every layout of the GPUs (any replica sizes, stage orders, layer and micro-batch splits),
    scored by `estimate`: the search finds the best one. `memory` is per GPU, as a fraction of what the
    whole model needs at TP1 without ZeRO; the bandwidth of the gradient all-reduce sets the price of DP."""
    model = ModelConfig("t3", hidden_size=64, intermediate_size=256, num_layers=3, num_heads=4, num_kv_heads=4,
                        vocab_size=512)
    seq = 64
    work = Workload(global_batch=6, seq_len=seq)
    h, i, kv = model.hidden_size, model.intermediate_size, model.kv_dim
    full = model.num_params * 18 + model.num_layers * 2 * (6 * h + 2 * kv + 3 * i) * seq
    cost = CostModel(gpu_memory_gib=memory * full / (1 << 30), tp_max=4, reserve_gib=0, dp_bandwidth_gbs=bandwidth)
    best = math.inf
    for layout in _all_layouts(gpus, model.num_layers, work.global_batch, tp_sizes(model, 4)):
        e = estimate(layout, model, cost, work)
        if e.fits:
            best = min(best, e.step_time_s)
    if best == math.inf:
        with pytest.raises(PlanError, match="no plan fits"):
            search(model, gpus, cost, work)
        return
    found = search(model, gpus, cost, work).plans[0]
    assert found.step_time_s == pytest.approx(best, rel=1e-9)


@pytest.mark.parametrize("config, gpus, memory", [
    ("llama2-7b", 28, 80), ("llama2-7b", 31, 80), ("llama2-13b", 31, 40), ("qwen2.5-32b", 28, 80),
    ("llama2-7b", 1021, 80), ("qwen2.5-32b", 1021, 80), ("llama2-13b", 7, 80), ("llama2-7b", 1, 141),
])
def test_every_plan_uses_all_gpus_and_fits(config, gpus, memory):
    model = load_model_config(EXAMPLES / f"{config}.json")
    cost = CostModel(gpu_memory_gib=memory)
    work = Workload()
    result = search(model, gpus, cost, work, top=5)
    assert result.plans
    steps = [p.step_time_s for p in result.plans]
    assert steps == sorted(steps)
    for plan in result.plans:
        layout = plan.layout()
        assert plan.gpus == gpus == layout.world_size
        assert sum(r.count * r.micro_batches for r in plan.replicas) == work.global_batch
        assert all(r.micro_batches >= 1 and sum(s.layers for s in r.stages) == model.num_layers
                   for r in plan.replicas)
        again = estimate(layout, model, cost, work)   # scored independently, from the layout alone
        assert again.fits and max(again.memory_gib.values()) <= memory
        assert again.step_time_s == pytest.approx(plan.step_time_s, rel=1e-9)
        assert max(again.memory_gib.values()) == pytest.approx(plan.memory_gib, rel=1e-9)


def test_estimate_flags_a_layout_that_does_not_fit():
    model = load_model_config(EXAMPLES / "llama2-7b.json")
    e = estimate(Layout.homogeneous(1, 1, 1, 32, micro_batches=256), model, CostModel(gpu_memory_gib=80))
    assert not e.fits and e.memory_gib[0] > 100


def test_dealing_groups_to_replicas():
    assert _powers_of_two(7) == [4, 2, 1] and _powers_of_two(0) == []
    # 28 GPUs, TP_max 8: 8+8+8+4; four replicas get one group each, two get 16 and 12 GPUs.
    assert deal(8, 3, [4], 4) == {(8,): 3, (4,): 1}
    assert deal(8, 3, [4], 2) == {(8, 8): 1, (8, 4): 1}
    # 31 GPUs: 8+8+8 and 4+2+1 onto the replicas holding fewest
    assert deal(8, 3, [4, 2, 1], 3) == {(8, 4): 1, (8, 2): 1, (8, 1): 1}
    assert deal(8, 3, [4, 2, 1], 5) == {(8,): 3, (4,): 1, (2, 1): 1}
    assert deal(8, 3, [4, 2, 1], 7) == {(8,): 3, (4,): 1, (2,): 1, (1,): 1, (): 1}   # one replica left empty


def test_tp_sizes_divide_the_heads():
    qwen = load_model_config(EXAMPLES / "qwen2.5-32b.json")    # 40 heads, 8 KV heads
    assert tp_sizes(qwen, 8) == [1, 2, 4, 8] and tp_sizes(qwen, 64) == [1, 2, 4, 8]
    assert tp_sizes(TINY, 8) == [1, 2, 4]


def test_example_configs_have_the_published_sizes():
    sizes = {n: load_model_config(EXAMPLES / f"{n}.json").num_params for n in ("llama2-7b", "llama2-13b",
                                                                              "qwen2.5-32b")}
    assert sizes == {"llama2-7b": 6_738_415_616, "llama2-13b": 13_015_864_320, "qwen2.5-32b": 32_763_876_352}
    table = load_model_config(EXAMPLES / "qwen2.5-32b.json").param_table()
    assert sum(s.numel for s in table) == sizes["qwen2.5-32b"]


def test_bad_inputs_are_named_errors(tmp_path):
    with pytest.raises(ModelConfigError, match="config has no 'hidden_size'"):
        ModelConfig.from_hf({"num_hidden_layers": 2})
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    with pytest.raises(ModelConfigError, match="expected a JSON object"):
        load_model_config(bad)
    with pytest.raises(ModelConfigError, match="no such file"):
        load_model_config(tmp_path / "missing.json")
    with pytest.raises(PlanError, match="need at least one GPU"):
        search(TINY, 0, CostModel(gpu_memory_gib=80))
    with pytest.raises(PlanError, match="not a multiple of the micro-batch size"):
        search(TINY, 2, CostModel(gpu_memory_gib=80), Workload(global_batch=5, micro_batch_size=2))


def test_replica_speeds_follow_tp_efficiency_and_the_slowest_stage():
    layout = Layout(4, (Replica((Stage((0, 4), (0, 1)),), 1), Replica((Stage((0, 4), (2,)),), 1),
                        Replica((Stage((0, 3), (3, 4)), Stage((3, 4), (5,))), 1)))
    speeds = replica_speeds(layout, CostModel(80.0, tp_overhead=0.05))
    assert speeds == pytest.approx((2 / 1.05 / 4, 1 / 4, 2 / 1.05 / 3))
    assert replica_speeds(layout, CostModel(80.0, tp_overhead=0.0))[:2] == (0.5, 0.25)
