"""The elastic loop's two halves for a Hugging Face `Trainer`: resume-or-start, and one global batch at any size.

`ucp.transformers.train` uses both:

* `auto_checkpoint`: rank 0 takes the newest complete `checkpoint-N` of `output_dir` (`trainer_folders`), sets
  aside the newer incomplete ones with a warning naming them and the one used, and says in one line what the
  run does; every rank gets rank 0's answer.
* `elastic_batches`: for one `train` call, the Trainer's per-device batch m and gradient accumulation A for
  this world size (`ElasticBatch`) and DeepSpeed's batch keys to match; a training DataLoader that draws this
  rank's share of each global batch of one seeded sample order (`StepBatchSampler`), so that the Trainer's own
  epoch count and resume skipping land on the same samples at any world size; and, where ranks take uneven
  shares, each micro-batch's loss weighted (`ElasticBatch.loss_weight`) unless the Trainer already divides by
  the tokens of the whole global batch (a model taking `num_items_in_batch`, with
  `average_tokens_across_devices`), which is exact for any shares.

The Trainer's DataLoader is not passed through `accelerator.prepare`, which would deal its batches out to the
ranks again; the Trainer moves each batch to its device itself (`_prepare_inputs`).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ucp.elastic.sampler import StepBatchSampler
from ucp.elastic.shares import ElasticBatch
from ucp.elastic.trainer_folders import newest_complete, not_a_folder, set_aside
from ucp.errors import ConfigError

logger = logging.getLogger("ucp.elastic")
TRAINER_KEYS = ("global_batch", "micro_batch")  # the "elastic" keys the Trainer honours: it trains data-parallel


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _everyone_gets(value: object) -> object:
    """Rank 0's `value`, on every rank."""
    box = [value]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def auto_checkpoint(trainer: Any) -> Path | None:
    """The `checkpoint-N` folder to resume from under `"auto"`, or None to start fresh (module docstring)."""
    output_dir = Path(trainer.args.output_dir)
    chosen: str | None = None
    problem = not_a_folder(output_dir) if _rank() == 0 else None
    problem = _everyone_gets(problem)  # type: ignore[assignment]  # rank 0's str | None
    if problem is not None:
        raise ConfigError(problem)
    if _rank() == 0:
        folder, passed = newest_complete(output_dir)
        chosen = None if folder is None else str(folder)
        if passed:
            moved = set_aside([f for f, _ in passed]) if folder is not None else []
            for (skipped, why), new in zip(passed, moved + [None] * len(passed)):
                logger.warning("ucp: %s is incomplete (%s): %s%s", skipped, why,
                               f"resuming from {folder.name} instead" if folder is not None else "no complete one",
                               f"; set aside as {new.name}" if new is not None else "")
        world = trainer.args.world_size
        logger.warning("ucp: %s", f"resuming from {chosen} on {world} ranks" if chosen is not None
                       else f"no complete checkpoint-N in {output_dir}: starting fresh on {world} ranks")
    chosen = _everyone_gets(chosen)  # type: ignore[assignment]  # rank 0's str | None
    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # the renames are done before any rank saves
    return None if chosen is None else Path(chosen)


class _StepLoader(torch.utils.data.DataLoader[Any]):
    """A DataLoader whose `set_epoch` reaches its `StepBatchSampler`, as the Trainer calls it each epoch."""

    def set_epoch(self, epoch: int) -> None:
        sampler = self.batch_sampler
        if isinstance(sampler, StepBatchSampler):
            sampler.set_epoch(epoch)


@contextlib.contextmanager
def elastic_batches(trainer: Any, section: object) -> Iterator[ElasticBatch]:
    """Within the block, `trainer` trains B samples per optimizer step in one global order (module docstring)."""
    args = trainer.args
    batch = ElasticBatch.from_config(section, args.world_size, TRAINER_KEYS, "the Hugging Face Trainer")
    if not getattr(args, "average_tokens_across_devices", True) and _normalises_by_tokens(trainer):
        raise ConfigError('"ucp": {"elastic": ...} needs TrainingArguments(average_tokens_across_devices=True) (the '
                          "default) for a model that divides its loss by num_items_in_batch: otherwise ranks with "
                          "uneven shares weigh their tokens differently")
    if trainer.train_dataset is None or not hasattr(trainer.train_dataset, "__len__"):
        raise ConfigError('"ucp": {"elastic": ...} draws a global sample order from a dataset with a length; this '
                          "Trainer's train_dataset has none (an IterableDataset): drop \"elastic\", or pass a "
                          "map-style dataset")
    args.per_device_train_batch_size = batch.micro_batch
    args.gradient_accumulation_steps = batch.accumulation
    trainer._train_batch_size = batch.micro_batch
    plugin = trainer.accelerator.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config.update(batch.deepspeed_keys())
        plugin.gradient_accumulation_steps = batch.accumulation
    if _rank() == 0:
        sizes = sorted({batch.share(r) for r in range(batch.world)}, reverse=True)
        logger.warning("ucp: %d samples per optimizer step on %d ranks: %s each, in %d micro-batch(es) of at most %d",
                       batch.global_batch, batch.world, " or ".join(map(str, sizes)), batch.accumulation,
                       batch.micro_batch)
    trainer.get_train_dataloader = lambda: _train_dataloader(trainer, batch)
    trainer.compute_loss = _weighted_loss(trainer, batch)
    try:
        yield batch
    finally:
        del trainer.get_train_dataloader
        del trainer.compute_loss


def _normalises_by_tokens(trainer: Any) -> bool:
    return bool(getattr(trainer, "model_accepts_loss_kwargs", False) or getattr(trainer, "compute_loss_func", None))


def _train_dataloader(trainer: Any, batch: ElasticBatch) -> torch.utils.data.DataLoader[Any]:
    """The Trainer's training DataLoader, as `Trainer._get_dataloader` builds it, on a `StepBatchSampler`."""
    args = trainer.args
    dataset, collator = trainer.train_dataset, trainer.data_collator
    try:
        import datasets  # type: ignore[import-not-found]  # optional: the Trainer runs without it
    except ImportError:
        datasets = None
    if datasets is not None and isinstance(dataset, datasets.Dataset):
        dataset = trainer._remove_unused_columns(dataset, description="training")
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description="training")
    seed = args.data_seed if args.data_seed is not None else args.seed
    sampler = StepBatchSampler(len(dataset), batch, args.process_index, shuffle=True, seed=seed)
    workers = args.dataloader_num_workers
    return _StepLoader(dataset, batch_sampler=sampler, collate_fn=collator, num_workers=workers,
                       pin_memory=args.dataloader_pin_memory,
                       persistent_workers=args.dataloader_persistent_workers if workers else False,
                       prefetch_factor=args.dataloader_prefetch_factor if workers else None)


def _weighted_loss(trainer: Any, batch: ElasticBatch) -> Callable[..., Any]:
    """`trainer.compute_loss`, its loss times `batch.loss_weight(samples)` where the Trainer averages per
    micro-batch (no `num_items_in_batch`); unchanged where it divides by the global batch's tokens."""
    stock = trainer.compute_loss

    def compute_loss(model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        samples = _samples(inputs)
        out = stock(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if num_items_in_batch is not None:
            return out
        weight = batch.loss_weight(samples)
        if return_outputs:
            loss, outputs = out
            return loss * weight, outputs
        return out * weight

    return compute_loss


def _samples(inputs: Any) -> int:
    for value in (inputs.values() if isinstance(inputs, dict) else [inputs]):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    raise ConfigError('"ucp": {"elastic": ...}: cannot tell how many samples a micro-batch holds (no tensor among '
                      "its inputs); drop \"elastic\"")

