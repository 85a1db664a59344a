"""The sample order and the batch of a Lightning run across world sizes.

Lightning gives a distributed run's training DataLoader a `DistributedSampler` (seed `PL_GLOBAL_SEED`, 0 by default):
epoch e is one permutation of the dataset drawn from `seed + e`, the same at any world size, and process r takes its
positions r, r + W, r + 2W, ... So with a DataLoader `batch_size` of B / W (`per_process_batch`), micro-batch round j
of an epoch covers global positions [j * B, (j + 1) * B) at every W: each optimizer step sees the same B samples at 1,
2 or 3 processes, only summed in another order. What it cannot do, and where ucp comes in:

* B must be a multiple of every world size the job runs at (each process takes the same batch size), and the
  dataset's length too: otherwise `DistributedSampler` repeats samples to even out the processes' shares. A B that
  a world size does not divide is refused in one line (`per_process_batch`).
* A checkpoint saved in the middle of an epoch (`ModelCheckpoint(every_n_train_steps=...)`): Lightning restores its
  loop counters but starts the epoch's DataLoader over from its first batch ("not resumable"), training again on
  samples the run has seen and never reaching others. `ucp.lightning.DeepSpeedStrategy` makes the resumed epoch's
  sampler skip the batches done (`skip_done_batches`): k micro-batch rounds cover the same global positions at any
  world size, so skipping k batches on each process continues the run where it stopped.
"""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DistributedSampler

from ucp.errors import ConfigError


def per_process_batch(global_batch: int, world_size: int) -> int:
    """The DataLoader `batch_size` that makes `global_batch` samples per micro-batch round over `world_size`
    processes; `ConfigError` in one line when the processes cannot share it evenly."""
    if not isinstance(global_batch, int) or isinstance(global_batch, bool) or global_batch < 1:
        raise ConfigError(f"global_batch {global_batch!r}: must be a positive number of samples")
    if global_batch % world_size:
        raise ConfigError(f"global_batch {global_batch} cannot be shared by {world_size} processes (Lightning's "
                          "DistributedSampler gives each the same batch size): choose a global batch that every "
                          f"world size of the job divides, e.g. {global_batch * world_size}")
    return global_batch // world_size


class _SkippingSampler(DistributedSampler):
    """A `DistributedSampler` whose next epoch starts `_ucp_skip` indices in (its class, set on one instance)."""

    _ucp_skip = 0

    def __iter__(self) -> Iterator[Any]:
        skip, self._ucp_skip = self._ucp_skip, 0
        return itertools.islice(super().__iter__(), skip, None)


def skip_done_batches(trainer: Any) -> int:
    """Make the training DataLoader's first epoch after a mid-epoch resume start after the batches that epoch has
    trained (the restored loop's count); the number of batches skipped (0: nothing to skip or no
    `DistributedSampler` to skip in). Called at `on_train_start`, before the epoch's DataLoader is iterated."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    loader = trainer.train_dataloader
    batches = trainer.num_training_batches
    if not done or loader is None or done >= batches:
        return 0
    sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
    size = getattr(loader, "batch_size", None)
    if not isinstance(sampler, DistributedSampler) or not size:
        return 0
    sampler.__class__ = type("SkippingDistributedSampler", (_SkippingSampler, type(sampler)), {})
    setattr(sampler, "_ucp_skip", done * size)  # noqa: B010  # an attribute of the class it now has
    return int(done)
