"""Build real DeepSpeed checkpoints (tiny model, CPU, torchrun) and run DeepSpeed's reference tools.

Directory layout under ``root`` (one folder per run, named from the spec)::

    root/<spec.name>/ckpt/                 save_dir of build_checkpoint (``latest``, ``<tag>/...``)
    root/<spec.name>/losses.json           per-step global losses of the run that saved it
    root/<spec.name>/state.pt              gathered reference state at save time (see trained_state)
    root/<spec.name>/train.log             torchrun output of all ranks
    root/<spec.name>/ds_universal/<tag>/   ds_to_universal output (ds_universal fixture), with
    root/<spec.name>/ds_universal/latest_universal
    root/uninterrupted/<name>/             uninterrupted_losses runs
    root/runs/<name>-XXXX/                 resume runs (fresh folder per call)
    root/runs/ucp-save-<name>-XXXX/ucp/    asynchronous ucp saves (ucp_save_run): latest, global_step<N>/

Every builder is idempotent: a ``.done`` marker is written last, a folder without it is wiped and
rebuilt, and an ``flock`` serialises builders of the same folder across processes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .launch import ds_env, run_logged, run_torchrun, start_torchrun

SUPPORT_DIR = Path(__file__).resolve().parent
TRAIN_SCRIPT = SUPPORT_DIR / "train_tiny.py"
DONE = ".done"

# Facts about the tiny model in train_tiny.py, for tests.
TRAINABLE_PARAM_SHAPES: dict[str, tuple[int, ...]] = {
    "emb.weight": (13, 7),
    "l1.weight": (9, 7),
    "l1.bias": (9, ),
    "l2.weight": (5, 9),
    "l2.bias": (5, ),
    "head.weight": (13, 5),
    "head.bias": (13, ),
    "gain": (5, ),
}
FROZEN_PARAM_SHAPES: dict[str, tuple[int, ...]] = {"proj.weight": (5, 5)}
BUFFER_SHAPES: dict[str, tuple[int, ...]] = {"pos_scale": (4, )}
# Optimizer param groups, in order, as given to DeepSpeed (names in group order).
PARAM_GROUPS: list[dict] = [
    {"names": ["emb.weight", "l1.weight", "l2.weight", "head.weight", "gain"], "weight_decay": 0.1},
    {"names": ["l1.bias", "l2.bias", "head.bias"], "weight_decay": 0.0},
]
GLOBAL_BATCH = 6


def deepspeed_dir() -> Path:
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("deepspeed is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def ds_to_universal_script() -> Path:
    return deepspeed_dir() / "checkpoint" / "ds_to_universal.py"


@dataclass(frozen=True)
class TinySpec:
    """One tiny training run: ZeRO stage, precision, DP degree, optimizer, steps before saving."""

    stage: int
    dtype: str = "fp32"
    world_size: int = 2
    optimizer: str = "AdamW"
    steps: int = 3
    uc_info: bool = False  # model declares universal_checkpoint_info (Megatron-DeepSpeed style)
    # "tied": head.weight is emb.weight; "untied": the same shapes, head.weight its own (train_tiny --tie)
    tie: str = ""

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage must be 0..3, got {self.stage}")
        if self.dtype not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"dtype must be fp32/bf16/fp16, got {self.dtype!r}")
        if self.optimizer not in ("Adam", "AdamW"):
            raise ValueError(f"optimizer must be Adam/AdamW, got {self.optimizer!r}")
        if self.world_size < 1 or GLOBAL_BATCH % self.world_size:
            raise ValueError(f"world_size must divide {GLOBAL_BATCH}, got {self.world_size}")
        if self.steps < 0:
            raise ValueError(f"steps must be >= 0, got {self.steps}")
        if self.tie not in ("", "tied", "untied"):
            raise ValueError(f"tie must be '', 'tied' or 'untied', got {self.tie!r}")

    @property
    def name(self) -> str:
        s = f"z{self.stage}-{self.dtype}-dp{self.world_size}-{self.optimizer.lower()}-s{self.steps}"
        return s + ("-ucinfo" if self.uc_info else "") + (f"-{self.tie}" if self.tie else "")

    def train_args(self) -> list[str]:
        args = ["--stage", str(self.stage), "--dtype", self.dtype, "--optimizer", self.optimizer]
        return args + (["--uc-info"] if self.uc_info else []) + (["--tie", self.tie] if self.tie else [])


@dataclass(frozen=True)
class RunResult:
    run_dir: Path
    losses: list[float]
    save_dir: Path | None  # None when the run did not save
    state_path: Path | None  # gathered state (train_tiny --dump-state), None when not requested


# ----------------------------------------------------------------------------------------------
# helpers


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock_path = folder.parent / f".{folder.name}.lock"
    with open(lock_path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _is_done(folder: Path) -> bool:
    return (folder / DONE).is_file()


def _fresh(folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def _read_losses(path: Path) -> list[float]:
    with open(path) as f:
        return [float(x) for x in json.load(f)]


def read_tag(save_dir: Path) -> str:
    """The tag named in ``<save_dir>/latest``."""
    return (Path(save_dir) / "latest").read_text().strip()


def tag_dir(save_dir: Path) -> Path:
    """``<save_dir>/<tag from latest>``."""
    return Path(save_dir) / read_tag(save_dir)


def source_fingerprint() -> str:
    """Hash of the training script + torch/deepspeed versions (keys persistent caches)."""
    h = hashlib.sha256(TRAIN_SCRIPT.read_bytes())
    h.update(torch.__version__.encode())
    try:
        ds_version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        ds_version = "?"
    h.update(ds_version.encode())
    return h.hexdigest()[:12]


# ----------------------------------------------------------------------------------------------
# runs


def run_tiny(spec: TinySpec,
             run_dir: Path,
             *,
             steps: int | None = None,
             save: bool = True,
             load_dir: Path | None = None,
             load_tag: str | None = None,
             load_universal: bool = False,
             start_step: int | None = None,
             dump_state: bool = False,
             extra_args: list[str] | None = None,
             timeout: int = 600) -> RunResult:
    """Run train_tiny.py once under torchrun with ``spec.world_size`` ranks, in ``run_dir``.

    ``steps`` defaults to ``spec.steps``. Not idempotent (callers handle caching).
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    steps = spec.steps if steps is None else steps
    losses_path = run_dir / "losses.json"
    args = spec.train_args() + ["--steps", str(steps), "--losses-out", str(losses_path)]
    save_dir = run_dir / "ckpt" if save else None
    if save:
        args += ["--save-dir", str(save_dir)]
    else:
        args += ["--no-save"]
    if load_dir is not None:
        args += ["--load-dir", str(load_dir)]
        if load_tag is not None:
            args += ["--load-tag", str(load_tag)]
        if load_universal:
            args += ["--load-universal"]
    if start_step is not None:
        args += ["--start-step", str(start_step)]
    state_path = run_dir / "state.pt" if dump_state else None
    if dump_state:
        args += ["--dump-state", str(state_path)]
    args += list(extra_args or [])
    run_torchrun(TRAIN_SCRIPT, args, spec.world_size, run_dir / "train.log", timeout=timeout)
    return RunResult(run_dir=run_dir, losses=_read_losses(losses_path), save_dir=save_dir, state_path=state_path)


def build_checkpoint(spec: TinySpec, root: Path) -> Path:
    """Train ``spec.steps`` steps and save; return the save_dir (``<save_dir>/latest`` names the tag).

    Idempotent: reuses ``root/<spec.name>`` if its done-marker exists. The same run also writes
    ``losses.json`` (see trained_losses) and ``state.pt`` (see trained_state).
    """
    folder = Path(root) / spec.name
    with _locked(folder):
        if not _is_done(folder):
            _fresh(folder)
            run_tiny(spec, folder, save=True, dump_state=True)
            if not (folder / "ckpt" / "latest").is_file():
                raise RuntimeError(f"{folder}/ckpt/latest was not written")
            (folder / DONE).touch()
    return folder / "ckpt"


def trained_losses(spec: TinySpec, root: Path) -> list[float]:
    """Per-step global losses of the run that produced build_checkpoint(spec, root)."""
    build_checkpoint(spec, root)
    return _read_losses(Path(root) / spec.name / "losses.json")


def trained_state(spec: TinySpec, root: Path) -> dict:
    """Reference state gathered by the live engine right before save_checkpoint.

    ``{"params": {name: {"fp32": T, "exp_avg": T, "exp_avg_sq": T}}, "global_steps": int,
    "lrs": [lr per group], "param_groups": [hyperparameters per group]}`` for trainable params
    only; tensors are fp32 CPU, full shape. ZeRO-1/2/3: gathered with deepspeed.utils
    safe_get_full_fp32_param / safe_get_full_optimizer_state; stage 0: the fp32 master copy
    (the param itself for fp32, the FP16(_Unfused)_Optimizer master for fp16/bf16).
    """
    build_checkpoint(spec, root)
    return torch.load(Path(root) / spec.name / "state.pt", map_location="cpu", weights_only=False)


def run_ds_to_universal(tag_dir: Path, out_dir: Path, workers: int = 1, *, inject_missing_state: bool = True) -> Path:
    """Run DeepSpeed's ds_to_universal.py on ``tag_dir`` writing ``out_dir``; return ``out_dir``.

    Passes ``--inject_missing_state`` unless told not to (ZeRO-1/2 checkpoints then need a model
    that declared ``universal_checkpoint_info``, i.e. ``TinySpec(uc_info=True)``).
    ``out_dir.parent/latest_universal`` gets ``out_dir.name`` (so stock DeepSpeed resumes with
    ``load_checkpoint(out_dir.parent, tag=out_dir.name)``).
    Idempotent through ``out_dir/.done``; the log is ``out_dir.parent/<out_dir.name>.log``.
    ``workers == 1`` converts in-process (no process pool).
    """
    tag_dir, out_dir = Path(tag_dir), Path(out_dir)
    with _locked(out_dir):
        if not _is_done(out_dir):
            if out_dir.exists():
                shutil.rmtree(out_dir)
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable, str(ds_to_universal_script()),
                "--input_folder", str(tag_dir),
                "--output_folder", str(out_dir),
                "--num_extract_workers", str(workers),
                "--num_merge_workers", str(workers),
            ] + (["--inject_missing_state"] if inject_missing_state else [])
            log = out_dir.parent / f"{out_dir.name}.log"
            run_logged(cmd, log, timeout=600, env=ds_env())
            if not (out_dir / "zero").is_dir():
                raise RuntimeError(f"ds_to_universal wrote no {out_dir}/zero; see {log}")
            (out_dir / DONE).touch()
    return out_dir


def load_ds_universal(out_dir: Path) -> dict[str, dict[str, torch.Tensor]]:
    """Read a ds_to_universal output folder: ``{param name: {state: tensor}}``.

    For each ``out_dir/zero/<name>/<state>.pt``: a dict is unwrapped to its ``"param"`` tensor
    (ZeRO-1/2: full-shape tensor; ``cat_dim`` etc. are dropped); ``step`` becomes a tensor
    (``torch.as_tensor``). States are those present on disk: trainable params have
    ``fp32, exp_avg, exp_avg_sq, step``; frozen params and buffers (ZeRO-1/2 only) have only
    ``fp32``. ZeRO-3 output is returned as-is: DeepSpeed writes bare FLAT 1-D tensors
    (``numel`` of the param, no padding, no dict, no shape) and no ``step.pt``.
    ``optimizer_state.pt`` is not included.
    """
    zero = Path(out_dir) / "zero"
    if not zero.is_dir():
        raise FileNotFoundError(f"{zero} does not exist")
    result: dict[str, dict[str, torch.Tensor]] = {}
    for pdir in sorted(p for p in zero.iterdir() if p.is_dir()):
        states: dict[str, torch.Tensor] = {}
        for f in sorted(pdir.glob("*.pt")):
            value = torch.load(f, map_location="cpu", weights_only=False)
            if isinstance(value, dict):
                value = value["param"]
            if not torch.is_tensor(value):
                value = torch.as_tensor(value)
            states[f.stem] = value
        result[pdir.name] = states
    return result


def resume_losses(load_dir: Path,
                  tag: str | None,
                  spec_at_resume: TinySpec,
                  steps: int,
                  start_step: int,
                  root: Path,
                  universal: bool = True) -> list[float]:
    """Resume via stock DeepSpeed and train ``steps`` more steps (no save); return their losses.

    ``load_dir``/``tag`` go to ``engine.load_checkpoint``; with ``universal`` the config sets
    ``checkpoint.load_universal``. Runs at ``spec_at_resume``'s stage/dtype/optimizer/world_size;
    the first batch is that of global step ``start_step``. Each call uses a fresh run folder.
    """
    runs = Path(root) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"resume-{spec_at_resume.name}-", dir=runs))
    res = run_tiny(spec_at_resume,
                   run_dir,
                   steps=steps,
                   save=False,
                   load_dir=load_dir,
                   load_tag=tag,
                   load_universal=universal,
                   start_step=start_step)
    return res.losses


def uninterrupted_losses(spec: TinySpec, total_steps: int, root: Path) -> list[float]:
    """Losses of ``total_steps`` steps from scratch at ``spec``'s settings (no save; cached)."""
    spec = dataclasses.replace(spec, steps=total_steps)
    folder = Path(root) / "uninterrupted" / spec.name
    with _locked(folder):
        if not _is_done(folder):
            _fresh(folder)
            run_tiny(spec, folder, save=False)
            (folder / DONE).touch()
    return _read_losses(folder / "losses.json")


def ucp_resume(ucp_dir: Path, spec_at_resume: TinySpec, steps: int, start_step: int, root: Path,
               bypass: bool = True, dump_state: bool = False) -> RunResult:
    """Resume from a ucp atomic checkpoint through ``ucp.deepspeed.initialize`` and train ``steps`` steps.

    The result's run folder holds ``ucp_stats.json`` (per-rank load statistics) and, with
    ``dump_state``, ``state.pt`` (the engine's gathered state after the steps).
    """
    runs = Path(root) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"ucp-resume-{spec_at_resume.name}-", dir=runs))
    extra = ["--ucp-load", str(ucp_dir), "--ucp-stats-out", str(run_dir / "ucp_stats.json")]
    if not bypass:
        extra.append("--ucp-no-bypass")
    return run_tiny(spec_at_resume, run_dir, steps=steps, save=False, start_step=start_step,
                    dump_state=dump_state, extra_args=extra)


def ucp_stats(result: RunResult) -> list[dict]:
    return json.loads((result.run_dir / "ucp_stats.json").read_text())


def ucp_load_errors(ucp_dirs: list[Path], spec: TinySpec, root: Path, check_first: bool = True,
                    check_keep_bytes: int | None = None) -> list[dict]:
    """Load each of ``ucp_dirs`` into one fresh engine expecting ucp errors (``check_first`` and
    ``check_keep_bytes`` as `ucp.deepspeed.load`; None: its default).

    Returns ``[{"path", "error": str | None, "untouched": bool, "errors": [every rank's error],
    "untouched_on": [whether each rank's engine is as before]}]``, one per directory, in order
    (``error`` and ``untouched`` are rank 0's).
    """
    runs = Path(root) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix=f"ucp-error-{spec.name}-", dir=runs))
    out = run_dir / "error.json"
    run_tiny(spec, run_dir, steps=0, save=False,
             extra_args=["--ucp-load", ",".join(str(d) for d in ucp_dirs), "--ucp-expect-error", str(out)]
             + ([] if check_first else ["--ucp-no-check-first"])
             + ([] if check_keep_bytes is None else ["--ucp-check-keep-bytes", str(check_keep_bytes)]))
    return json.loads(out.read_text())


def _ucp_save_args(spec: TinySpec, run_dir: Path, steps: int, every: int) -> list[str]:
    return spec.train_args() + ["--steps", str(steps), "--no-save", "--losses-out", str(run_dir / "losses.json"),
                                "--ucp-save-dir", str(run_dir / "ucp"), "--ucp-save-every", str(every)]


def _ucp_save_dir(spec: TinySpec, root: Path) -> Path:
    runs = Path(root) / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"ucp-save-{spec.name}-", dir=runs))


def ucp_save_run(spec: TinySpec, steps: int, every: int, root: Path) -> RunResult:
    """Train ``steps`` steps from scratch at ``spec``, saving asynchronously with ucp every ``every`` steps.

    The saves go through the config (``"ucp": {"save": {"dir", "every"}}``) into ``result.save_dir``
    (``latest`` and ``global_step<N>/``); the run waits for the last one before it ends.
    """
    run_dir = _ucp_save_dir(spec, root)
    run_torchrun(TRAIN_SCRIPT, _ucp_save_args(spec, run_dir, steps, every), spec.world_size, run_dir / "train.log")
    return RunResult(run_dir=run_dir, losses=_read_losses(run_dir / "losses.json"), save_dir=run_dir / "ucp",
                     state_path=None)


def start_ucp_save_run(spec: TinySpec, steps: int, every: int, root: Path,
                       hold_dir: Path) -> tuple[subprocess.Popen, Path]:
    """Like ``ucp_save_run``, but started in the background, its saves open to faults.

    Files in ``hold_dir`` stall or fail the writers (see ``support.save_faults``).
    Returns the torchrun process and the run folder (``train.log``; saves under ``ucp/``).
    """
    run_dir = _ucp_save_dir(spec, root)
    proc = start_torchrun(TRAIN_SCRIPT, [*_ucp_save_args(spec, run_dir, steps, every), "--ucp-save-faults",
                                         str(hold_dir)], spec.world_size, run_dir / "train.log")
    return proc, run_dir
