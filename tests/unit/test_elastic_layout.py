"""The layout an elastic job takes at each start (ucp.elastic.layout_choice): most ranks used, then the cost
model's step time, then the smaller T*P; never one the batch or the memory cannot take."""
from __future__ import annotations

import pytest

from ucp.elastic.layout_choice import (
    Choice,
    RankLayout,
    choose_layout,
    cost_model_replicas,
    cost_model_step_time,
    heterogeneous_choice,
    hmp_layers,
)
from ucp.elastic.shares import ElasticSection, allowed_sizes
from ucp.errors import ConfigError
from ucp.hmp.layout import Layout, Replica, Stage
from ucp.hmp.model_shapes import ModelConfig

# tests/support/train_llama_tp.py's tiny Llama, and a 7B one
TINY = ModelConfig("tiny", hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
                   vocab_size=37)
LLAMA7B = ModelConfig("llama7b", hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                      num_kv_heads=32, vocab_size=32000)


def test_sizes_from_the_config():
    assert allowed_sizes({"tensor_parallel": [2, 4, 2]}, "tensor_parallel") == (4, 2)
    assert allowed_sizes({"tensor_parallel": 2}, "tensor_parallel") == (2,)
    assert allowed_sizes({}, "pipeline_parallel") == (1,)
    for bad in (0, [], [2, 0], "2", True, [1.5]):
        with pytest.raises(ConfigError, match='"tensor_parallel"'):
            allowed_sizes({"tensor_parallel": bad}, "tensor_parallel")


def test_most_ranks_used_first():
    assert choose_layout(3, (2, 1), (1,), 8, 2) == Choice(1, 1, 3, 3)      # T=1 x D=3 uses all 3; T=2 x D=1 two
    assert choose_layout(6, (4, 2), (1,), 8, 2) == Choice(2, 1, 3, 6)      # T=4 leaves 2 of 6 out
    assert choose_layout(8, (4, 2), (2, 1), 8, 2).training == 8


def test_without_a_model_shape_the_smaller_tp_times_pp_wins_a_tie():
    assert choose_layout(4, (2, 1), (1,), 8, 2) == Choice(1, 1, 4, 4)
    assert choose_layout(8, (4, 2), (2, 1), 8, 2) == Choice(2, 1, 4, 8)    # 2x1 before 4x1 and 2x2 (then smaller P)


def test_the_cost_model_breaks_ties():
    """The tiny Llama at 6 tokens a sample: its step is all gradient all-reduce, which TP=2 halves (each replica
    holds half the weights) and D=2 shortens, so on 4 ranks T=2 x D=2 beats T=1 x D=4; on 3 ranks T=1 x D=3 still
    wins, as it uses all 3 ranks."""
    tiny = cost_model_step_time(TINY, 8.0, 8, 2, 6, 1)
    assert tiny(2, 1, 2) < tiny(1, 1, 4)
    assert choose_layout(4, (2, 1), (1,), 8, 2, tiny) == Choice(2, 1, 2, 4)
    assert choose_layout(3, (2, 1), (1,), 8, 2, tiny) == Choice(1, 1, 3, 3)
    # Negative control: at 4096 tokens a sample compute dominates, and TP's overhead makes T=1 x D=4 faster.
    long = cost_model_step_time(TINY, 8.0, 8, 2, 4096, 1)
    assert choose_layout(4, (2, 1), (1,), 8, 2, long) == Choice(1, 1, 4, 4)


def test_a_layout_that_does_not_fit_memory_is_never_chosen():
    """7B on 40 GiB ranks: T=1 needs ~100 GiB a rank; T=4 fits, though T=1 x D=8 would use as many ranks."""
    fits = cost_model_step_time(LLAMA7B, 40.0, 64, 1, 2048, 1)
    assert fits(1, 1, 8) == "does not fit the ranks' memory (ucp.hmp cost model)"
    assert isinstance(fits(4, 1, 2), float)
    assert choose_layout(8, (4, 1), (1,), 64, 1, fits) == Choice(4, 1, 2, 8)
    assert choose_layout(7, (4, 1), (1,), 64, 1, fits) == Choice(4, 1, 1, 7)   # 3 spares rather than T=1
    with pytest.raises(ConfigError, match="does not fit the ranks' memory"):
        choose_layout(8, (1,), (1,), 64, 1, fits)
    assert cost_model_step_time(TINY, 8.0, 8, 2, 6, 1)(4, 1, 1) == ("does not divide the model's 4 attention heads "
                                                                     "and 2 KV heads")
    assert cost_model_step_time(TINY, 8.0, 8, 2, 6, 1)(1, 4, 1) == "has more stages than the model's 2 layers"


def test_spares_and_coordinates():
    choice = choose_layout(3, (2,), (1,), 8, 2)
    assert choice == Choice(2, 1, 1, 3) and choice.spares == 1
    assert RankLayout.of(choice, 2).role == "spare" and RankLayout.of(choice, 2).dp_rank is None
    assert [RankLayout.of(choice, r).role for r in range(2)] == ["train", "train"]
    # Megatron's order: TP fastest, then DP, then PP
    big = Choice(2, 2, 2, 8)
    coords = [(p.tp_rank, p.dp_rank, p.pp_rank) for p in (RankLayout.of(big, r) for r in range(8))]
    assert coords == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]


def test_no_possible_layout_is_one_line():
    with pytest.raises(ConfigError, match=r"can train on 1 ranks \(T=2 x P=1 needs 2 ranks\)"):
        choose_layout(1, (2,), (1,), 8, 2)
    with pytest.raises(ConfigError, match="smaller than the 8 ranks"):
        choose_layout(8, (1,), (1,), 4, 2)


def test_expert_parallel_keeps_d_a_multiple_of_the_ep_size():
    """MoE with ep_size 2: 3 ranks train D=2 and leave a spare (DeepSpeed's expert groups need E | D); 4 and 5 ranks
    D=4. Negative control: without "expert_parallel" 3 ranks train D=3, which DeepSpeed's MoE cannot group."""
    assert choose_layout(3, (1,), (1,), 6, 1, expert_parallel=2) == Choice(1, 1, 2, 3)
    assert choose_layout(3, (1,), (1,), 6, 1) == Choice(1, 1, 3, 3)
    assert choose_layout(5, (1,), (1,), 4, 1, expert_parallel=2) == Choice(1, 1, 4, 5)
    assert choose_layout(4, (2, 1), (1,), 8, 1, expert_parallel=2) == Choice(1, 1, 4, 4)
    assert choose_layout(6, (2,), (1,), 8, 1, expert_parallel=2) == Choice(2, 1, 2, 6)   # T=2 x D=2, 2 spares
    with pytest.raises(ConfigError, match=r"T=1 x P=1 with expert_parallel 2 needs 2 ranks"):
        choose_layout(1, (1,), (1,), 4, 1, expert_parallel=2)


def section(**keys) -> ElasticSection:
    return ElasticSection.from_config({"global_batch": 8, "micro_batch": 2, **keys})


def test_expert_parallel_key_is_checked_in_one_line():
    assert section().expert_parallel == 1 and section(expert_parallel=2).expert_parallel == 2
    for bad in (0, True, "2", [2]):
        with pytest.raises(ConfigError, match='"expert_parallel": .*must be the ep_size'):
            section(expert_parallel=bad)


def test_bad_cost_model_keys_are_one_line():
    from ucp.elastic.ranks import _cost_model_inputs as _step_time

    for key, value in (("gpu_memory", 0), ("gpu_memory", "80"), ("seq_len", -1), ("model", 7)):
        with pytest.raises(ConfigError, match=f'"{key}"'):
            section(tensor_parallel=2, **{key: value})
    assert _step_time(section(tensor_parallel=2), 0, object()) is None   # no shape
    hf = type("HF", (), {"config": type("C", (), {"to_dict": lambda self: {"n_embd": 16}})()})()   # not Llama-shaped
    assert _step_time(section(tensor_parallel=2), 0, hf) is None
    # data parallelism only: no cost model, whatever the module (one layout, as before)
    llama = type("HF", (), {"config": type("C", (), {"to_dict": lambda self: {
        "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 37}})()})()
    assert _step_time(section(), 0, llama) is None
    assert _step_time(section(tensor_parallel=[2, 1]), 0, llama) is not None


def test_autotp_size_is_set_for_the_layout():
    pytest.importorskip("deepspeed")
    from ucp.deepspeed.elastic import with_layout_keys

    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "tensor_parallel": {"autotp_size": 4}}
    two = with_layout_keys(config, RankLayout.of(Choice(2, 1, 2, 4), 0), autotp=True)
    assert two["tensor_parallel"] == {"autotp_size": 2} and "train_batch_size" not in two
    assert "tensor_parallel" not in with_layout_keys(config, RankLayout.of(Choice(1, 1, 3, 3), 0), autotp=True)
    assert with_layout_keys(config, RankLayout.of(Choice(2, 1, 2, 4), 0), autotp=False) == config   # mpu, pipeline


def test_heterogeneous_uses_the_ranks_a_homogeneous_layout_leaves_spare():
    """3 ranks and TP 2: TP 2 + 1 (5 and 3 samples of 8, by the cost model's TP efficiency), no spare. Negative
    control: the same ranks without "heterogeneous" leave one spare."""
    assert choose_layout(3, (2,), (1,), 8, 8).spares == 1
    choice = heterogeneous_choice(3, (2,), (1,), 8, 8)
    assert choice == Choice(2, 1, 2, 3, (2, 1), (5, 3), True)
    assert choice.spares == 0 and choice.heterogeneous
    assert choice.describe() == "heterogeneous tensor_parallel 2 + 1 (one replica each, batch shares 5 + 3)"
    places = [RankLayout.of(choice, r) for r in range(3)]
    assert [(p.tp, p.tp_rank, p.dp_rank, p.role) for p in places] == [(2, 0, 0, "train"), (2, 1, 0, "train"),
                                                                       (1, 0, 1, "train")]
    assert places[2].choice == choice
    layout = places[0].hmp_layout(2)
    assert [r.stages[0].ranks for r in layout.replicas] == [(0, 1), (2,)]
    assert [r.micro_batches for r in layout.replicas] == [5, 3] and layout.num_layers == 2
    # 7 ranks and TP 4: 4 + 2 + 1 (the remainder's powers of two, as `ucp plan` deals TP_max 4)
    assert heterogeneous_choice(7, (4,), (1,), 16, 16).replicas == (4, 2, 1)
    # fewer ranks than the smallest TP size: one TP-1 replica, not a refusal
    assert heterogeneous_choice(1, (2,), (1,), 8, 8).replicas == (1,)


def test_heterogeneous_keeps_a_homogeneous_layout_that_uses_every_rank():
    """4 ranks and TP 2: TP 2 x 2, given as two equal replicas (4 and 4 samples) for the HMP path."""
    choice = heterogeneous_choice(4, (2,), (1,), 8, 8)
    assert choice == Choice(2, 1, 2, 4, (2, 2), (4, 4), True) and not choice.heterogeneous
    assert choice.describe() == "tensor_parallel 2 x pipeline_parallel 1 x data_parallel 2"
    assert [(p.tp_rank, p.dp_rank) for p in (RankLayout.of(choice, r) for r in range(4))] == [(0, 0), (1, 0), (0, 1),
                                                                                              (1, 1)]
    # a pipeline layout is given as equal pipelines, ranks in Megatron's order (TP fastest, then DP, then PP)
    piped = heterogeneous_choice(8, (2,), (2,), 8, 8)
    assert piped == Choice(2, 2, 2, 8, (), (4, 4), True)
    layout = piped.hmp_layout(4)
    assert [[s.ranks for s in r.stages] for r in layout.replicas] == [[(0, 1), (4, 5)], [(2, 3), (6, 7)]]
    assert [[s.layers for s in r.stages] for r in layout.replicas] == [[(0, 2), (2, 4)]] * 2
    assert [r.micro_batches for r in layout.replicas] == [4, 4]
    for rank in range(8):   # each rank's place is the layout's
        place, where = RankLayout.of(piped, rank), layout.placement(rank)
        assert (place.tp_rank, place.pp_rank, place.dp_rank) == (where.tp_rank, where.stage, where.replica)
        assert place.hmp and place.choice == piped and place.hmp_layout(4) == layout
    # negative control: without "heterogeneous" the choice is not an HMP layout
    with pytest.raises(ConfigError, match="only a layout chosen with"):
        Choice(2, 2, 1, 4).hmp_layout(2)


def test_heterogeneous_replicas_that_cannot_share_the_batch_keep_the_spare():
    """5 ranks and TP 2: TP 2 + 2 + 1 needs a sample per replica; a global batch of 3 has them, one of 2 does not,
    and the homogeneous choice (TP 2 x 2 and a spare) stands."""
    assert heterogeneous_choice(5, (2,), (1,), 3, 1).replicas == (2, 2, 1)
    kept = heterogeneous_choice(5, (2,), (1,), 2, 1)
    assert kept.replicas == (2, 2) and kept.spares == 1 and kept.hmp
    assert heterogeneous_choice(3, (2,), (1,), 1, 1) == Choice(2, 1, 1, 3, (2,), (1,), True)   # one sample: TP 2


def test_heterogeneous_flag_and_layers():
    from ucp.hmp.layout import ParamSpec

    assert section().heterogeneous is False and section(heterogeneous=True).heterogeneous is True
    with pytest.raises(ConfigError, match='"heterogeneous": 1}}: must be true or false'):
        section(heterogeneous=1)
    table = [ParamSpec("embed", (4, 2), 0, -1), ParamSpec("fc", (2, 2), 0, 0), ParamSpec("head", (4, 2), 0, 2)]
    assert hmp_layers(table) == 2 and hmp_layers(table[:1]) == 1


def _stages(layout):
    return [[(s.tp, s.layers) for s in r.stages] for r in layout.replicas]


def test_with_the_models_shape_the_replicas_are_ucp_plans():
    """With the model's shape, the replicas are those of `ucp plan`'s fastest allowed plan: for the tiny Llama on 3
    ranks with one stage allowed, TP 2 + 1; on 7 ranks with TP 4 allowed, 2 + 2 + 2 + 1, not the rule's 4 + 2 + 1 (4
    does not divide its 2 KV heads)."""
    plan = cost_model_replicas(TINY, 8.0, 8, 8, 6, 1, (2,))
    assert _stages(plan(3)) == [[(2, (0, 2))], [(1, (0, 2))]]
    assert heterogeneous_choice(3, (2,), (1,), 8, 8, None, plan).replicas == (2, 1)
    wide = cost_model_replicas(TINY, 8.0, 16, 16, 6, 1, (4, 2))
    assert [r.stages[0].tp for r in wide(7).replicas] == [2, 2, 2, 1]
    assert heterogeneous_choice(7, (4, 2), (1,), 16, 16, None, wide) == Choice(2, 1, 4, 7, (2, 2, 2, 1), (5, 4, 4, 3),
                                                                               True)
    assert heterogeneous_choice(7, (4, 2), (1,), 16, 16).replicas == (4, 2, 1)   # control: without the shape
    # no plan of an allowed size (TP 4 only, which the model cannot take): the rule decides
    assert cost_model_replicas(TINY, 8.0, 8, 8, 6, 1, (4,))(5) is None


def test_with_pipelines_allowed_the_replicas_are_ucp_plans_fastest_plan_with_its_stages():
    """With two stages allowed, 3 ranks take the tiny Llama's fastest plan overall, as `ucp plan` prints it first:
    one replica of two stages of unequal TP size. Every rank's place is the plan's, the layout is the plan's with
    the batch shares, and a table of other layers is refused in one line."""
    from ucp.hmp.strategy import CostModel, Workload, search

    piped = cost_model_replicas(TINY, 8.0, 8, 8, 6, 1, (2,), (2, 1))
    first = search(TINY, 3, CostModel(gpu_memory_gib=8.0, reserve_gib=1.0, zero_stage=1, tp_max=2),
                   Workload(global_batch=8, seq_len=6, micro_batch_size=2), top=1).plans[0].layout()
    assert any(len(r.stages) > 1 for r in first.replicas)   # the premise: a plan with a pipeline is the fastest
    assert _stages(piped(3)) == _stages(first)
    choice = heterogeneous_choice(3, (2,), (2, 1), 8, 8, None, piped)
    assert choice.plan is not None and choice.spares == 0 and choice.heterogeneous
    assert choice.replicas == tuple(len(r.ranks) for r in first.replicas) and sum(choice.shares) == 8
    assert choice.describe().startswith("heterogeneous replicas ") and "|" in choice.describe()
    layout = choice.hmp_layout(TINY.num_layers)
    assert _stages(layout) == _stages(first) and [r.micro_batches for r in layout.replicas] == list(choice.shares)
    for rank in range(3):
        place, where = RankLayout.of(choice, rank), layout.placement(rank)
        assert (place.tp, place.tp_rank, place.pp_rank, place.dp_rank) == (where.tp_size, where.tp_rank, where.stage,
                                                                           where.replica)
        assert place.choice == choice and place.hmp_layout(TINY.num_layers) == layout
    with pytest.raises(ConfigError, match="layers of the model's config"):
        choice.hmp_layout(TINY.num_layers + 1)
    # 5 ranks: equal pipelines of TP 2 x 2 would leave a spare, so the plan for 5 is taken
    five = Layout(2, (Replica((Stage((0, 1), (0,)), Stage((1, 2), (1, 2))), 1), Replica((Stage((0, 2), (3, 4)),), 1)))
    assert heterogeneous_choice(5, (2,), (2, 1), 8, 8, None, lambda world: five).plan == five
    assert heterogeneous_choice(5, (2,), (2, 1), 8, 8).spares == 0   # control: without a plan, one-stage 2 + 2 + 1
    assert heterogeneous_choice(4, (2,), (2,), 8, 8, None, lambda world: five).plan is None   # no spare: kept
    # control: one stage allowed, the fastest one-stage plan (no pipeline)
    one_stage = cost_model_replicas(TINY, 8.0, 8, 8, 6, 1, (2,))
    assert heterogeneous_choice(3, (2,), (1,), 8, 8, None, one_stage).plan is None
