"""Ray Train's side of elastic training: where ucp saves inside a run, what it reports, where it resumes.

Inside `ray.train.torch.TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=(MIN, MAX)), ...)`:

    config["ucp"] = ucp.elastic.ray_train.ucp_section(every=1, keep=3)   # resume from Ray's checkpoint, or start
    engine, *_ = ucp.deepspeed.initialize(model=..., config=config)
    for batch in loader:
        ...; engine.step()
        ucp.elastic.ray_train.report(engine, {"loss": loss})          # every rank, after each optimizer step

Ray Train's conventions, followed: checkpoints live under the run's storage (`<storage_path>/<name>/ucp/`),
each committed ucp checkpoint is reported to Ray with `ray.train.report(..., checkpoint=...)` from rank 0 (the
folder is already in place, so Ray registers it without copying: `CheckpointUploadMode.NO_UPLOAD`), and a
restarted worker group resumes from the save folder of the checkpoint `ray.train.get_checkpoint()` hands back,
through `"load": "auto"` (which also falls back past a damaged one, and may find one committed after Ray's).
Leave Ray's own `CheckpointConfig(num_to_keep=...)` unset: `"keep"` removes old checkpoints, never the newest.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray.train
import torch.distributed as dist
from ray.train import Checkpoint, CheckpointUploadMode

from ucp.format.folder import latest_checkpoint

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

SAVE_FOLDER = "ucp"


def save_dir() -> str:
    """Where ucp saves in this run: the save folder of Ray's last reported checkpoint, else `<run>/ucp`."""
    handed = ray.train.get_checkpoint()
    if handed is not None:
        return str(Path(handed.path).parent)
    return os.path.join(ray.train.get_context().get_storage().experiment_fs_path, SAVE_FOLDER)


def ucp_section(every: int = 1, keep: int | None = 3, **options: Any) -> dict[str, Any]:
    """The `"ucp"` config section of a Ray Train worker: resume or start (`"auto"`) in `save_dir()`, save every
    `every` optimizer steps and keep the newest `keep`; `options` are further `"ucp"` keys (`"elastic"`, ...)."""
    save: dict[str, Any] = {"dir": save_dir(), "every": every}
    if keep is not None:
        save["keep"] = keep
    return {"load": "auto", "save": save, **options}


def report(engine: DeepSpeedEngine, metrics: dict[str, Any]) -> None:
    """`ray.train.report(metrics)` on every rank, with the newest committed ucp checkpoint from rank 0 when it
    has not been reported yet. Call it on every rank at the same points (after each optimizer step)."""
    checkpoint = None
    if dist.get_rank() == 0:
        folder = latest_checkpoint(engine.ucp_save_dir) if getattr(engine, "ucp_save_dir", None) else None
        if folder is not None and str(folder) != getattr(engine, "_ucp_reported", None):
            checkpoint = Checkpoint.from_directory(str(folder))
            engine._ucp_reported = str(folder)
    ray.train.report(metrics, checkpoint=checkpoint, checkpoint_upload_mode=CheckpointUploadMode.NO_UPLOAD)
