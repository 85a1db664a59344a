"""Which ranks write a save from a heterogeneous layout (ucp.deepspeed.saving.hmp): every element of every tensor
once across the job, by the replica with the most ranks. The save itself is run by
tests/integration/test_hmp_train.py."""
from __future__ import annotations

import itertools
import math

import pytest

from ucp.deepspeed.saving.hmp import writing_holdings, writing_replica
from ucp.deepspeed.saving.plan import Holding, pattern_of, writers
from ucp.hmp.layout import Layout, ParamSpec, Replica, Stage
from ucp.patterns import Pattern

TABLE = [ParamSpec("embed", (8, 6), 0, -1), ParamSpec("fc1", (12, 6), 0, 0), ParamSpec("fc2", (6, 12), 1, 0),
         ParamSpec("norm", (6,), None, 1), ParamSpec("head", (8, 6), 0, 2)]
TP2_TP1 = Layout(2, (Replica((Stage((0, 2), (0, 1)),), 5), Replica((Stage((0, 2), (2,)),), 3)))
TP1_TP2 = Layout(2, (Replica((Stage((0, 2), (0,)),), 3), Replica((Stage((0, 2), (1, 2)),), 5)))
# a pipeline of two TP=2 stages beside one TP=1 replica
PIPE = Layout(2, (Replica((Stage((0, 1), (0, 1)), Stage((1, 2), (2, 3))), 5), Replica((Stage((0, 2), (4,)),), 3)))


def every_holding(layout: Layout) -> list[Holding]:
    """What each rank of `layout` holds, as the saver's engines report it: its box of each tensor, whole (ZeRO-1 over
    a data-parallel group of one keeps all of it)."""
    out = []
    for rank in range(layout.world_size):
        for name, piece in layout.rank_slices(rank, TABLE).items():
            numel = math.prod(hi - lo for lo, hi in piece.box)
            shape = next(s.shape for s in TABLE if s.name == name)
            out.append(Holding(name, rank, piece.box, 0, numel, False, 0, 0, "param", shape,
                               (("fp32", "float32"), ("exp_avg", "float32")), 0))
    return out


def written_elements(holdings: list[Holding]) -> dict[str, int]:
    """How many elements of each tensor the chosen writers write, and a check that no element is written twice."""
    chosen = writers(holdings, {s.name: 8 for s in TABLE})
    seen: dict[str, set[tuple[int, ...]]] = {}
    counts: dict[str, int] = {}
    for h in holdings:
        if (h.name, h.rank) not in chosen:
            continue
        cells = set(itertools.product(*(range(lo, hi) for lo, hi in h.box)))
        counts[h.name] = counts.get(h.name, 0) + len(cells)
        seen.setdefault(h.name, set()).update(cells)
    assert all(len(seen[s.name]) == math.prod(s.shape) for s in TABLE), "an element nobody writes"
    return counts


@pytest.mark.parametrize("layout, replica", [(TP2_TP1, 0), (TP1_TP2, 1), (PIPE, 0)])
def test_every_element_is_written_once_by_the_largest_replica(layout, replica):
    assert writing_replica(layout) == replica
    chosen = writing_holdings(every_holding(layout), layout)
    assert {h.rank for h in chosen} == set(layout.replicas[replica].ranks)
    assert written_elements(chosen) == {s.name: math.prod(s.shape) for s in TABLE}
    # A norm both TP ranks hold whole is written by one of them; the split tensors by each rank its own box.
    norm = [r for n, r in writers(chosen, {s.name: 8 for s in TABLE}) if n == "norm"]
    assert len(norm) == 1 and norm[0] in layout.replicas[replica].ranks
    # Negative control: every replica's holdings as they are write the tensors more than once.
    every = written_elements(every_holding(layout))
    assert all(every[s.name] > math.prod(s.shape) for s in TABLE)


def test_patterns_are_the_writing_replicas():
    chosen = writing_holdings(every_holding(TP2_TP1), TP2_TP1)
    patterns = {s.name: pattern_of(s.name, s.shape, [h for h in chosen if h.name == s.name], None).pattern
                for s in TABLE}
    assert patterns == {"embed": Pattern.SHARD_V, "fc1": Pattern.SHARD_V, "fc2": Pattern.SHARD_H,
                        "norm": Pattern.REPLICATE, "head": Pattern.SHARD_V}
    # Where the TP=1 replica comes first, the TP=2 one still writes: its patterns.
    second = writing_holdings(every_holding(TP1_TP2), TP1_TP2)
    assert pattern_of("fc2", (6, 12), [h for h in second if h.name == "fc2"], None).pattern is Pattern.SHARD_H


def test_an_hmp_ranks_mpu_is_not_taken_for_a_megatron_one():
    """An HMP engine's mpu (`RankAloneMpu`) answers DeepSpeed's TP questions with one replica's TP group, so it has
    Megatron's `get_tensor_model_parallel_world_size`; the saver must still place its tensors by the layout, not as
    Megatron TP shards (that took the writing replica's patterns for `replicate`: issue #30, stop 36)."""
    from support.train_megatron import ParallelState
    from ucp.deepspeed.engine.hmp_sync import RankAloneMpu
    from ucp.deepspeed.saving.layout import is_megatron_mpu

    hmp = RankAloneMpu(tp_group=None, tp_ranks=(0, 1), dp_group=None)
    assert not is_megatron_mpu(hmp)
    megatron = object.__new__(ParallelState)  # the Megatron-style mpu of the tests' Megatron runs (no groups needed)
    assert is_megatron_mpu(megatron)
    assert not is_megatron_mpu(None)
    # Negative control: the method alone, what the saver asked before, takes the HMP mpu for a Megatron one.
    assert hasattr(hmp, "get_tensor_model_parallel_world_size")
