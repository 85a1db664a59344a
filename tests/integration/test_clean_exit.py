"""Processes end with their exit code every time: `ucp.deepspeed.finish` and the Trainer example (the demo, from
the installed wheel: test_wheel.py)."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from support.launch import run_logged, torchrun_command

SUPPORT = Path(__file__).resolve().parents[1] / "support"
REPO = Path(__file__).resolve().parents[2]


def run_race(tmp_path: Path, *args: str) -> tuple[int, str]:
    cmd, env = torchrun_command(SUPPORT / "exit_race.py", list(args), 2)
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    return proc.returncode, proc.stdout


def test_a_gloo_thread_busy_at_exit_aborts_a_plain_script(tmp_path):
    """Negative control: the race the fix is for really aborts (so the check below can fail)."""
    code, log = run_race(tmp_path)
    assert code != 0 and "SIGABRT" in log, log[-3000:]


def test_finish_exits_zero_with_a_gloo_thread_busy(tmp_path):
    code, log = run_race(tmp_path, "--finish")
    assert code == 0, log[-3000:]
    assert "terminate called" not in log


@pytest.mark.slow
def test_trainer_example_trains_then_resumes_elsewhere(tmp_path):
    """examples/hf_trainer/train.py: 2 processes ZeRO-2, then 1 process ZeRO-3 from the last checkpoint."""
    example = REPO / "examples" / "hf_trainer" / "train.py"
    out = tmp_path / "out"
    log = tmp_path / "example.log"
    for nproc, args in ((2, ["--stage", "2", "--max-steps", "6"]),
                        (1, ["--stage", "3", "--max-steps", "9", "--resume"])):
        cmd, env = torchrun_command(example, [*args, "--output-dir", str(out)], nproc)
        run_logged(cmd, log, timeout=900, env=env, cwd=tmp_path)
    assert (out / "checkpoint-9").is_dir()
    assert "terminate called" not in log.read_text()
