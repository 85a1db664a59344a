"""Runs of the host-memory tier under elastic agents, shared by its tests: a node's newest manifest, and a copy
of a finished run that a test may damage and restart."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path


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
