"""Faults around `ucp convert`: a killed driver, two converts into one folder, a full disk, a read-only one.

Processes are real `ucp convert` commands; faults are injected with `ucp.convert.driver._hold_for_tests`
(while `$UCP_TEST_HOLD_DIR/<data file>.hold` exists, that file's writer stops after its first tensor
and writes its pid next to the flag).
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

import ucp
from support.checkpoints import TinySpec
from support.processes import gone, ucp_command, wait_for
from ucp.format.folder import INDEX_NAME

SOURCE = TinySpec(stage=2)
BIN0 = "data-00000-of-00002.safetensors"


def tree(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture
def held_convert(tiny_checkpoint, tmp_path):
    """Start `ucp convert --workers 2` with BIN0's writer held; yields (process, writer pid, output, hold flag)."""
    hold = tmp_path / "hold"
    hold.mkdir()
    flag = hold / f"{BIN0}.hold"
    flag.touch()
    out = tmp_path / "out"
    env = {**os.environ, "UCP_TEST_HOLD_DIR": str(hold)}
    proc = subprocess.Popen(ucp_command("convert", "--input", str(tiny_checkpoint(SOURCE)), "--output", str(out),
                                        "--workers", "2", "--quiet"), env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        writer = int(wait_for(lambda: (hold / f"{BIN0}.pid").is_file() and (hold / f"{BIN0}.pid").read_text(),
                              what="the held writer"))
        yield proc, writer, out, flag
    finally:
        flag.unlink(missing_ok=True)
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


def test_sigkill_of_the_driver_leaves_no_orphan_and_resume_is_byte_equal(held_convert, tiny_checkpoint, tmp_path):
    proc, writer, out, flag = held_convert
    assert writer != proc.pid  # the writer is a pool worker, not the driver
    os.kill(proc.pid, signal.SIGKILL)  # the driver alone, as the OOM killer would
    proc.wait()
    wait_for(lambda: gone(writer), timeout=30, what="the pool worker to die with its driver")
    flag.unlink()
    time.sleep(0.5)  # a surviving worker would now go on writing
    assert not (out / INDEX_NAME).exists() and not (out / BIN0).exists()
    resumed = subprocess.run(ucp_command("convert", "--input", str(tiny_checkpoint(SOURCE)), "--output", str(out),
                                         "--workers", "2", "--quiet", "--resume"), capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    clean = tmp_path / "clean"
    assert subprocess.run(ucp_command("convert", "--input", str(tiny_checkpoint(SOURCE)), "--output", str(clean),
                                      "--workers", "2", "--quiet")).returncode == 0
    assert tree(out) == tree(clean)


def test_a_second_convert_into_the_same_folder_is_refused(held_convert, tiny_checkpoint):
    proc, _, out, flag = held_convert
    second = subprocess.run(ucp_command("convert", "--input", str(tiny_checkpoint(SOURCE)), "--output", str(out),
                                        "--quiet"), capture_output=True, text=True)
    assert second.returncode == 2
    assert second.stderr.count("\n") == 1 and "another ucp process is writing into it" in second.stderr
    flag.unlink()
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert ucp.open_checkpoint(out).verify() == []


def test_disk_full_is_one_line_and_leaves_no_checkpoint(small_tmpfs, tiny_checkpoint):
    out = small_tmpfs / "out"
    done = subprocess.run(ucp_command("convert", "--input", str(tiny_checkpoint(SOURCE)), "--output", str(out),
                                      "--workers", "1", "--quiet"), capture_output=True, text=True)
    assert done.returncode == 3, done.stderr
    assert done.stderr.count("\n") == 1 and "No space left on device" in done.stderr and str(out) in done.stderr
    assert not (out / INDEX_NAME).exists()


def test_read_only_output_is_one_line(tiny_checkpoint, tmp_path):
    if os.geteuid() == 0:
        readonly = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=16k", "tmpfs", str(tmp_path)],
                                  capture_output=True)
        if readonly.returncode != 0:
            pytest.skip("cannot mount a read-only tmpfs here")
    else:
        tmp_path.chmod(0o500)
    try:
        done = subprocess.run(ucp_command("convert", "--input", str(tiny_checkpoint(SOURCE)), "--output",
                                          str(tmp_path / "out"), "--quiet"), capture_output=True, text=True)
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(tmp_path)], check=True)
        else:
            tmp_path.chmod(0o700)
    assert done.returncode == 3, done.stderr
    assert done.stderr.count("\n") == 1 and str(tmp_path / "out") in done.stderr


def test_a_full_disk_inside_a_dcp_tensor_write_is_one_line_exit_3(small_tmpfs, tmp_path, capsys):
    """DCP writes each tensor with torch.save, whose writer turns a full disk into a RuntimeError that names no
    errno ("unexpected pos ..."): it was a traceback, where `--to hf` gave one line. A 32 KiB tensor into the
    16 KiB disk fills it inside that write."""
    import torch

    from ucp.cli.main import main
    from ucp.convert.tensors import write_tensors

    ckpt = write_tensors(tmp_path / "ckpt", {"w": {"fp32": torch.arange(8192, dtype=torch.float32)}})
    assert main(["export", "--input", str(ckpt), "--output", str(tmp_path / "roomy"), "--to", "dcp",
                 "--quiet"]) == 0  # negative control: the same export where there is room
    capsys.readouterr()
    out = small_tmpfs / "dcp"
    code = main(["export", "--input", str(ckpt), "--output", str(out), "--to", "dcp", "--quiet"])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1 and "Traceback" not in err, (code, err)
    assert err.startswith(f"ucp export: error: {out}: no space left on device") and "--output" in err, err
    assert list(small_tmpfs.iterdir()) == []  # no output, and the staging folder is gone
