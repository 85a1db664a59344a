"""SIGKILL at random moments of `ucp convert`, `ucp export` and a training job's asynchronous saves.
The moments are drawn from a seeded generator over the length of a clean run, so every run of the suite
tries the same spread of them; an export's moments are stratified (one in each equal slice of the run), so
fewer kills still reach from start-up to past the commit. Whatever the moment: no process is left behind,
nothing half-written looks complete, and what is committed is whole (an export equal to a clean one; a
`latest` that verifies and loads).
"""
from __future__ import annotations

import random
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

import ucp
from support.checkpoints import TinySpec, read_tag, start_ucp_save_run, ucp_resume, uninterrupted_losses
from support.parallel import build_family
from support.processes import gone, ucp_command, wait_for
from test_export import HF
from ucp.errors import IncompleteCheckpointError
from ucp.format.folder import INDEX_NAME

pytestmark = pytest.mark.slow

CONVERT_KILLS = 6
EXPORT_KILLS = 4
SAVE_KILLS = 3


@pytest.fixture(scope="module")
def llama_ckpt(ckpt_root) -> Path:
    return build_family(HF, ckpt_root) / "llama-z2" / "ckpt"


def export_command(source: Path, out: Path, to: str) -> list[str]:
    return ucp_command("export", "--input", str(source), "--output", str(out), "--to", to, "--quiet")


def tensors_of(folder: Path, to: str) -> dict[str, torch.Tensor]:
    """What an export holds: the safetensors tensors (hf), or every tensor of the DCP checkpoint."""
    if to == "hf":
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = folder.parent / f"{folder.name}.pt"
    dcp_to_torch_save(folder, whole)
    try:
        return flatten(torch.load(whole, weights_only=False))
    finally:
        whole.unlink()


def flatten(state, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        elif torch.is_tensor(value):
            out[f"{prefix}{key}"] = value
    return out


def kill_tree(proc: subprocess.Popen) -> list[int]:
    """SIGKILL `proc` and all its descendants at once, as a node failure would; returns their pids."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    for p in family:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    return [p.pid for p in family]


def stratified(rng: random.Random, i: int, n: int, low: float, high: float) -> float:
    """A moment drawn from the i-th of n equal slices of [low, high]: n kills cover the whole range."""
    width = (high - low) / n
    return rng.uniform(low + i * width, low + (i + 1) * width)


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_conversion_killed_at_any_moment_resumes_byte_equal(tiny_checkpoint, tmp_path):
    source = tiny_checkpoint(TinySpec(stage=2))

    def convert(out: Path, *extra: str) -> list[str]:
        return ucp_command("convert", "--input", str(source), "--output", str(out), "--workers", "2", "--quiet", *extra)

    clean = tmp_path / "clean"
    start = time.monotonic()
    subprocess.run(convert(clean), check=True)
    length = time.monotonic() - start
    reference = files_of(clean)
    rng = random.Random("convert")
    for i in range(CONVERT_KILLS):
        out = tmp_path / f"out{i}"
        proc = subprocess.Popen(convert(out))
        time.sleep(rng.uniform(0.2, length * 1.2))
        pids = kill_tree(proc)  # the driver and its pool workers at once
        wait_for(lambda: all(gone(pid) for pid in pids), timeout=30, what="every process of the conversion to end")
        if not (out / INDEX_NAME).exists():  # not committed: --resume finishes it
            subprocess.run(convert(out, "--resume"), check=True)
        assert files_of(out) == reference  # committed or resumed: byte for byte a clean run's


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("to", ["hf", "dcp"])
def test_an_export_killed_at_any_moment_leaves_nothing_that_looks_complete(llama_ckpt, to, tmp_path):
    clean = tmp_path / "clean"
    start = time.monotonic()
    subprocess.run(export_command(llama_ckpt, clean, to), check=True)
    length = time.monotonic() - start
    reference = tensors_of(clean, to)
    rng = random.Random(f"export-{to}")
    for i in range(EXPORT_KILLS):
        out = tmp_path / f"out{i}"
        proc = subprocess.Popen(export_command(llama_ckpt, out, to))
        time.sleep(stratified(rng, i, EXPORT_KILLS, 0.2, length * 1.2))  # from start-up to past a clean run's end
        pids = kill_tree(proc)
        wait_for(lambda: all(gone(pid) for pid in pids), timeout=30, what="every process of the export to end")
        if out.is_dir() and any(out.iterdir()):  # committed before the kill: whole, equal to the clean export
            got = tensors_of(out, to)
            assert got.keys() == reference.keys()
            assert all(torch.equal(got[k], reference[k]) for k in reference)
        else:  # not committed: at most an empty folder under the output's name, which no loader takes
            # for a checkpoint; exporting again to the same output works
            subprocess.run(export_command(llama_ckpt, out, to), check=True)
            got = tensors_of(out, to)
            assert all(torch.equal(got[k], reference[k]) for k in reference)
        assert not (tmp_path / f".out{i}.partial").exists()  # the next export removed a killed one's files


def test_a_training_job_killed_at_any_moment_of_its_saves_keeps_a_whole_latest(ckpt_root, tmp_path):
    spec = TinySpec(stage=1, steps=0)
    rng = random.Random("async-save")
    save_dir = None
    for i in range(SAVE_KILLS):
        hold = tmp_path / f"hold{i}"
        hold.mkdir()
        proc, run_dir = start_ucp_save_run(spec, 40, 1, ckpt_root, hold)
        save_dir = run_dir / "ucp"
        try:
            wait_for(lambda: (save_dir / "latest").is_file() or proc.poll() is not None, timeout=240,
                     what="the first committed save")
            assert proc.poll() is None, (run_dir / "train.log").read_text()[-2000:]
            time.sleep(rng.uniform(0.0, 3.0))  # saves are in flight at every step from here on
        finally:
            pids = kill_tree(proc)
        wait_for(lambda: all(gone(pid) for pid in pids), timeout=30, what="every rank of the job to end")
        latest = read_tag(save_dir)
        assert ucp.open_checkpoint(save_dir / latest).verify() == []
        for tag in (p for p in save_dir.iterdir() if p.is_dir() and p.name != latest):
            if (tag / INDEX_NAME).exists():  # committed before `latest` moved to a later one
                assert ucp.open_checkpoint(tag).verify() == []
            else:
                with pytest.raises(IncompleteCheckpointError):
                    ucp.open_checkpoint(tag)
    # The last job's latest resumes on another world size, with the losses of a job never killed.
    step = int(read_tag(save_dir).removeprefix("global_step"))
    resumed = ucp_resume(save_dir, TinySpec(stage=2, world_size=1), 2, step, ckpt_root)
    straight = uninterrupted_losses(spec, step + 2, ckpt_root)
    assert resumed.losses == pytest.approx(straight[step:step + 2], rel=1e-6)
