"""Resume runs of the pipeline and MoE models (resume_pipe.py, resume_moe.py) at any layout.

A source run trains ``steps`` steps at layout A, saving with DeepSpeed after ``save_at`` of them, so
its losses after that point are those of the uninterrupted run at A over the same global batches.
Source runs are cached under ``root/resume3d-<fingerprint>/<name>/`` (``ckpt/``, ``losses.json``,
``train.log``) like the other checkpoint builders; resume runs get a fresh folder under
``root/runs/``.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoints import DONE, SUPPORT_DIR, _fresh, _is_done, _locked
from .launch import run_torchrun


@dataclass(frozen=True)
class Layout:
    """One launch of a resume script: its processes and the script's layout flags."""

    script: str           # resume_pipe.py or resume_moe.py
    nproc: int
    flags: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{Path(self.script).stem}-n{self.nproc}" + "".join(self.flags).replace("--", "-")


def _fingerprint(layout: Layout) -> str:
    h = hashlib.sha256()
    for name in (layout.script, layout.script.replace("resume_", "train_"), "gather.py", "resume_common.py"):
        h.update((SUPPORT_DIR / name).read_bytes())
    h.update(f"{torch.__version__} {importlib.metadata.version('deepspeed')}".encode())
    return h.hexdigest()[:10]


@dataclass(frozen=True)
class SourceRun:
    save_dir: Path        # DeepSpeed save_dir (``latest`` names the tag saved after save_at steps)
    losses: list[float]   # every step's loss, the saved steps included


def source_run(layout: Layout, steps: int, save_at: int, root: Path) -> SourceRun:
    folder = Path(root) / f"resume3d-{_fingerprint(layout)}" / f"{layout.name}-s{save_at}of{steps}"
    with _locked(folder):
        if not _is_done(folder):
            _fresh(folder)
            run_torchrun(SUPPORT_DIR / layout.script,
                         [*layout.flags, "--steps", steps, "--save-at", save_at, "--save-dir", folder / "ckpt",
                          "--losses-out", folder / "losses.json"], layout.nproc, folder / "train.log")
            (folder / DONE).touch()
    return SourceRun(folder / "ckpt", json.loads((folder / "losses.json").read_text()))


def resume_run(layout: Layout, args: list, root: Path) -> Path:
    """Launch ``layout`` with ``args`` (which name their outputs in the returned fresh folder)."""
    runs = Path(root) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"{layout.name}-", dir=runs))
    run_torchrun(SUPPORT_DIR / layout.script, [*layout.flags, *[str(a).format(run=run_dir) for a in args]],
                 layout.nproc, run_dir / "train.log")
    return run_dir
