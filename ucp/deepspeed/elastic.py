"""The engine's side of elastic training: batch keys for this world size, resume-or-start, step bookkeeping.

`ucp.deepspeed.initialize` calls these for the `"elastic"` section and `"load": "auto"` (see
`ucp.elastic` for the parts that know no engine):

* `with_batch_keys` sets DeepSpeed's three batch keys from `"elastic"` for this start's data-parallel degree
  (DeepSpeed refuses a train_batch_size that is not micro x accumulation x DP), and `with_layout_keys`
  AutoTP's size for its tensor-parallel degree (the layout: `ucp.elastic.layout_choice`).
* `resume_auto` loads the newest committed checkpoint of the save folder that passes its checks, falling
  back to older ones with a warning naming both (the newer ones are set aside as `<tag>.damaged`), or
  starts fresh; every rank takes the same decision. With the memory tier, a newer memory checkpoint of this
  job that the nodes hold completely is tried first (`ucp.deepspeed.memory_resume`); one that fails its
  checks or does not fit the model is passed over with a warning, and the disk tier loads.
* After each optimizer step the engine's checkpoint life (`ucp.deepspeed.life`) keeps `global_samples` at
  B per step and its `StepBook` records the job's progress (after `engine.step`, or a pipeline engine's
  `train_batch`), and after the first step of a restarted job logs what the restart cost (`Resumed` says what
  the start loaded).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from ucp.deepspeed.memory_files import MemoryEvery
from ucp.deepspeed.memory_resume import memory_resume_point
from ucp.elastic.layout_choice import RankLayout
from ucp.elastic.resume import candidates, set_aside, tag_step
from ucp.elastic.shares import BATCH_KEYS, ElasticBatch
from ucp.errors import CheckpointMismatchError, ConfigError, CorruptCheckpointError, UnsupportedLayoutError
from ucp.format.locations import Location

logger = logging.getLogger("ucp.elastic")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """This run's world size: torch.distributed's when it is up, else the launcher's WORLD_SIZE."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def with_batch_keys(config: dict, batch: ElasticBatch) -> dict:
    """`config` with DeepSpeed's batch keys for `batch`; keys the config gave otherwise are replaced, and said."""
    keys = batch.deepspeed_keys()
    replaced = {k: config[k] for k in BATCH_KEYS if k in config and config[k] not in (keys[k], "auto")}
    if replaced and _rank() == 0:
        logger.warning("ucp: \"elastic\" sets DeepSpeed's batch keys for %d ranks: %s (the config said %s)",
                       batch.world, keys, replaced)
    return {**config, **keys}


def uses_autotp(initialize_kwargs: dict) -> bool:
    """Whether `deepspeed.initialize` with these arguments splits the model by AutoTP: no Megatron-style `mpu` and
    no `PipelineModule` (those carry their own tensor-parallel layout, which the script builds from `layout()`)."""
    from deepspeed.pipe import PipelineModule

    return initialize_kwargs.get("mpu") is None and not isinstance(initialize_kwargs.get("model"), PipelineModule)


def with_layout_keys(config: dict, place: RankLayout, autotp: bool) -> dict:
    """`config` with AutoTP's `"tensor_parallel": {"autotp_size": T}` for this start's layout (none at T = 1), where
    `autotp`; a size the config gave otherwise is replaced, and said. Comes after `with_batch_keys`."""
    if not autotp:
        return config
    given = config.get("tensor_parallel")
    out = {k: v for k, v in config.items() if k != "tensor_parallel"}
    if place.tp > 1:
        out["tensor_parallel"] = {**(given if isinstance(given, dict) else {}), "autotp_size": place.tp}
        # DeepSpeed checks train_batch_size against the whole world before AutoTP divides it by T: leave it out
        # (the engine derives it; the checkpoint life keeps global_samples at B per step whatever it is).
        out.pop("train_batch_size", None)
    if isinstance(given, dict) and given.get("autotp_size", 1) not in (1, place.tp) and _rank() == 0:
        logger.warning('ucp: "elastic" sets AutoTP\'s autotp_size to %d for this layout (the config said %s)',
                       place.tp, given["autotp_size"])
    return out


def check_engine(engine, batch: ElasticBatch) -> None:
    """The engine runs the data-parallel degree the batch was shared for."""
    if engine.dp_world_size != batch.world:
        raise ConfigError(f'"ucp": {{"elastic": ...}}: the engine runs {engine.dp_world_size} data-parallel ranks, '
                          f"but the layout ucp chose has {batch.world}; call ucp.elastic.init_distributed() (or "
                          "deepspeed.init_distributed()) before ucp.deepspeed.initialize, and build the model for "
                          "ucp.elastic.layout()")
    problem = batch.pipeline_problem() if getattr(engine, "pipeline_parallelism", False) else None
    if problem is not None:
        raise UnsupportedLayoutError(problem)


@dataclass(frozen=True)
class Resumed:
    """What `resume_auto` loaded (path None: started fresh), its step, and how long the load took."""

    path: Location | None
    step: int
    load_s: float


def resume_auto(engine, save_dir: Location, load: Callable[..., dict], memory: MemoryEvery | None = None,
                **load_kwargs) -> Resumed:
    """Load the newest committed checkpoint of `save_dir` that passes its checks, or start fresh; with `memory`,
    a newer memory checkpoint that the nodes hold completely comes first (`ucp.deepspeed.memory_resume`).

    Rank 0 lists the candidates and every rank tries the same ones in the same order; `load` raises the
    same error on every rank, with the engine untouched (`check_first`), so all fall back together.
    """
    box = [candidates(save_dir) if _rank() == 0 else []]  # the other ranks get rank 0's
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    found: list[Location] = box[0]
    in_memory = None  # this rank's node copy of the memory checkpoint tried first (each rank names its own)
    if memory is not None:
        newest = tag_step(found[0]) if found else -1
        fallback = (f"resuming from the disk tier ({found[0]}, step {newest})" if found
                    else "starting fresh (no disk checkpoint)")
        point = memory_resume_point(memory, newest, fallback)
        if point is not None:
            in_memory = point
            found = [in_memory, *found]
    failed: list[tuple[Location, str]] = []
    for path in found:
        began = time.perf_counter()
        try:
            load(engine, path, **load_kwargs)
        except (CorruptCheckpointError, CheckpointMismatchError) as exc:
            if isinstance(exc, CheckpointMismatchError) and path != in_memory:
                raise  # a disk checkpoint of another model: the config is wrong, not the checkpoint
            failed.append((path, str(exc)))
            if _rank() == 0:
                later = found[len(failed)] if len(failed) < len(found) else None
                logger.warning("ucp: %s fails its checks (%s); %s", path, exc,
                               f"falling back to {later}" if later else "no older committed checkpoint is left")
            continue
        on_disk = [p for p, _ in failed if p != in_memory]
        if on_disk and _rank() == 0:
            moved = set_aside(on_disk, path)
            logger.warning("ucp: set aside %s, so that training saves those steps again", ", ".join(map(str, moved)))
        if on_disk and dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's first save comes after the renames
        if _rank() == 0:
            logger.warning("ucp: resuming from %s (step %d) on %d ranks", path, engine.global_steps, world_size())
        return Resumed(path, engine.global_steps, time.perf_counter() - began)
    if failed:
        listed = "; ".join(f"{p}: {e}" for p, e in failed)
        raise CorruptCheckpointError(f"{save_dir}: every committed checkpoint fails its checks ({listed}); restore "
                                     "one from a copy, or move them away to start fresh")
    if _rank() == 0:
        logger.warning("ucp: no committed checkpoint in %s: starting fresh", save_dir)
    return Resumed(None, 0, 0.0)
