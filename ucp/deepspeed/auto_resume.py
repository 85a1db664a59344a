"""`"ucp": {"load": "auto"}`: resume from the newest good checkpoint of the save folder, or start fresh.

`resume_auto` loads the newest committed checkpoint of the save folder that passes its checks (the candidates:
`ucp.elastic.resume`), falling back to older ones with a warning naming both (the newer ones are set aside as
`<tag>.damaged`), or starts fresh; every rank takes the same decision. With the memory tier, a newer memory
checkpoint of this job that the nodes hold completely is tried first (`ucp.deepspeed.memory.resume`); one that
fails its checks or does not fit the model is passed over with a warning, and the disk tier loads. `Resumed` says
what the start loaded, for the restart report (`ucp.deepspeed.life.StepBook`).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ucp.collectives import rank, world_size
from ucp.deepspeed.config import MemoryEvery
from ucp.deepspeed.memory.resume import memory_resume_point
from ucp.elastic.resume import candidates, set_aside
from ucp.errors import CheckpointMismatchError, CorruptCheckpointError
from ucp.format.save_folder import tag_step
from ucp.storage.locations import Location

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

logger = logging.getLogger("ucp.elastic")


@dataclass(frozen=True)
class Resumed:
    """What `resume_auto` loaded (path None: started fresh), its step, and how long the load took."""

    path: Location | None
    step: int
    load_s: float


def resume_auto(engine: DeepSpeedEngine, save_dir: Location, load: Callable[..., Any],
                memory: MemoryEvery | None = None, **load_kwargs: Any) -> Resumed:
    """Load the newest committed checkpoint of `save_dir` that passes its checks, or start fresh; with `memory`,
    a newer memory checkpoint that the nodes hold completely comes first (`ucp.deepspeed.memory.resume`).

    Rank 0 lists the candidates and every rank tries the same ones in the same order; `load` raises the
    same error on every rank, with the engine untouched (`check_first`), so all fall back together.
    """
    box = [candidates(save_dir) if rank() == 0 else []]  # the other ranks get rank 0's
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
            if rank() == 0:
                later = found[len(failed)] if len(failed) < len(found) else None
                logger.warning("ucp: %s fails its checks (%s); %s", path, exc,
                               f"falling back to {later}" if later else "no older committed checkpoint is left")
            continue
        on_disk = [p for p, _ in failed if p != in_memory]
        if on_disk and rank() == 0:
            moved = set_aside(on_disk, path)
            logger.warning("ucp: set aside %s, so that training saves those steps again", ", ".join(map(str, moved)))
        if on_disk and dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's first save comes after the renames
        if rank() == 0:
            logger.warning("ucp: resuming from %s (step %d) on %d ranks", path, engine.global_steps, world_size())
        return Resumed(path, engine.global_steps, time.perf_counter() - began)
    if failed:
        listed = "; ".join(f"{p}: {e}" for p, e in failed)
        raise CorruptCheckpointError(f"{save_dir}: every committed checkpoint fails its checks ({listed}); restore "
                                     "one from a copy, or move them away to start fresh")
    if rank() == 0:
        logger.warning("ucp: no committed checkpoint in %s: starting fresh", save_dir)
    return Resumed(None, 0, 0.0)
