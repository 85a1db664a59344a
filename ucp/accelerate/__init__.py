"""`accelerator.load_state(path)` at another number of processes, for Accelerate runs with DeepSpeed.

    accelerator.load_state(path)                    # stock: the world size that saved it
    ucp.accelerate.load_state(accelerator, path)    # any world size and ZeRO stage

Accelerate itself runs `load_state`; only the engine's `load_checkpoint` is replaced, for this call,
by `ucp.deepspeed.load` of the DeepSpeed checkpoint Accelerate saved under `path` (read directly,
resharded for this run's layout: weights, fp32 masters, moments, step, the engine's scheduler).
Accelerate's own files are read where they still apply: a scheduler it keeps outside the engine
(`scheduler.bin`), samplers, custom objects. RNG states saved by another number of processes cannot
be mapped to these ranks: they are left as this run has them, and a warning says so once.

`checkpoint` (and `path` itself, when it is a ucp checkpoint the run needs nothing beside) may be an
`s3://bucket/prefix` URL of a ucp checkpoint: the engine is read from there by ranged GETs, each rank only its
bytes. Accelerate's own files are read from a local folder (an `s3://` `path` alone gives it an empty
temporary one); a DeepSpeed checkpoint (Accelerate's `save_state` folder) uploaded as it is cannot be read
from object storage and is refused, naming the conversion to run.

The prepared DataLoaders keep the sample order of the run that saved (`ucp.accelerate.data_order`:
where Accelerate's order comes from, and which samplers ucp gives it back to); a sampler whose order
cannot be carried to this number of processes is refused, naming the fix, before anything is loaded.
`checkpoint="auto"` makes `input_dir` a save folder of `save_state` folders (`checkpoint_N`): the newest complete
one is loaded (`ucp.accelerate.state_folders`; newer incomplete ones are moved aside with a warning naming them
and the one used), or nothing when there is none, and one line on the main process says which; the folder
loaded is returned (None: a fresh start); with `automatic_checkpoint_naming` the next `save_state` then writes the
folder after it. The data order then carries to the new size as above.

Importing this module makes `Accelerator.prepare` record what each DataLoader's order is drawn from,
so import it before `prepare`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path

from ucp.accelerate import data_order
from ucp.deepspeed.config import AUTO, load_options, ucp_options
from ucp.errors import CheckpointNotFoundError, ConfigError
from ucp.storage.layer import is_remote
from ucp.storage.locations import Location, ObjectPath, local_only, location

logger = logging.getLogger("ucp.accelerate")


def load_state(accelerator, input_dir: str | os.PathLike, checkpoint: str | os.PathLike | None = None,
               **load_model_func_kwargs) -> Location | None:
    """Restore `accelerator`'s prepared objects from `input_dir` (written by `accelerator.save_state`).

    `checkpoint` overrides where the engine's state is read from (e.g. a ucp conversion of the
    DeepSpeed checkpoint inside `input_dir`). Options of `ucp.deepspeed.load` come from the `"ucp"`
    section of the DeepSpeed config, as with `ucp.deepspeed.initialize`. `input_dir` may be a ucp
    checkpoint alone when the run keeps nothing outside the engine that `save_state` would have saved
    beside it (a scheduler of its own, custom objects); otherwise that is refused, naming those files.
    """
    from accelerate.utils import DistributedType

    from ucp import deepspeed as ucp_deepspeed
    from ucp.checkpoint import saved_world_size

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise ConfigError("ucp.accelerate.load_state resumes DeepSpeed runs; this Accelerator has no DeepSpeed "
                          "plugin, so use accelerator.load_state")
    if isinstance(checkpoint, str) and checkpoint == AUTO:
        found = _auto_folder(accelerator, input_dir)
        if found is None:
            return None
        input_dir, checkpoint = found, None
        _next_save_after(accelerator, found)
    options = load_options(ucp_options(accelerator.state.deepspeed_plugin.deepspeed_config))
    source = engine_source(input_dir, checkpoint)
    alone = checkpoint is None and source is not None
    if alone:
        _check_nothing_else_is_needed(accelerator, location(input_dir))
    engines = accelerator._models

    def ucp_load_checkpoint(engine):
        def load_checkpoint(load_dir, tag=None, **_):
            path = source or (Path(load_dir) / tag if tag else Path(load_dir))
            client_state = ucp_deepspeed.load(engine, path, **options)
            return str(path), client_state
        return load_checkpoint

    saved = saved_world_size(source or Path(input_dir))
    data_order.keep_order(accelerator._dataloaders, saved, accelerator.num_processes)
    for engine in engines:
        engine.load_checkpoint = ucp_load_checkpoint(engine)  # an instance attribute: this call only
    keep_rng = saved != accelerator.num_processes
    try:
        with _rng_kept() if keep_rng else contextlib.nullcontext(), _accelerate_folder(input_dir) as folder:
            accelerator.load_state(folder, **load_model_func_kwargs)
    finally:
        for engine in engines:
            del engine.load_checkpoint
    if keep_rng and accelerator.is_main_process:
        logger.warning("RNG states were saved by %d processes and cannot be mapped to %d; this run keeps its own",
                       saved, accelerator.num_processes)
    elif alone and accelerator.is_main_process:
        logger.warning("%s: a ucp checkpoint holds no RNG states (accelerator.save_state keeps them beside the "
                       "engine's files); this run keeps its own", input_dir)
    return location(input_dir)


def _auto_folder(accelerator, save_dir: str | os.PathLike) -> Path | None:
    """The newest complete `save_state` folder of `save_dir`, the same on every process, or None to start fresh;
    the main process moves newer incomplete ones aside and says what the run does."""
    from ucp.accelerate.state_folders import newest_complete, set_aside

    local_only(save_dir, 'ucp.accelerate.load_state(..., checkpoint="auto")\'s save folder')
    chosen: list[str | None] = [None]
    if accelerator.is_main_process:
        folder, passed = newest_complete(save_dir)
        chosen[0] = None if folder is None else str(folder)
        moved = set_aside([f for f, _ in passed]) if folder is not None else []
        for (skipped, why), new in zip(passed, moved + [None] * len(passed)):
            logger.warning("ucp: %s is incomplete (%s): %s%s", skipped, why,
                           f"resuming from {folder.name} instead" if folder is not None else "no complete one",
                           f"; moved to {new}" if new is not None else "")
        logger.warning("ucp: %s", f"resuming from {folder} on {accelerator.num_processes} processes"
                       if folder is not None else f"no complete save_state folder in {save_dir}: starting fresh")
    if accelerator.num_processes > 1:
        import torch.distributed as dist

        dist.broadcast_object_list(chosen, src=0)
    accelerator.wait_for_everyone()  # the moves are done before any process saves
    return None if chosen[0] is None else Path(chosen[0])


def _next_save_after(accelerator, folder: Path) -> None:
    """With `automatic_checkpoint_naming`, the next `save_state` writes `checkpoint_<N+1>` after resuming from
    `checkpoint_<N>`: Accelerate leaves its count at 0 on a restart, and refuses to write into a folder that
    exists (newer incomplete folders were moved aside, so N+1 on is free)."""
    from ucp.accelerate.state_folders import NUMBERED

    config = accelerator.project_configuration
    number = NUMBERED.search(folder.name)
    if config.automatic_checkpoint_naming and number is not None:
        config.iteration = int(number.group(1)) + 1


def engine_source(input_dir: str | os.PathLike | ObjectPath,
                  checkpoint: str | os.PathLike | ObjectPath | None) -> Location | None:
    """Where the engine's state is read from: `checkpoint`, or `input_dir` when it is a ucp checkpoint given
    alone, else None (the DeepSpeed checkpoint inside `input_dir`). An `s3://` `input_dir` without `checkpoint`
    must be such a ucp checkpoint: Accelerate's own files and DeepSpeed's are read from local folders only."""
    if checkpoint is not None:
        local_only(input_dir, "ucp.accelerate.load_state's input_dir (save_state's folder) beside checkpoint=")
        return location(checkpoint)
    place = location(input_dir)
    if _is_ucp_checkpoint(place):
        return place
    if is_remote(place):
        from ucp.checkpoint import refuse_deepspeed_objects
        from ucp.format.folder import INDEX_NAME

        refuse_deepspeed_objects(place, "pass as checkpoint=")
        raise CheckpointNotFoundError(
            f"{place}: holds no ucp checkpoint (no {INDEX_NAME}); Accelerate's save_state folder is read from a "
            "local folder: ucp.accelerate.load_state(accelerator, STATE_DIR, checkpoint='s3://...') with the "
            "ucp conversion of its DeepSpeed checkpoint (ucp convert --input STATE_DIR --output s3://...)")
    return None


def _is_ucp_checkpoint(path: Location) -> bool:
    from ucp.format.folder import INDEX_NAME, latest_checkpoint
    from ucp.storage.layer import is_file

    return is_file(path / INDEX_NAME) or latest_checkpoint(path) is not None


@contextlib.contextmanager
def _accelerate_folder(input_dir: str | os.PathLike | ObjectPath) -> Iterator[str]:
    """The local folder `accelerator.load_state` reads Accelerate's own files from: `input_dir`, or an empty
    temporary one for an `s3://` ucp checkpoint given alone (which holds none of them)."""
    place = location(input_dir)
    if not is_remote(place):
        yield str(place)
        return
    with tempfile.TemporaryDirectory(prefix="ucp-accelerate-") as empty:
        yield empty


def _check_nothing_else_is_needed(accelerator, path: Location) -> None:
    """Refuse a ucp checkpoint given alone when the run has state that `accelerator.save_state` keeps outside
    the engine, which only its own folder holds."""
    from accelerate.utils import DeepSpeedSchedulerWrapper

    schedulers = [s for s in accelerator._schedulers if not isinstance(s, DeepSpeedSchedulerWrapper)]
    missing = [f"scheduler{f'_{i}' if i else ''}.bin (the {type(getattr(s, 'scheduler', s)).__name__} outside "
               "the engine)" for i, s in enumerate(schedulers)]
    missing += [f"custom_checkpoint_{i}.pkl" for i in range(len(accelerator._custom_objects))]
    if missing:
        raise ConfigError(f"{path}: a ucp checkpoint holds the engine's state, not what accelerator.save_state "
                          f"keeps beside it and this run needs: {', '.join(missing)}; pass save_state's folder "
                          f"and this checkpoint: ucp.accelerate.load_state(accelerator, STATE_DIR, "
                          f"checkpoint='{path}')")


@contextlib.contextmanager
def _rng_kept():
    """Python, numpy and torch (CPU and CUDA) RNG states as they were before the block."""
    import numpy as np
    import torch

    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


data_order.install()
