"""Launch train_llama_tp.py for resume tests: cached source runs, fresh resume runs.

A source launch trains and saves (``save_after`` steps into the run, then goes on training, so one
run gives both the checkpoint and the uninterrupted losses); it is built once per fingerprint
(script, support/gather.py, runs, TP degree, torch/deepspeed versions) under ``root``, like
``support.parallel.build_family``. A resume launch loads through the ucp hook and runs in a fresh
folder each time, since it exercises ucp's code. Each run writes into ``<folder>/<run name>/``:
``ckpt/`` (save_dir), ``losses.json``, ``ucp_stats.json``, ``state.pt``, ``loaded.pt``, ``error.json``
as it is asked.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from .checkpoints import DONE, SUPPORT_DIR, _fresh, _is_done, _locked
from .launch import run_torchrun
from .parallel import Family

SCRIPT = "train_llama_tp.py"
# The AutoTP sources of the tests: TP=2 x DP=2, every ZeRO stage (one launch; see support.parallel.build_family).
AUTOTP = Family.of("autotp", SCRIPT, 4, {
    "z1-fp32": {"stage": 1},
    "z2-bf16-tied": {"stage": 2, "dtype": "bf16", "tied": True},
    "z1-bf16-tied": {"stage": 1, "dtype": "bf16", "tied": True},
    "z2-fp32-frozen": {"stage": 2, "frozen": ["model.norm.weight"]},
    "z0-fp32": {"stage": 0},
    "z0-bf16-tied": {"stage": 0, "dtype": "bf16", "tied": True},
    "z3-fp32-frozen": {"stage": 3, "frozen": ["model.norm.weight"]},
    "z3-bf16-tied": {"stage": 3, "dtype": "bf16", "tied": True},
})
OUTPUTS = {"save_dir": "ckpt", "losses_out": "losses.json", "ucp_stats_out": "ucp_stats.json",
           "dump_state": "state.pt", "dump_loaded": "loaded.pt", "error_out": "error.json",
           "ucp_save": "ucp"}


def _launch(folder: Path, tp: int, nproc: int, runs: dict[str, dict]) -> None:
    """Train `runs` in one launch; each option named in OUTPUTS and set to True becomes its file in the run's folder."""
    resolved = []
    for name, options in runs.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        resolved.append({**options, **{key: str(folder / name / out) for key, out in OUTPUTS.items()
                                       if options.get(key) is True}})
    run_torchrun(SUPPORT_DIR / SCRIPT, ["--tp", str(tp), "--runs", json.dumps(resolved)], nproc,
                 folder / "train.log", timeout=900)


def build_sources(label: str, tp: int, nproc: int, runs: dict[str, dict], root: Path) -> Path:
    """Train and save `runs` once (idempotent through a done-marker); the folder holding one folder per run."""
    fingerprint = Family.of(label, SCRIPT, nproc, {**runs, "tp": {"degree": tp}}).fingerprint()
    folder = Path(root) / f"{label}-{fingerprint}"
    with _locked(folder):
        if not _is_done(folder):
            _fresh(folder)
            _launch(folder, tp, nproc, runs)
            (folder / DONE).touch()
    return folder


def resume(label: str, tp: int, nproc: int, runs: dict[str, dict], root: Path) -> Path:
    """Run `runs` (which load through ucp) in a fresh folder; that folder."""
    (Path(root) / "runs").mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=Path(root) / "runs"))
    _launch(folder, tp, nproc, runs)
    return folder


def losses(run_dir: Path) -> list[float]:
    return json.loads((Path(run_dir) / "losses.json").read_text())


def load_stats(run_dir: Path) -> list[dict]:
    """Every rank's ucp load statistics, by rank, each with its tp_rank and dp_rank."""
    return json.loads((Path(run_dir) / "ucp_stats.json").read_text())


def lists_only_copy(save_dir: Path, dest: Path) -> Path:
    """A copy of AutoTP checkpoint `save_dir` whose `universal_checkpoint_info` keeps only its pattern lists (no
    `affine_map`), as DeepSpeed versions without affine maps write it; the copy's save_dir."""
    shutil.copytree(save_dir, dest)
    for path in dest.glob("*/*model_states.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        if isinstance(state.get("universal_checkpoint_info"), dict):
            state["universal_checkpoint_info"].pop("affine_map", None)
            torch.save(state, path)
    return dest
