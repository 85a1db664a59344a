"""Elastic batches: the same B samples per step at any world size, and the same gradient (ucp.elastic)."""
from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucp.elastic import ElasticBatch, ElasticBatchSampler, speed_shares
from ucp.errors import ConfigError


def test_ten_samples_on_four_ranks_are_shared_three_three_two_two():
    batch = ElasticBatch(global_batch=10, micro_batch=2, world=4)
    assert [batch.share(r) for r in range(4)] == [3, 3, 2, 2]
    assert [batch.offset(r) for r in range(4)] == [0, 3, 6, 8]
    assert batch.accumulation == 2
    assert [batch.micro_sizes(r) for r in range(4)] == [[2, 1], [2, 1], [1, 1], [1, 1]]
    assert batch.deepspeed_keys() == {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2,
                                      "gradient_accumulation_steps": 2}


def test_equal_shares_weigh_every_micro_batch_one():
    batch = ElasticBatch(global_batch=12, micro_batch=3, world=4)
    assert batch.accumulation == 1 and batch.loss_weight(3) == 1.0


@given(st.integers(1, 300), st.integers(1, 9), st.integers(1, 40))
def test_a_pipeline_takes_only_full_micro_batches(b, m, w):
    """A PipelineModule engine's loss_fn cannot take loss_weight: any batch with a weight other than 1.0 (an
    uneven share or a short micro-batch) is refused for it in one line; a batch of full micro-batches is not."""
    try:
        batch = ElasticBatch(global_batch=b, micro_batch=m, world=w)
    except ConfigError:
        return
    weights = {batch.loss_weight(size) for r in range(w) for size in batch.micro_sizes(r)}
    problem = batch.pipeline_problem()
    assert (problem is None) == (weights == {1.0}) == batch.even
    if problem is not None:
        assert "\n" not in problem and f'"global_batch": {b}' in problem and f"on {w} data-parallel ranks" in problem


@given(st.integers(1, 300), st.integers(1, 9), st.integers(1, 40))
def test_shares_cover_the_global_batch_once_with_the_same_accumulation_everywhere(b, m, w):
    try:
        batch = ElasticBatch(b, m, w)
    except ConfigError:
        assert b < w or (m == 1 and b % w)
        return
    sizes = [batch.micro_sizes(r) for r in range(w)]
    assert sum(map(sum, sizes)) == b
    assert all(len(s) == batch.accumulation and min(s) >= 1 and max(s) <= m for s in sizes)
    assert [batch.offset(r + 1) - batch.offset(r) for r in range(w - 1)] == [batch.share(r) for r in range(w - 1)]


@given(st.integers(2, 64), st.integers(2, 8), st.integers(1, 9), st.randoms(use_true_random=False))
def test_weighted_micro_batch_means_make_the_mean_over_the_global_batch(b, m, w, rnd):
    """What DeepSpeed computes (each micro-batch's mean loss x weight / A, averaged over W ranks) equals the
    mean over the B samples, exactly (fractions), with uneven shares."""
    if b < w:
        return
    batch = ElasticBatch(b, m, w)
    samples = [Fraction(rnd.randint(-1000, 1000), 7) for _ in range(b)]
    total, first = Fraction(0), 0
    for r in range(w):
        for k in batch.micro_sizes(r):
            mean = sum(samples[first:first + k]) / k
            total += mean * Fraction(batch.loss_weight(k)).limit_denominator(10 ** 9) / batch.accumulation / w
            first += k
    assert total == sum(samples) / b


def test_impossible_shares_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="smaller than the 8 ranks"):
        ElasticBatch(4, 2, 8)
    with pytest.raises(ConfigError, match="use micro_batch 2 or more"):
        ElasticBatch(10, 1, 7)
    with pytest.raises(ConfigError, match='needs "global_batch"'):
        ElasticBatch.from_config({"global_batch": 8}, 2)
    with pytest.raises(ConfigError, match="unknown key 'micro'"):
        ElasticBatch.from_config({"global_batch": 8, "micro_batch": 2, "micro": 1}, 2)


def engine(b: int, m: int, w: int, rank: int, global_samples: int = 0):
    return SimpleNamespace(ucp_elastic=ElasticBatch(b, m, w), global_rank=rank, global_samples=global_samples)


def global_batches(dataset_size: int, b: int, m: int, w: int, steps: int, start: int = 0, seed: int = 0):
    """Each step's samples, gathered from every rank's micro-batches in rank order."""
    samplers = [ElasticBatchSampler(range(dataset_size), engine(b, m, w, r, start), seed=seed) for r in range(w)]
    streams = [iter(_epochs(s)) for s in samplers]
    a = ElasticBatch(b, m, w).accumulation
    return [[i for stream in streams for _ in range(a) for i in next(stream)] for _ in range(steps)]


def _epochs(sampler):
    while True:
        yield from sampler


@pytest.mark.parametrize("w", [1, 2, 3, 4, 7])
def test_every_world_size_trains_on_the_same_global_batches(w):
    reference = global_batches(23, 10, 2, 4, steps=9)
    assert global_batches(23, 10, 2, w, steps=9) == reference
    # one global order: epochs are permutations of the dataset, cut into batches of 10 without dropping any
    flat = [i for step in reference for i in step]
    assert sorted(flat[:23]) == list(range(23)) and sorted(flat[23:46]) == list(range(23))


def test_a_resumed_sampler_continues_after_the_samples_consumed_at_another_world_size():
    reference = global_batches(23, 10, 2, 4, steps=9)
    assert global_batches(23, 10, 2, 3, steps=5, start=40) == reference[4:]


def test_another_seed_is_another_order():
    """Negative control: the check above can fail."""
    assert global_batches(23, 10, 2, 4, steps=3, seed=1) != global_batches(23, 10, 2, 4, steps=3)


def test_len_is_what_the_next_iteration_yields():
    sampler = ElasticBatchSampler(range(23), engine(10, 2, 3, 1, 20))
    assert len(sampler) == len(list(sampler)) == 1 * 2  # the batch starting at 20 is the epoch's last
    assert len(sampler) == len(list(sampler)) == 2 * 2  # positions 30, 40 start in epoch 1


def test_an_engine_without_elastic_batches_is_refused():
    with pytest.raises(ConfigError, match='"elastic"'):
        ElasticBatchSampler(range(8), SimpleNamespace(global_rank=0, global_samples=0))


def test_speed_shares_cut_the_batch_by_speed_one_sample_each_at_least():
    assert speed_shares(8, [2 / 1.05, 1]) == (5, 3)
    assert speed_shares(12, [1, 1, 1]) == (4, 4, 4)
    assert speed_shares(3, [100, 1, 1]) == (1, 1, 1)
    assert speed_shares(10, [3, 1]) == (7, 3)   # 1 + 8 * 3/4 and 1 + 8 * 1/4
    with pytest.raises(ConfigError, match="smaller than the 3 replicas"):
        speed_shares(2, [1, 1, 1])
    with pytest.raises(ConfigError, match=r"speeds \[1, 0\]: need one positive, finite speed per replica"):
        speed_shares(8, [1, 0])


@given(st.integers(1, 300), st.lists(st.floats(0.01, 100), min_size=1, max_size=12))
def test_speed_shares_cover_the_batch_and_follow_the_speeds(b, speeds):
    if b < len(speeds):
        return
    shares = speed_shares(b, speeds)
    assert sum(shares) == b and min(shares) >= 1
    rest = b - len(speeds)
    for n, s in zip(shares, speeds):  # within one sample of the exact part of the rest
        assert abs(n - 1 - rest * s / sum(speeds)) < 1


def test_replicas_with_uneven_shares_draw_the_homogeneous_global_batches():
    reference = global_batches(23, 10, 10, 1, steps=7)
    batch = ElasticBatch(10, 6, 2, shares=(6, 4))
    samplers = [ElasticBatchSampler.for_replica(range(23), batch, r) for r in range(2)]
    streams = [iter(_epochs(s)) for s in samplers]
    assert [next(streams[0]) + next(streams[1]) for _ in range(7)] == reference
    assert [len(s) for s in (next(streams[0]), next(streams[1]))] == [6, 4]
    with pytest.raises(ConfigError, match=r"shares \[6, 3\]: need one positive share per rank \(2\) summing to the "
                                          "global batch 10"):
        ElasticBatch(10, 6, 2, shares=(6, 3))
