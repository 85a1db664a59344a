"""Hostile and damaged checkpoints: no input makes ucp raise anything but a UcpError, hang, or read
outside the checkpoint folder.

The base is a real ucp conversion of a DeepSpeed ZeRO-2 checkpoint. Each case damages one thing —
a field of the index replaced by another JSON value, deleted, or nudged; a byte of a safetensors
header; a data file swapped for a FIFO or a symlink out of the folder — and then runs what users
run on it: `ucp.open_checkpoint` and every tensor read, `verify`, the `ucp inspect` and `ucp verify`
commands, and (on fewer cases, since each costs a DeepSpeed engine) the resume hook on 2 ranks.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ucp
from support.checkpoints import TinySpec, ucp_load_errors
from ucp.cli.main import main as ucp_cli
from ucp.convert import convert
from ucp.errors import UcpError
from ucp.format.folder import INDEX_NAME

SOURCE = TinySpec(stage=2)
SECONDS_PER_CASE = 60  # a case that takes longer is a hang (a FIFO read would block forever)
ODD_VALUES = (None, True, False, -1, 0, 1, 2 ** 31, 2 ** 64, -(2 ** 63), 1e300, float("nan"), "", "x",
              "../outside.bin", "/etc/passwd", "data-00000-of-00001.safetensors", "float64", "F32", "param",
              [], [0], [-1, 5], [1, 2, 3], {}, {"a": 1}, {"dim": 0, "count": 0})


@pytest.fixture(scope="module")
def base(tiny_checkpoint, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fuzz-base") / "ucp"
    convert(tiny_checkpoint(SOURCE), out, workers=1, progress=False)
    return out


def paths_in(value, prefix=()) -> list[tuple]:
    """Every key path of a JSON tree."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += paths_in(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += paths_in(v, prefix + (i,))
    return out


def damage(folder: Path, rng: random.Random) -> str:
    """Damage one thing in the checkpoint `folder`; returns what was done."""
    index = json.loads((folder / INDEX_NAME).read_text())
    data_files = sorted(index["files"])
    what = rng.choice(["replace", "replace", "replace", "delete", "nudge", "header", "fifo", "symlink"])
    if what == "header":
        path = folder / rng.choice(data_files)
        raw = bytearray(path.read_bytes())
        at = rng.randrange(0, min(len(raw), 200))
        raw[at] = rng.randrange(256)
        path.write_bytes(bytes(raw))
        return f"header byte {at} of {path.name}"
    if what in ("fifo", "symlink"):
        path = folder / rng.choice(data_files)
        path.unlink()
        if what == "fifo":
            os.mkfifo(path)
        else:
            outside = folder.parent / "outside.bin"
            outside.write_bytes(b"\0" * 4096)
            path.symlink_to(outside)
        return f"{what} at {path.name}"
    where = rng.choice(paths_in(index))
    parent = index
    for key in where[:-1]:
        parent = parent[key]
    if what == "delete" and isinstance(parent, dict):
        del parent[where[-1]]
    elif what == "nudge" and isinstance(parent[where[-1]], int) and not isinstance(parent[where[-1]], bool):
        parent[where[-1]] = parent[where[-1]] + rng.choice([-8, -1, 1, 8, 1 << 40])
    else:
        parent[where[-1]] = rng.choice(ODD_VALUES)
    (folder / INDEX_NAME).write_text(json.dumps(index))
    return f"{what} {'/'.join(map(str, where))}"


def damaged_copy(base: Path, seed: int, parent: Path) -> tuple[Path, str]:
    folder = parent / f"case-{seed}"
    shutil.copytree(base, folder)
    return folder, damage(folder, random.Random(seed))


def _alarm(signum, frame):
    raise TimeoutError(f"no answer in {SECONDS_PER_CASE} s: ucp hangs on this input")


def read_everything(folder: Path, capsys) -> None:
    """What a user runs on a checkpoint; only UcpError may come out of the API, one line out of the CLI."""
    try:
        ckpt = ucp.open_checkpoint(folder)
        for name in ckpt.names:
            for state in ckpt.states(name):
                ckpt.tensor(name, state)
        ckpt.verify()
        for data in ckpt.index.files.values():  # only plain regular files inside the folder were accepted
            path = folder / data.name
            assert path.parent == folder and path.is_file() and not path.is_symlink()
    except UcpError:
        pass
    for command in ("inspect", "verify"):
        code = ucp_cli([command, str(folder)])
        err = capsys.readouterr().err
        assert code in (0, 1, 2), (command, code)
        if code == 2:
            assert "Traceback" not in err and err.startswith(f"ucp {command}: error: "), err


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(min_value=0, max_value=2 ** 32 - 1))
def test_damaged_checkpoints_give_ucp_errors_only(base, seed, capsys):
    with tempfile.TemporaryDirectory() as parent:
        folder, what = damaged_copy(base, seed, Path(parent))
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.alarm(SECONDS_PER_CASE)
        try:
            read_everything(folder, capsys)
        except Exception as exc:
            raise AssertionError(f"{what}: {type(exc).__name__}: {exc}") from exc
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, previous)


def test_the_undamaged_base_reads_and_verifies(base, capsys):
    ckpt = ucp.open_checkpoint(base)
    assert ckpt.verify() == []
    assert ucp_cli(["verify", str(base)]) == 0


HOOK_CASES = 40


def test_the_hook_refuses_damaged_checkpoints_on_every_rank_untouched(base, ckpt_root, tmp_path):
    """The hook on 2 ranks: every damaged checkpoint loads or is refused with a UcpError, engine untouched."""
    cases = [damaged_copy(base, seed, tmp_path) for seed in range(HOOK_CASES)]
    results = ucp_load_errors([folder for folder, _ in cases], SOURCE, ckpt_root)
    assert len(results) == HOOK_CASES
    for result in results:
        assert result["error"] is None or result["untouched"], result
    assert any(r["error"] for r in results)
