"""Build the 3D-parallel and MoE checkpoints of the tests: one torchrun launch per family.

Each family script (train_pipe.py, train_llama_tp.py, train_moe.py) trains several configurations
one after another in one launch (``--runs``, see support/multi_run.py), which saves most of the
start-up cost (importing deepspeed and transformers, building process groups) on a small machine.
Layout::

    root/<family>-<fingerprint>/<run>/ckpt/       save_dir (``latest``, ``<tag>/...``)
    root/<family>-<fingerprint>/<run>/state.pt    every rank's gathered fp32 state (support/gather.py)
    root/<family>-<fingerprint>/train.log         torchrun output of all ranks and runs
    root/<family>-<fingerprint>/<run>/ds_universal/<tag>/   ds_to_universal output, when asked for

The fingerprint covers the script, support/gather.py and support/multi_run.py, the runs and the
torch/deepspeed versions, so a persistent ``UCP_TEST_CACHE`` never serves a stale checkpoint.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .checkpoints import DONE, SUPPORT_DIR, _fresh, _is_done, _locked, read_tag, run_ds_to_universal
from .launch import run_torchrun


@dataclass(frozen=True)
class Family:
    """A training script, its world size, and its runs (name -> options the script reads)."""

    name: str
    script: str
    nproc: int
    runs: tuple[tuple[str, tuple[tuple[str, object], ...]], ...]
    steps: int = 2

    @staticmethod
    def of(name: str, script: str, nproc: int, runs: dict[str, dict], steps: int = 2) -> "Family":
        return Family(name, script, nproc, tuple((k, tuple(sorted(v.items()))) for k, v in runs.items()), steps)

    def fingerprint(self) -> str:
        h = hashlib.sha256((SUPPORT_DIR / self.script).read_bytes())
        for helper in ("gather.py", "multi_run.py"):
            h.update((SUPPORT_DIR / helper).read_bytes())
        h.update(repr((self.nproc, self.runs, self.steps)).encode())
        h.update(f"{torch.__version__} {importlib.metadata.version('deepspeed')}".encode())
        return h.hexdigest()[:10]


# The pipeline and MoE sources the tests share (test_convert_pipe, test_convert_moe, test_format_deepspeed).
PIPE = Family.of("pipe", "train_pipe.py", 2, {
    "z1-fp32": {"stage": 1},
    "z1-bf16-topology": {"stage": 1, "dtype": "bf16", "topology": True},
    "z0-bf16": {"stage": 0, "dtype": "bf16"},  # the bf16 optimizer without ZeRO: no param_shapes recorded
    "z0-fp32": {"stage": 0},  # optimizer state by position only: named with --param-names
})
MOE = Family.of("moe", "train_moe.py", 2, {
    "ep1-z1": {"ep_size": 1, "stage": 1},
    "ep2-z2": {"ep_size": 2, "stage": 2},
    "ep2-z1-bf16": {"ep_size": 2, "stage": 1, "dtype": "bf16"},
    "ep1-z0": {"ep_size": 1, "stage": 0},
    "ep2-z0": {"ep_size": 2, "stage": 0},
    "ep2-z0-bf16": {"ep_size": 2, "stage": 0, "dtype": "bf16"},
})


def build_family(family: Family, root: Path, timeout: int = 900) -> Path:
    """Train every run of `family` in one launch (once; idempotent through a done-marker); the folder."""
    folder = Path(root) / f"{family.name}-{family.fingerprint()}"
    with _locked(folder):
        if not _is_done(folder):
            _fresh(folder)
            runs = [{**dict(options), "save_dir": str(folder / name / "ckpt"), "dump_state": str(folder / name /
                                                                                                  "state.pt")}
                    for name, options in family.runs]
            for name, _ in family.runs:
                (folder / name).mkdir()
            run_torchrun(SUPPORT_DIR / family.script, ["--runs", json.dumps(runs), "--steps", str(family.steps)],
                         family.nproc, folder / "train.log", timeout=timeout)
            for name, _ in family.runs:
                if not (folder / name / "ckpt" / "latest").is_file():
                    raise RuntimeError(f"{folder / name}/ckpt/latest was not written; see {folder / 'train.log'}")
            (folder / DONE).touch()
    return folder


def reference_state(run_dir: Path) -> dict:
    """``{"ranks": [per-rank dict from the script], "global_steps": int}`` saved by the run."""
    return torch.load(Path(run_dir) / "state.pt", map_location="cpu", weights_only=False)


def ds_universal_of(run_dir: Path) -> Path:
    """ds_to_universal's output for the run's checkpoint (built once)."""
    save_dir = Path(run_dir) / "ckpt"
    tag = read_tag(save_dir)
    return run_ds_to_universal(save_dir / tag, Path(run_dir) / "ds_universal" / tag)


def compare_with_ds_universal(ckpt, reference: dict[str, dict[str, torch.Tensor]]) -> int:
    """Assert that every state in `reference` (ds_to_universal's output, `load_ds_universal`) equals ucp's, cast to
    fp32 and reshaped as ds_to_universal writes it; returns how many states were compared."""
    compared = 0
    for name, states in reference.items():
        for state, expected in states.items():
            got = ckpt.tensor(name, state)
            assert torch.equal(got, expected.float().reshape(got.shape)), (name, state)
            compared += 1
    return compared


def trainable_count(ckpt) -> int:
    """How many trainable parameters the checkpoint holds."""
    return sum(1 for n in ckpt.names if ckpt.info(n).kind == "param")
