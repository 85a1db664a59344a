"""Launch the Hugging Face Trainer (train_hf.py) and Accelerate (train_accelerate.py) runs of the tests.

A source run trains TOTAL_STEPS steps on 2 processes with ZeRO-2 and saves at SAVE_STEP, so one run
gives both the checkpoint and the uninterrupted losses; it is built once per fingerprint (the
scripts, torch/transformers/deepspeed versions) under ``root``. A resume run loads through ucp and
runs in a fresh folder each time, since it exercises ucp's code::

    root/hf-<model>-<fingerprint>/out/checkpoint-3/    the Trainer's folder (global_step3/, latest, JSON files)
    root/hf-<model>-<fingerprint>/losses.json          {"losses": [...], "first_step", "global_step", "epoch"}
    root/accelerate-<fingerprint>/state/               accelerator.save_state's folder
    root/runs/<label>-XXXX/                            resume runs
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import tempfile
from pathlib import Path

import torch

from .checkpoints import DONE, SUPPORT_DIR, _fresh, _is_done, _locked
from .launch import run_torchrun

SAVE_STEP = 3
TOTAL_STEPS = 5
SOURCE_WORLD = 2
SOURCE_STAGE = 2
SCRIPTS = ("train_hf.py", "train_accelerate.py")


def fingerprint() -> str:
    h = hashlib.sha256()
    for script in SCRIPTS:
        h.update((SUPPORT_DIR / script).read_bytes())
    for package in ("deepspeed", "transformers", "accelerate"):
        h.update(importlib.metadata.version(package).encode())
    h.update(torch.__version__.encode())
    return h.hexdigest()[:10]


def losses(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def trainer_source(model: str, root: Path) -> Path:
    """The folder of a 2-process ZeRO-2 Trainer run of `model` that saved checkpoint-SAVE_STEP (built once)."""
    folder = Path(root) / f"hf-{model}-{fingerprint()}"
    with _locked(folder):
        if not _is_done(folder):
            _fresh(folder)
            run_torchrun(SUPPORT_DIR / "train_hf.py",
                         ["--model", model, "--stage", str(SOURCE_STAGE), "--output-dir", str(folder / "out"),
                          "--max-steps", str(TOTAL_STEPS), "--save-steps", str(SAVE_STEP),
                          "--losses-out", str(folder / "losses.json")], SOURCE_WORLD, folder / "train.log")
            (folder / DONE).touch()
    return folder


def trainer_resume(model: str, resume: str | Path, world: int, stage: int, root: Path,
                   output_dir: Path | None = None, ucp_options: dict | None = None,
                   check: bool = True, extra: tuple[str, ...] = ()) -> Path:
    """Resume `model` from `resume` through ``ucp.transformers.train`` in a fresh folder; that folder.

    ``resume`` is a path, "last" (the last checkpoint-N of ``output_dir``, i.e. True) or "output-dir"
    (``output_dir`` itself). With ``check=False`` a failing run is not an error: the caller reads
    ``train.log``. ``extra`` goes to train_hf.py as it is.
    """
    folder = _fresh_run(f"hf-{model}-w{world}-z{stage}", root)
    args = ["--model", model, "--stage", str(stage), "--output-dir", str(output_dir or folder / "out"),
            "--max-steps", str(TOTAL_STEPS), "--resume", str(resume), "--losses-out", str(folder / "losses.json"),
            *extra]
    if ucp_options is not None:
        args += ["--ucp-options", json.dumps(ucp_options)]
    _run(SUPPORT_DIR / "train_hf.py", args, world, folder, check)
    return folder


def accelerate_source(root: Path) -> Path:
    """A 2-process ZeRO-2 Accelerate run that saved its state at SAVE_STEP (built once)."""
    folder = Path(root) / f"accelerate-{fingerprint()}"
    with _locked(folder):
        if not _is_done(folder):
            _fresh(folder)
            run_torchrun(SUPPORT_DIR / "train_accelerate.py",
                         ["--stage", str(SOURCE_STAGE), "--steps", str(TOTAL_STEPS), "--save-at", str(SAVE_STEP),
                          "--save-dir", str(folder / "state"), "--losses-out", str(folder / "losses.json")],
                         SOURCE_WORLD, folder / "train.log")
            (folder / DONE).touch()
    return folder


def accelerate_resume(state: Path, world: int, stage: int, root: Path, checkpoint: Path | str | None = None,
                      check: bool = True, save_dir: Path | None = None) -> Path:
    """Resume from Accelerate's `state` folder through ``ucp.accelerate.load_state``; the run's folder.
    With ``check=False`` a failing run is not an error: the caller reads ``train.log``. With ``save_dir``
    the run saves its state there after its last step."""
    folder = _fresh_run(f"accelerate-w{world}-z{stage}", root)
    args = ["--stage", str(stage), "--steps", str(TOTAL_STEPS), "--load", str(state),
            "--losses-out", str(folder / "losses.json")]
    if checkpoint is not None:
        args += ["--checkpoint", str(checkpoint)]
    if save_dir is not None:
        args += ["--save-at", str(TOTAL_STEPS), "--save-dir", str(save_dir)]
    _run(SUPPORT_DIR / "train_accelerate.py", args, world, folder, check)
    return folder


def _fresh_run(label: str, root: Path) -> Path:
    (Path(root) / "runs").mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{label}-", dir=Path(root) / "runs"))


def _run(script: Path, args: list[str], world: int, folder: Path, check: bool) -> None:
    try:
        run_torchrun(script, args, world, folder / "train.log")
    except RuntimeError:
        if check:
            raise
