"""`ucp.lightning.fabric.DeepSpeedStrategy`: Fabric's `DeepSpeedStrategy` whose `fabric.load` reads a checkpoint saved
at any world size or ZeRO stage.

    fabric = L.Fabric(strategy=ucp.lightning.fabric.DeepSpeedStrategy(stage=3), ...)   # Fabric's arguments
    remainder = fabric.load("ckpt/step-8", {"model": model, "optimizer": optimizer, "step": 0})

Fabric itself runs `load`: only the engine's `load_checkpoint` is replaced, for that call, by `ucp.deepspeed.load`
of the folder (resharded for this run's layout: weights, fp32 masters, moments, step), and the rest of the state
Fabric saved beside it (the user's keys) comes back as Fabric returns it. Saves commit as
`ucp.lightning.DeepSpeedStrategy`'s do (`ucp.lightning.folders`), and it runs on CPU the same way.
"""
from __future__ import annotations

import os
import shutil
from typing import Any

import torch
from lightning.fabric.accelerators import CPUAccelerator
from lightning.fabric.strategies import DDPStrategy
from lightning.fabric.strategies import DeepSpeedStrategy as FabricDeepSpeedStrategy

from ucp.lightning import folders


class DeepSpeedStrategy(FabricDeepSpeedStrategy):
    """Fabric's `DeepSpeedStrategy` (the same arguments) whose `load` takes a checkpoint of any world size or stage."""

    def setup_environment(self) -> None:
        if isinstance(self.accelerator, CPUAccelerator):
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices or []))]
            DDPStrategy.setup_environment(self)  # Fabric's own stops here on anything but CUDA
            return
        super().setup_environment()

    def save_checkpoint(self, path: Any, state: dict[str, Any], storage_options: Any | None = None,
                        filter: Any | None = None) -> None:
        path = self.broadcast(os.fspath(path))
        written = folders.partial_path(path)
        if self.is_global_zero and written.exists():
            shutil.rmtree(written)  # an earlier save of this name cut short
        self.barrier()
        super().save_checkpoint(written, state, storage_options=storage_options, filter=filter)
        self.barrier()
        if self.is_global_zero:
            folders.commit(path)
        self.barrier()

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        from deepspeed import DeepSpeedEngine

        from ucp.deepspeed import load

        if not isinstance(state, dict) or (self.load_full_weights and self.zero_stage_3):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        engines = [v for v in state.values() if isinstance(v, DeepSpeedEngine)]
        folder = folders.deepspeed_folder(path)

        def ucp_load_checkpoint(load_dir: Any, tag: Any = None, load_optimizer_states: bool = True,
                                load_module_strict: bool = True, **_: Any) -> tuple[str, dict[str, Any]]:
            client = load(engines[0], folder, load_optimizer_states=load_optimizer_states,
                          load_lr_scheduler_states=False, strict=load_module_strict)
            return str(folder), folders.lightning_state(folder, list(client))

        for engine in engines[:1]:  # Fabric refuses any other number itself
            engine.load_checkpoint = ucp_load_checkpoint  # an instance attribute: this call only
        try:
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        finally:
            for engine in engines[:1]:
                del engine.load_checkpoint
