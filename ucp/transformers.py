"""Resume a Hugging Face `Trainer` at any world size and ZeRO stage, straight from `checkpoint-N`.

    trainer.train(resume_from_checkpoint=path)        # stock: same world size, same ZeRO stage
    ucp.transformers.train(trainer, resume_from_checkpoint=path)   # any

`path` is a `checkpoint-N` folder the Trainer wrote with DeepSpeed (read directly, no conversion),
or its ucp conversion (`ucp convert` carries `trainer_state.json` and `config.json` along); `True`
means the last `checkpoint-N` in `output_dir`, as in transformers, and an output directory given as
`path` means its last `checkpoint-N` too (as `ucp convert --input OUTPUT_DIR` takes it). A last
`checkpoint-N` that a save did not finish is refused, naming the last complete one. Works for
`Trainer` and its subclasses (TRL's `SFTTrainer`, PEFT models, ...).

`path` may be an `s3://bucket/prefix` URL of a ucp conversion (`ucp convert --input checkpoint-N --output
s3://...`), of a save folder whose `latest` names one, or of a prefix holding `checkpoint-N` conversions (the
last complete one). The engine is read from there by ranged GETs, each rank only its bytes; the small files
the conversion carried (`trainer_state.json`, `config.json`, ...), which the Trainer reads with `os.path`, are
fetched, checked against the index, into a local temporary folder for the call. A DeepSpeed `checkpoint-N`
uploaded as it is cannot be read from object storage and is refused, naming the conversion to run.

The Trainer itself runs: its own state comes from `trainer_state.json` (global step, epoch, data
skipping, callbacks). For this call only, three of its resume steps are done by ucp instead:

* the engine is restored by `ucp.deepspeed.load` instead of `engine.load_checkpoint`: model
  weights, fp32 masters, optimizer moments, step and the engine's LR scheduler, resharded for this
  run's layout;
* the LR scheduler is not read again from `scheduler.pt` when the engine owns it (the usual case:
  an `"optimizer"` in the DeepSpeed config); the Trainer's own scheduler still comes from there;
* RNG states saved at another world size are not loaded, since they cannot be mapped to other
  ranks; a warning says so once.

`"auto"` (`resume_from_checkpoint="auto"`, or `"ucp": {"load": "auto"}`) is the one command for the first start
and every restart: the newest complete `checkpoint-N` of `output_dir`, or a fresh start (`ucp.elastic.hf_trainer`,
`ucp.elastic.trainer_folders`); `"ucp": {"elastic": {"global_batch": B, "micro_batch": m}}` (or `elastic=`) keeps
B samples per optimizer step in one global order at any world size.

A `"ucp"` section in the Trainer's DeepSpeed config is read here: its load options (`bypass`,
`strict`, `load_optimizer_states`, ...) apply, and its `"load"` is the checkpoint when
`resume_from_checkpoint` is not given. DeepSpeed itself ignores the section, so once this module is
imported a plain `trainer.train()` whose config has one says so in a warning instead of silently
training without it. `Trainer.train` gains that check, and one more: on CPU processes, a Trainer that sees
one of torchrun's several processes (Accelerate's state was not set up first) stops with an error naming
the recipe, before DeepSpeed stops on its batch-size arithmetic. Nothing else changes.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import tempfile
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal, TypeVar

from ucp.checkpoint import AtomicCheckpoint, refuse_deepspeed_objects, saved_world_size
from ucp.converters.trainer_folders import CHECKPOINT_RE, checkpoint_folders
from ucp.deepspeed.config import AUTO, load_options, ucp_options
from ucp.elastic.hf_trainer import auto_checkpoint, elastic_batches
from ucp.elastic.trainer_folders import missing_files
from ucp.errors import CheckpointNotFoundError, ConfigError
from ucp.format.folder import INDEX_NAME, latest_checkpoint
from ucp.storage.layer import is_file, is_remote, list_folders, list_names
from ucp.storage.locations import Location, ObjectPath, location

TRAINER_STATE = "trainer_state.json"
SCHEDULER_FILE = "scheduler.pt"
Folder = TypeVar("Folder", Path, ObjectPath)  # a checkpoint-N folder, local or in an object store
logger = logging.getLogger("ucp.transformers")


_through_ucp = contextvars.ContextVar("ucp_transformers_train", default=False)


def train(trainer, resume_from_checkpoint: str | os.PathLike | bool | None = None, elastic: dict | None = None,
          **kwargs):
    """`trainer.train(resume_from_checkpoint=..., **kwargs)`, resuming through ucp at any layout.

    `resume_from_checkpoint="auto"`: the newest complete `checkpoint-N` of `output_dir`, or a fresh start (module
    docstring). `elastic={"global_batch": B, "micro_batch": m}` (or the config's `"ucp": {"elastic": ...}`): B
    samples per optimizer step at this world size, in one global sample order (`ucp.elastic.hf_trainer`)."""
    token = _through_ucp.set(True)
    try:
        return _train(trainer, resume_from_checkpoint, elastic, **kwargs)
    finally:
        _through_ucp.reset(token)


def _train(trainer, resume_from_checkpoint, elastic, **kwargs):
    options = _trainer_options(trainer)
    if resume_from_checkpoint is None or resume_from_checkpoint is False:
        resume_from_checkpoint = options.get("load")
    if elastic is None:
        elastic = options.get("elastic")
    if resume_from_checkpoint is not None and not getattr(trainer, "is_deepspeed_enabled", False):
        raise ConfigError("ucp.transformers.train resumes DeepSpeed runs, and this Trainer has no DeepSpeed config; "
                          "pass TrainingArguments(deepspeed=...) as in the run that saved the checkpoint")
    with contextlib.ExitStack() as stack:
        stack.enter_context(_section_hidden(trainer))
        if elastic is not None:
            stack.enter_context(elastic_batches(trainer, elastic))
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint == AUTO:
            resume_from_checkpoint = auto_checkpoint(trainer)
        if resume_from_checkpoint is None:
            return trainer.train(**kwargs)
        folder = trainer_folder(resume_from_checkpoint, trainer.args.output_dir)
        local = stack.enter_context(_trainer_files(folder))
        stack.enter_context(_resuming_through_ucp(trainer, folder, options))
        return trainer.train(resume_from_checkpoint=str(local), **kwargs)


@contextlib.contextmanager
def _section_hidden(trainer):
    """Within the block, the DeepSpeed config has no `"ucp"` section, read already: Accelerate refuses a config
    with an "auto" left that it cannot fill, `"load": "auto"` included."""
    config = _deepspeed_config(trainer)
    section = config.pop("ucp", None) if config is not None else None
    try:
        yield
    finally:
        if section is not None:
            config["ucp"] = section


def _checked_train(stock_train):
    """`Trainer.train` that warns when the DeepSpeed config's `"ucp"` section goes unread, and refuses to start
    when the Trainer sees fewer processes than torchrun started (see `_check_world`)."""
    @functools.wraps(stock_train)
    def train_checked(self, *args, **kwargs):
        _check_world(self)
        if not _through_ucp.get() and "ucp" in (_deepspeed_config(self) or {}):
            logger.warning('the DeepSpeed config has a "ucp" section, which trainer.train() does not read (DeepSpeed '
                           "ignores it): call ucp.transformers.train(trainer, ...) to resume through ucp")
        return stock_train(self, *args, **kwargs)

    train_checked.ucp_checked = True
    return train_checked


def _install_checks() -> None:
    import transformers

    if not getattr(transformers.Trainer.train, "ucp_checked", False):
        setattr(transformers.Trainer, "train", _checked_train(transformers.Trainer.train))  # the check, installed


def _check_world(trainer) -> None:
    """On CPU processes the Trainer sees torchrun's world only when Accelerate's state is set up first;
    without it, it plans for one process and DeepSpeed stops with `train_batch_size is not equal to
    micro_batch_per_gpu * gradient_acc_step * world_size` (or, where those numbers happen to agree,
    every process trains on all the data)."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and trainer.args.world_size == 1 and getattr(trainer, "is_deepspeed_enabled", False):
        raise ConfigError(
            f"torchrun started {launched} processes, but the Trainer sees 1: on CPU it sees torchrun's processes "
            "only when Accelerate's state is set up before the Trainer is built: set "
            'os.environ["ACCELERATE_USE_DEEPSPEED"] = "true", call accelerate.PartialState(backend="gloo"), and pass '
            'TrainingArguments(..., accelerator_config={"use_configured_state": True}) (README, "With the Hugging '
            'Face Trainer"; examples/hf_trainer/train.py)')


def _deepspeed_config(trainer) -> dict | None:
    plugin = getattr(getattr(getattr(trainer, "accelerator", None), "state", None), "deepspeed_plugin", None)
    return getattr(plugin, "deepspeed_config", None)


def trainer_folder(path: str | os.PathLike[str] | ObjectPath | Literal[True],
                   output_dir: str | os.PathLike[str]) -> Location:
    """The folder to resume from: `path`; the last `checkpoint-N` of `output_dir` for True, or of `path` when it
    is an output directory; or the committed checkpoint a ucp save directory's `latest` names. It must hold
    `trainer_state.json`. For an `s3://` URL, the prefix of a ucp checkpoint found the same way."""
    if path is True:
        if not Path(output_dir).is_dir() or not checkpoint_folders(output_dir):
            raise CheckpointNotFoundError(f"{output_dir}: no checkpoint-N folder to resume from; pass "
                                          "resume_from_checkpoint=PATH")
        path = last_complete(output_dir)
    place = location(path)  # a URL no installed filesystem serves is refused in one line
    if is_remote(place):
        return _object_folder(place)
    folder = place
    if not folder.is_dir():
        raise CheckpointNotFoundError(f"{folder}: no such directory; pass a checkpoint-N folder the Trainer wrote, "
                                      "or its ucp conversion")
    if not (folder / TRAINER_STATE).is_file() and checkpoint_folders(folder):
        folder = last_complete(folder)  # an output_dir, as `ucp convert --input OUTPUT_DIR` takes it
    found = latest_checkpoint(folder) or folder
    if not is_file(found / TRAINER_STATE):
        raise _no_trainer_state(found, written_by_trainer=True)
    return found


def _no_trainer_state(folder: Location, written_by_trainer: bool) -> CheckpointNotFoundError:
    """`written_by_trainer`: `folder` is a local one the Trainer may have written, where a `checkpoint-N`
    without the file is a save cut short (a ucp conversion in a store is committed by its index)."""
    if written_by_trainer and CHECKPOINT_RE.search(folder.name):
        return CheckpointNotFoundError(
            f"{folder}: no {TRAINER_STATE}, which the Trainer writes last, so the save that wrote it did not finish; "
            "pass an earlier checkpoint-N, or resume_from_checkpoint=\"auto\" (the newest complete one)")
    return CheckpointNotFoundError(
        f"{folder}: no {TRAINER_STATE}, which holds the Trainer's step, epoch and data position; pass the "
        "checkpoint-N folder the Trainer wrote, or a ucp conversion of it (ucp convert --input checkpoint-N)")


def _object_folder(place: ObjectPath) -> Location:
    """`trainer_folder` for an `s3://` prefix, which must hold a ucp checkpoint (DeepSpeed's own files are read
    from local folders only): the prefix itself, its last complete `checkpoint-N`, or what its `latest` names."""
    names = list_names(place)
    if TRAINER_STATE not in names:  # an output_dir's copy, as locally
        folders = _object_checkpoint_folders(place)
        if folders:
            refuse_deepspeed_objects(folders[-1], "resume from")
            place = _last_complete(place, folders, _object_incomplete, "conversion or upload")
    folder: Location = place
    if not is_file(place / INDEX_NAME):
        found = latest_checkpoint(place)  # a ucp save folder
        if found is None:
            refuse_deepspeed_objects(place, "resume from")
            raise CheckpointNotFoundError(f"{place}: holds no ucp checkpoint (no {INDEX_NAME}); convert the "
                                          f"Trainer's checkpoint-N there: ucp convert --input checkpoint-N --output "
                                          f"{place}")
        folder = found
    if TRAINER_STATE not in AtomicCheckpoint(folder).extra_files:
        raise _no_trainer_state(folder, written_by_trainer=False)
    return folder


def _object_checkpoint_folders(prefix: ObjectPath) -> list[ObjectPath]:
    """The `checkpoint-N` sub-prefixes of `prefix`, by increasing N (`checkpoint_folders` of a local folder)."""
    found = [(int(m.group(1)), prefix / n) for n in list_folders(prefix) if (m := CHECKPOINT_RE.search(n))]
    return [folder for _, folder in sorted(found)]


def _object_incomplete(folder: ObjectPath) -> str | None:
    """What a `checkpoint-N` prefix lacks to be resumed from (its committed index), or None."""
    return None if is_file(folder / INDEX_NAME) else f"it has no {INDEX_NAME}"


@contextlib.contextmanager
def _trainer_files(folder: Location) -> Iterator[Path]:
    """The local folder the Trainer reads its own files from (`trainer_state.json`, ...): `folder` itself, or for
    an object-store checkpoint a temporary one holding the extra files its conversion carried, each checked
    against the index's size and CRC-32, removed afterwards."""
    if not is_remote(folder):
        yield folder
        return
    ckpt = AtomicCheckpoint(folder)
    with tempfile.TemporaryDirectory(prefix="ucp-trainer-files-") as local:
        for name in ckpt.extra_files:
            (Path(local) / name).write_bytes(ckpt.extra_file(name))
        yield Path(local)


def last_complete(output_dir: str | os.PathLike) -> Path:
    """The last `checkpoint-N` of `output_dir` (transformers' `get_last_checkpoint`), which must be complete;
    an incomplete one (a save that did not finish) is refused, naming the last complete one."""
    return _last_complete(Path(output_dir), checkpoint_folders(output_dir), missing_files, "save")


def _last_complete(root: Location, folders: list[Folder], incomplete: Callable[[Folder], str | None],
                   writer: str) -> Folder:
    """The last of `folders` (of `root`), which must be complete (`incomplete` says what it lacks), else refused
    in one line naming the last complete one; `writer` is what wrote them."""
    last = folders[-1]
    missing = incomplete(last)
    if missing is None:
        if len(folders) > 1:
            logger.info("%s: using %s, the last of %s", root, last.name, ", ".join(f.name for f in folders))
        return last
    earlier = next((f for f in reversed(folders[:-1]) if incomplete(f) is None), None)
    fix = (f"the last complete one is {earlier.name}: pass resume_from_checkpoint='{earlier}'" if earlier is not None
           else "no earlier checkpoint-N is complete either")
    raise CheckpointNotFoundError(f"{last}: {missing}, so the {writer} that wrote it did not finish; {fix}")


def _trainer_options(trainer) -> dict:
    """The checked `"ucp"` section of the Trainer's DeepSpeed config ({} when there is none)."""
    options = ucp_options(_deepspeed_config(trainer))
    if "save" in options:
        raise ConfigError('"ucp": {"save": ...} is not used under the Trainer, which writes its own checkpoint-N '
                          "folders; ucp resumes from those directly. Remove the key, or save with "
                          "ucp.deepspeed.save(trainer.model_wrapped, DIR) from a callback")
    return options


@contextlib.contextmanager
def _resuming_through_ucp(trainer, folder: Location, options: dict):
    """Within the block, `trainer` restores its engine, scheduler and RNG through ucp (see the module doc)."""
    import transformers.trainer as trainer_module

    from ucp import deepspeed as ucp_deepspeed

    world = trainer.args.world_size
    saved = saved_world_size(folder)
    stock_engine_load = trainer_module.deepspeed_load_checkpoint
    stock_scheduler_load = trainer._load_optimizer_and_scheduler
    stock_rng_load = trainer._load_rng_state

    def load_engine(engine, checkpoint_path, load_module_strict=True):
        ucp_deepspeed.load(engine, folder, **{"strict": load_module_strict, **load_options(options)})

    def load_scheduler(self, checkpoint):
        from accelerate.utils import DeepSpeedSchedulerWrapper

        if isinstance(self.lr_scheduler, DeepSpeedSchedulerWrapper):
            return  # the engine's scheduler, restored with the engine
        if not (Path(checkpoint) / SCHEDULER_FILE).is_file():
            raise CheckpointNotFoundError(
                f"{folder}: the Trainer's own LR scheduler is saved only in checkpoint-N/{SCHEDULER_FILE}, "
                "which a ucp checkpoint does not carry; resume from the checkpoint-N folder, or give the DeepSpeed "
                'config an "optimizer" so that the engine owns the scheduler')
        stock_scheduler_load(checkpoint)

    warned: list[bool] = []

    def load_rng(self, checkpoint):
        if saved == world:
            return stock_rng_load(checkpoint)
        if not warned and self.args.process_index == 0:
            logger.warning("RNG states were saved by %d processes and cannot be mapped to %d; training continues "
                           "with this run's own RNG (dropout and sampling draws differ from the uninterrupted run)",
                           saved, world)
        warned.append(True)

    trainer_module.deepspeed_load_checkpoint = load_engine
    trainer._load_optimizer_and_scheduler = types.MethodType(load_scheduler, trainer)
    trainer._load_rng_state = types.MethodType(load_rng, trainer)
    try:
        yield
    finally:
        trainer_module.deepspeed_load_checkpoint = stock_engine_load
        del trainer._load_optimizer_and_scheduler
        del trainer._load_rng_state


_install_checks()
