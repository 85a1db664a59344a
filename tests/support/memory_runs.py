"""Runs of the host-memory tier, shared by its tests: a node's newest manifest, a copy of a finished run that a
test may damage and restart, and the check that each simulated node's copy is the disk save of its step."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import ucp
from support.atomic import assert_same_checkpoint


def manifest(node: Path) -> dict:
    """The manifest of the memory checkpoint `latest` names in node folder `node`."""
    tag = (node / "latest").read_text()
    return json.loads((node / tag / "ucp_memory.json").read_text())


def copy_of(run: Path, tmp_path: Path) -> Path:
    """A copy of `run` at `tmp_path`. A memory checkpoint belongs to the job of the save folder its manifest
    names, so the copies' manifests are pointed at the copied save folder, as a job saving there writes them."""
    subprocess.run(["cp", "-a", f"{run}/.", str(tmp_path)], check=True)
    for old in tmp_path.glob("agents*"):
        shutil.rmtree(old)
    for path in tmp_path.glob("node*/global_step*/ucp_memory.json"):
        moved = json.loads(path.read_text())
        assert moved["job"] == str(run / "ckpt"), moved["job"]
        path.write_text(json.dumps({**moved, "job": str(tmp_path / "ckpt")}))
    return tmp_path


def memory_equals_saved(run: Path, step: int, earlier: int) -> None:
    """The memory tier of `run` (2 simulated nodes, `run`/memory/node0 and node1, each with a peer copy of the
    other's pieces): each node's copy of `step` holds every saving rank's pieces and equals the disk save of the
    same step (`run`/ucp), every state of every tensor; negative control: the disk save of step `earlier` fails
    the same comparison."""
    saved = ucp.open_checkpoint(run / "ucp" / f"global_step{step}")
    ranks = saved.source["dp"] * saved.source["tp"] * saved.source["pp"]
    for node in ("node0", "node1"):
        copy = ucp.open_checkpoint(run / "memory" / node / f"global_step{step}")
        assert sorted(map(int, manifest(run / "memory" / node)["holds"])) == list(range(ranks))  # own + peer's
        assert copy.verify() == []
        assert_same_checkpoint(copy, saved)
    with pytest.raises(AssertionError):
        assert_same_checkpoint(copy, ucp.open_checkpoint(run / "ucp" / f"global_step{earlier}"))
