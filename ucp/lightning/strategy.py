"""`ucp.lightning.DeepSpeedStrategy`: Lightning's `DeepSpeedStrategy` that resumes at any world size and ZeRO stage.

    trainer = L.Trainer(strategy=ucp.lightning.DeepSpeedStrategy(stage=3), ...)   # every argument Lightning's takes
    trainer.fit(model, ckpt_path="auto")          # or a <name>.ckpt folder saved at another size or stage, or "last"

What differs from Lightning's own strategy:

* Resume: `load_checkpoint` reads DeepSpeed's files in the `<name>.ckpt/` folder with `ucp.deepspeed.load`,
  resharded on the fly for this run's world size and ZeRO stage (weights, fp32 masters, Adam moments and step),
  instead of `engine.load_checkpoint`, which refuses another data-parallel size. The client state DeepSpeed saved
  beside them is Lightning's (loops: epoch, global step, batches seen; LR schedulers; callbacks' states), returned to
  Lightning as its own strategy returns it.
* `ckpt_path="auto"`: the newest complete checkpoint folder of the Trainer's `ModelCheckpoint` directories, or a
  fresh start when there is none, the same line for the first start and every restart (`ucp.lightning.folders`;
  Lightning's `"last"` resolves as Lightning resolves it, then loads at any size).
* Saves commit: DeepSpeed writes `<name>.ckpt.ucp-partial/`, renamed to `<name>.ckpt` by rank 0 once every rank
  has written, so a save cut short never damages the checkpoint it would replace (`last.ckpt`).
* A checkpoint saved in the middle of an epoch resumes after the batches that epoch trained, where Lightning's own
  would start the epoch's DataLoader over (`ucp.lightning.data_order`, which also says how the global batch stays
  fixed at any world size).
* CPU: with Lightning's CPU accelerator it runs on DeepSpeed's CPU accelerator over gloo (Lightning's own refuses
  anything but CUDA); each process's device is `cpu:<local rank>`, whose index DeepSpeed takes as its device rank.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies import DeepSpeedStrategy as LightningDeepSpeedStrategy

from ucp.errors import ConfigError
from ucp.lightning import folders
from ucp.lightning.data_order import skip_done_batches

logger = logging.getLogger("ucp.lightning")
AUTO = "auto"
STAGES = (0, 1, 2, 3)


class DeepSpeedStrategy(LightningDeepSpeedStrategy):
    """Lightning's `DeepSpeedStrategy` (the same arguments) whose `trainer.fit(ckpt_path=...)` resumes a checkpoint
    saved at any world size or ZeRO stage, takes `ckpt_path="auto"`, commits its saves and runs on CPU (module
    docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        stage = (self.config or {}).get("zero_optimization", {}).get("stage", 0)
        if stage not in STAGES:
            raise ConfigError(f"DeepSpeedStrategy(stage={stage!r}): DeepSpeed's ZeRO stages are 0, 1, 2 and 3; "
                              "pass one of them (the checkpoint may have been saved at any of them)")

    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices or []))]
            DDPStrategy.setup_environment(self)  # Lightning's own stops here on anything but CUDA
            return
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        filepath = self.broadcast(os.fspath(filepath))
        written = folders.partial_path(filepath)
        if self.is_global_zero and written.exists():
            import shutil

            shutil.rmtree(written)  # an earlier save of this name cut short
        self.barrier("ucp_lightning_save_begin")
        super().save_checkpoint(checkpoint, written, storage_options)
        self.barrier("ucp_lightning_save_written")
        if self.is_global_zero:
            folders.commit(filepath)
        self.barrier("ucp_lightning_save_committed")

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        _resolve_auto(trainer, self)

    def on_train_start(self) -> None:
        super().on_train_start()
        module = self.lightning_module
        if module is not None and module.trainer is not None:
            skipped = skip_done_batches(module.trainer)
            if skipped and self.is_global_zero:
                logger.warning("ucp: the resumed epoch continues after its %d trained batches on each of %d processes",
                               skipped, self.world_size)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        if self.load_full_weights and self.zero_stage_3:
            return super().load_checkpoint(checkpoint_path, weights_only)
        from lightning.pytorch.trainer.states import TrainerFn

        from ucp.deepspeed import load

        path = folders.deepspeed_folder(checkpoint_path)
        module = self.lightning_module
        assert module is not None  # the Trainer loads after setup
        fitting = module.trainer.state.fn == TrainerFn.FITTING
        client = load(self.deepspeed_engine, path, load_optimizer_states=fitting, load_lr_scheduler_states=False,
                      strict=module.strict_loading)
        # ucp reads the client state as plain data (no pickle code runs); Lightning's callbacks and hyper-parameters
        # need their objects back as saved, which Lightning's own strategy unpickles from the same file
        return folders.lightning_state(path, list(client))

    def auto_folder(self) -> Path | None:
        """Rank 0's newest complete checkpoint folder of the Trainer's ModelCheckpoint directories, on every rank
        (None: start fresh); rank 0 says in one line what the run does."""
        chosen: str | None = None
        if self.is_global_zero:
            dirs = self._checkpoint_dirs()
            folder, passed = folders.newest_complete(dirs)
            for skipped, why in passed:
                logger.warning("ucp: %s is incomplete (%s): %s", skipped, why,
                               f"resuming from {folder.name} instead" if folder else "no complete one")
            for cut in folders.cut_short(dirs):
                logger.warning("ucp: %s is a save cut short: passed over", cut)
            chosen = None if folder is None else str(folder)
            where = ", ".join(map(str, dirs)) or "(no ModelCheckpoint directory)"
            logger.warning("ucp: %s", f"resuming from {chosen} on {self.world_size} processes" if chosen
                           else f"no complete checkpoint in {where}: starting fresh on {self.world_size} processes")
        chosen = self.broadcast(chosen)
        return None if chosen is None else Path(chosen)

    def _checkpoint_dirs(self) -> list[Path]:
        from lightning.pytorch.callbacks import ModelCheckpoint

        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None:
            return []
        dirs = [Path(c.dirpath) for c in trainer.checkpoint_callbacks
                if isinstance(c, ModelCheckpoint) and c.dirpath is not None]
        if not dirs:
            raise ConfigError('trainer.fit(ckpt_path="auto") resumes from the ModelCheckpoint directories: add '
                              "ModelCheckpoint(dirpath=...) to the Trainer's callbacks")
        return list(dict.fromkeys(dirs))


def _resolve_auto(trainer: Any, strategy: DeepSpeedStrategy) -> None:
    """Make this Trainer's checkpoint connector take `ckpt_path="auto"` as `strategy.auto_folder()`, or as no
    checkpoint (a fresh start), before Lightning reads anything: Lightning resolves its own names ("last", "best")
    before the processes start, when no rank can yet agree on a folder."""
    connector = trainer._checkpoint_connector
    stock = type(connector).resume_start

    def resume_start(checkpoint_path: Any = None, weights_only: bool | None = None) -> None:
        if checkpoint_path is not None and os.fspath(checkpoint_path) == AUTO:
            checkpoint_path = strategy.auto_folder()
        stock(connector, checkpoint_path, weights_only)

    connector.resume_start = resume_start
