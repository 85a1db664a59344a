"""Elastic training under Ray Train's elastic mode on a local cluster of raylets: lose a node (3 -> 2 workers),
get one back (-> 3); every step's loss equals the uninterrupted run's (issue #20)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from support.elastic_agents import assert_same_losses, first_losses, reached, read_losses
from support.launch import run_torchrun
from support.processes import kill_tree, wait_for
from support.ray_nodes import Nodes

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "elastic"
STEPS = 12
RTOL = 1e-6  # as in test_elastic_torchrun: other world sizes sum gradients in another order


def test_lose_a_node_and_get_it_back(tmp_path, tmp_path_factory):
    reference = tmp_path / "reference.jsonl"   # the uninterrupted run: its losses do not depend on the world size
    run_torchrun(EXAMPLES / "torchrun" / "train.py", ["--save-dir", tmp_path / "ref", "--steps", STEPS,
                                                      "--losses-out", reference], 2, tmp_path / "reference.log")
    expected = first_losses(reference)

    nodes = Nodes(tmp_path_factory.mktemp("r"))  # short: Ray's socket paths under it stay below 108 bytes
    losses, storage = tmp_path / "losses.jsonl", tmp_path / "storage"
    driver = None
    try:
        address = nodes.start(workers=2)
        with open(tmp_path / "driver.log", "w") as log:
            driver = subprocess.Popen(
                [sys.executable, EXAMPLES / "ray" / "train.py", "--address", address, "--storage", storage,
                 "--steps", str(STEPS), "--min-workers", "2", "--max-workers", "3", "--losses-out", losses],
                env=nodes.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(reached(losses, 3, world=3), 400, "step 3 on 3 workers")
        nodes.lose(2)                                                   # a node is gone: 2 workers go on
        wait_for(reached(losses, 5, world=2), 400, "step 5 on 2 workers")
        grown = _add_while_paused(nodes, tmp_path / "driver.log")       # it comes back: 3 workers again
        assert grown
        assert driver.wait(timeout=600) == 0, (tmp_path / "driver.log").read_text()[-5000:]
    finally:
        if driver is not None:
            kill_tree(driver.pid)
        nodes.stop()
    records = read_losses(losses)
    assert [r["world"] for r in records][0] == 3 and {r["world"] for r in records} == {2, 3}
    assert max(r["step"] for r in records) == STEPS
    assert_same_losses(records, expected, RTOL)
    log = (tmp_path / "driver.log").read_text()
    assert f"checkpoint {storage}/ucp-elastic/ucp/global_step" in log   # Ray's own record of the last checkpoint
    assert "ucp: restart 3 -> 2 ranks" in log and "ucp: restart 2 -> 3 ranks" in log


def _add_while_paused(nodes: Nodes, driver_log: Path) -> bool:
    """Add a raylet while the training workers are stopped (SIGSTOP), until Ray's controller has seen room for 3
    workers, so that the job cannot finish first; then let them go on (Ray restarts the group at 3)."""
    workers = nodes.train_workers()
    for p in workers:
        p.suspend()
    try:
        nodes.add()
        wait_for(lambda: "resize the worker group from 2 -> 3 workers" in driver_log.read_text(errors="replace"), 300,
                 "Ray to see room for 3 workers")
        return True
    finally:
        for p in workers:
            try:
                p.resume()
            except Exception:
                pass
