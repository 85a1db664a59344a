"""One global sample order, cut into global batches of B, whatever the world size: `ElasticBatchSampler`.

    sampler = ucp.elastic.ElasticBatchSampler(dataset, engine, shuffle=True, seed=0)
    for batch in DataLoader(dataset, batch_sampler=sampler):
        loss = loss_fn(engine(batch["x"]), batch["y"])                 # mean over the micro-batch
        engine.backward(loss * sampler.loss_weight(len(batch["x"])))
        engine.step()

The stream is the dataset's epochs one after the other, each a permutation drawn from `seed + epoch`
(`torch.randperm`, the same on every machine), and global batch t is positions [t * B, (t + 1) * B) of
it: a batch that starts near an epoch's end takes the next epoch's first samples, so no sample is
dropped and the cut does not depend on the world size. Each rank yields its data-parallel rank's share of
each global batch (`ucp.elastic.shares`) as the engine's A micro-batches, so every rank runs the same number
per step; the tensor-parallel ranks of a replica get the same samples, and a pipeline engine takes them as
`engine.train_batch(iter(loader))`.

The sampler starts right after the samples the engine has consumed (`engine.global_samples`, which a
ucp load restores from the checkpoint, whatever world size saved it) and then keeps its own position,
so a DataLoader's workers may prefetch ahead of the engine. One `iter()` runs to the end of the epoch
its first batch starts in; the next `iter()` goes on from there, as a DataLoader's epochs do.

`StepBatchSampler` cuts the same stream for a loop that counts its own epochs and skips the batches of a
resumed epoch itself (the Hugging Face Trainer): epoch e is global batches [e * S, (e + 1) * S) with S =
max(len(dataset) // B, 1), so an epoch is the same S optimizer steps at every world size, and the loop's
own skipping of (steps done in this epoch) x A micro-batches lands on the step it resumes at.
"""
from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import TYPE_CHECKING

import torch

from ucp.elastic.shares import ElasticBatch
from ucp.errors import ConfigError

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


class ElasticBatchSampler(torch.utils.data.Sampler[list[int]]):
    """This rank's micro-batches (lists of dataset indices) of each global batch, in one seeded global order."""

    def __init__(self, dataset: Sized, engine: DeepSpeedEngine, shuffle: bool = True, seed: int = 0):
        batch = getattr(engine, "ucp_elastic", None)
        if not isinstance(batch, ElasticBatch):
            raise ConfigError('ElasticBatchSampler needs an engine built by ucp.deepspeed.initialize with '
                              '"ucp": {"elastic": {"global_batch": B, "micro_batch": m}} in its config')
        place = getattr(engine, "ucp_layout", None)  # every TP rank (pipeline stage) of a replica takes its samples
        rank = int(place.dp_rank) if place is not None else int(engine.global_rank)
        self._start(dataset, batch, rank, int(engine.global_samples), shuffle, seed)

    @classmethod
    def for_replica(cls, dataset: Sized, batch: ElasticBatch, replica: int, consumed: int = 0, shuffle: bool = True,
                    seed: int = 0) -> ElasticBatchSampler:
        """Replica `replica`'s micro-batches under heterogeneous model parallelism, without an engine: `batch`
        has one share per replica (`speed_shares`), every rank of the replica draws the same samples, and the
        stream starts after `consumed` samples."""
        sampler = cls.__new__(cls)
        sampler._start(dataset, batch, replica, consumed, shuffle, seed)
        return sampler

    def _start(self, dataset: Sized, batch: ElasticBatch, rank: int, position: int, shuffle: bool, seed: int) -> None:
        self.batch = batch
        self.size = len(dataset)
        if self.size == 0:
            raise ConfigError("ElasticBatchSampler: the dataset is empty")
        self.rank = rank
        self.stream = SampleStream(self.size, shuffle, seed)
        self.position = position  # the next sample of the stream to train on

    def loss_weight(self, samples: int) -> float:
        """The factor for the mean loss of a micro-batch of `samples` samples, so that each step's gradient
        is the mean over its B samples (1.0 when every micro-batch is full)."""
        return self.batch.loss_weight(samples)

    def __len__(self) -> int:
        """The number of micro-batches the next `iter()` yields on this rank."""
        return len(self._steps()) * self.batch.accumulation

    def __iter__(self) -> Iterator[list[int]]:
        offset = self.batch.offset(self.rank)
        for start in self._steps():
            first = start + offset
            for size in self.batch.micro_sizes(self.rank):
                yield self.stream.indices(first, size)
                first += size
            self.position = start + self.batch.global_batch

    def _steps(self) -> range:
        """Stream positions of the global batches of the next `iter()`: those starting in the current epoch."""
        end = (self.position // self.size + 1) * self.size
        return range(self.position, end, self.batch.global_batch)


class StepBatchSampler(torch.utils.data.Sampler[list[int]]):
    """This rank's micro-batches of the global batches of epoch `set_epoch(e)`: [e * S, (e + 1) * S) (module
    docstring). For a loop that skips a resumed epoch's first batches itself, as the Hugging Face Trainer does."""

    def __init__(self, size: int, batch: ElasticBatch, rank: int, shuffle: bool = True, seed: int = 0):
        if size == 0:
            raise ConfigError("StepBatchSampler: the dataset is empty")
        self.batch, self.rank = batch, rank
        self.stream = SampleStream(size, shuffle, seed)
        self.steps_per_epoch = max(size // batch.global_batch, 1)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps_per_epoch * self.batch.accumulation

    def __iter__(self) -> Iterator[list[int]]:
        offset = self.batch.offset(self.rank)
        first_step = self.epoch * self.steps_per_epoch
        for step in range(first_step, first_step + self.steps_per_epoch):
            first = step * self.batch.global_batch + offset
            for size in self.batch.micro_sizes(self.rank):
                yield self.stream.indices(first, size)
                first += size


class SampleStream:
    """The dataset's epochs one after the other, each a permutation drawn from `seed + epoch` (or in order)."""

    def __init__(self, size: int, shuffle: bool, seed: int):
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self._orders: dict[int, torch.Tensor] = {}

    def indices(self, first: int, count: int) -> list[int]:
        """The dataset indices at stream positions [first, first + count)."""
        out = []
        for position in range(first, first + count):
            epoch, i = divmod(position, self.size)
            out.append(int(self._order(epoch)[i]))
        return out

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            if len(self._orders) > 2:  # positions mostly grow: the oldest epoch is done with
                self._orders.pop(min(self._orders))
            if self.shuffle:
                generator = torch.Generator().manual_seed(self.seed + epoch)
                self._orders[epoch] = torch.randperm(self.size, generator=generator)
            else:
                self._orders[epoch] = torch.arange(self.size)
        return self._orders[epoch]
