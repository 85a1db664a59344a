"""StepBatchSampler: the Trainer's epochs cut one global sample order the same way at every world size."""
from __future__ import annotations

import pytest

from ucp.elastic.sampler import SampleStream, StepBatchSampler
from ucp.elastic.shares import ElasticBatch

SIZE, B, M = 23, 5, 2  # 23 samples: global batches cross the dataset's epochs


def global_batches(world: int, epoch: int) -> list[list[int]]:
    """Each step's samples of Trainer epoch `epoch`, gathered over the ranks in rank order."""
    batch = ElasticBatch(B, M, world)
    per_rank = []
    for rank in range(world):
        sampler = StepBatchSampler(SIZE, batch, rank, shuffle=True, seed=3)
        sampler.set_epoch(epoch)
        micro = list(sampler)
        assert len(micro) == len(sampler) == sampler.steps_per_epoch * batch.accumulation
        a = batch.accumulation
        per_rank.append([sum(micro[i:i + a], []) for i in range(0, len(micro), a)])
    return [sum((steps[t] for steps in per_rank), []) for t in range(len(per_rank[0]))]


@pytest.mark.parametrize("epoch", [0, 1, 5])
def test_every_world_size_trains_the_same_global_batches(epoch):
    stream = SampleStream(SIZE, True, 3)
    steps = SIZE // B
    expected = [stream.indices((epoch * steps + t) * B, B) for t in range(steps)]
    for world in (1, 2, 3, 4):
        assert global_batches(world, epoch) == expected, world


def test_negative_control_epochs_and_seeds_are_other_samples():
    assert global_batches(3, 0) != global_batches(3, 1)
    other_seed = SampleStream(SIZE, True, 4)
    assert global_batches(3, 0)[0] != other_seed.indices(0, B)


def test_resume_skipping_lands_on_the_step():
    """The Trainer skips (steps done this epoch) x A micro-batches: at any world size the next ones are the
    next step's share."""
    for world in (2, 3):
        batch = ElasticBatch(B, M, world)
        sampler = StepBatchSampler(SIZE, batch, 0, seed=3)
        sampler.set_epoch(1)
        micro = list(sampler)[2 * batch.accumulation:][:batch.accumulation]
        start = (1 * (SIZE // B) + 2) * B
        assert sum(micro, []) == SampleStream(SIZE, True, 3).indices(start, batch.share(0))
