"""Elastic training under Ray Train's elastic mode on a local cluster of raylets, one cluster for the module (it
takes long to start): a data-parallel job loses a node (3 -> 2 workers) and gets one back (-> 3) (issue #20); an
AutoTP job's layout follows the workers (3 -> 2 -> 3: T=1 x D=3 -> T=2 x D=1 -> T=1 x D=3, issue #28); README's
recipe of a Hugging Face Trainer under `TorchTrainer` resumes "auto" after a lost worker (issue #29). Every step's
loss equals the uninterrupted run's."""
from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.elastic_agents import (
    assert_restarts_redo_at_most,
    assert_same_losses,
    by_step,
    reached,
    read_losses,
)
from support.launch import run_torchrun
from support.processes import kill_tree, wait_for
from support.ray_nodes import Nodes

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "elastic"
SUPPORT = Path(__file__).resolve().parents[1] / "support"
STEPS = 12   # conftest's elastic_reference has these (and more)
RTOL = 1e-6  # as in test_elastic_torchrun: other world sizes sum gradients in another order


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> Iterator[Nodes]:
    """The module's Ray cluster: each test asks `nodes.ensure(n)` for the raylets it needs; stopped at the end."""
    cluster = Nodes(tmp_path_factory.mktemp("r"))  # short: Ray's socket paths under it stay below 108 bytes
    try:
        yield cluster
    finally:
        cluster.stop()


@contextlib.contextmanager
def driver(cmd: list, nodes: Nodes, log: Path) -> Iterator[subprocess.Popen]:
    """The Ray Train driver script, run against `nodes`; killed with whatever it started if still running."""
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *map(str, cmd)], env=nodes.env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        kill_tree(proc.pid)


def lose_a_node(nodes: Nodes) -> None:
    nodes.lose(nodes.live()[-1])


def test_lose_a_node_and_get_it_back(tmp_path, nodes, elastic_reference):
    # the uninterrupted run of the example's defaults (ZeRO-1, global batch 10): its losses do not depend on the
    # world size (conftest's, 4 ranks, shared with test_elastic_torchrun)
    expected = elastic_reference(1, 10)

    losses, storage, log = tmp_path / "losses.jsonl", tmp_path / "storage", tmp_path / "driver.log"
    address = nodes.ensure(3)
    with driver([EXAMPLES / "ray" / "train.py", "--address", address, "--storage", storage, "--steps", STEPS,
                 "--min-workers", 2, "--max-workers", 3, "--losses-out", losses], nodes, log) as job:
        wait_for(reached(losses, 3, world=3), 400, "step 3 on 3 workers")
        lose_a_node(nodes)                                              # a node is gone: 2 workers go on
        wait_for(reached(losses, 5, world=2), 400, "step 5 on 2 workers")
        grown = _add_while_paused(nodes, tmp_path / "driver.log")       # it comes back: 3 workers again
        assert grown
        assert job.wait(timeout=600) == 0, (tmp_path / "driver.log").read_text()[-5000:]
    records = read_losses(losses)
    assert [r["world"] for r in records][0] == 3 and {r["world"] for r in records} == {2, 3}
    assert max(r["step"] for r in records) == STEPS
    assert_same_losses(records, expected, RTOL)
    log = (tmp_path / "driver.log").read_text()
    assert f"checkpoint {storage}/ucp-elastic/ucp/global_step" in log   # Ray's own record of the last checkpoint
    assert "ucp: restart 3 -> 2 ranks" in log and "ucp: restart 2 -> 3 ranks" in log


def assert_resumed(records: list[dict], first_world: int, then_world: int, every: int) -> int:
    """The run started at `first_world` workers and, after the lost node, went on at `then_world` from its last
    checkpoint (at most `every` steps redone), not from scratch: the first step at `then_world`."""
    last_before = max(r["step"] for r in records if r["world"] == first_world)
    first_after = min(r["step"] for r in records if r["world"] == then_world)
    assert records[0]["world"] == first_world and records[-1]["world"] == then_world
    assert last_before - every < first_after <= last_before + 1, (last_before, first_after)
    return first_after


STEPS_3D = 8   # the steps of conftest's elastic_3d_reference too


def test_a_3d_job_under_ray_train_takes_the_layout_of_the_workers_left(tmp_path, nodes, elastic_3d_reference):
    """`examples/elastic/ray/train.py --example train_3d`: the AutoTP Llama of the torchrun recipe with
    `"tensor_parallel": [2, 1]`. 3 workers take T=1 x D=3 (all 3 ranks used; T=2 would use 2), the node lost
    leaves 2, which take T=2 x D=1 (both use 2; the cost model prefers T=2, test_elastic_3d); a node added back
    gives Ray room for 3 workers again, which take T=1 x D=3 again. The reference is the uninterrupted 4-rank run
    (T=2 x D=2, conftest's, shared with test_elastic_3d): the same global batch of 8 and sample order at every
    layout."""
    expected, _ = elastic_3d_reference
    losses, log = tmp_path / "losses.jsonl", tmp_path / "driver.log"
    address = nodes.ensure(3)
    with driver([EXAMPLES / "ray" / "train.py", "--example", "train_3d", "--address", address, "--storage",
                 tmp_path / "storage", "--steps", STEPS_3D, "--global-batch", 8, "--min-workers", 2,
                 "--max-workers", 3, "--losses-out", losses], nodes, log) as job:
        wait_for(reached(losses, 2, world=3), 400, "step 2 on 3 workers")
        lose_a_node(nodes)                                              # 2 workers go on, at T=2 x D=1
        wait_for(reached(losses, 3, world=2), 400, "step 3 on 2 workers")
        assert _add_while_paused(nodes, log)                            # room for 3 again: T=1 x D=3
        assert job.wait(timeout=600) == 0, log.read_text()[-5000:]
    records = read_losses(losses)
    worlds = [r["world"] for r in records]
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [3, 2, 3], worlds
    assert {(r["world"], r["tp"], r["dp"]) for r in records} == {(3, 1, 3), (2, 2, 1)}
    assert_restarts_redo_at_most(records, every=1, restarts=2)
    assert sorted(by_step(records)) == list(range(1, STEPS_3D + 1)) and records[-1]["step"] == STEPS_3D
    assert_same_losses(records, expected, RTOL)
    # the check can fail: a restart from scratch (or from another step) would log another loss at those steps
    assert all(expected[s] != pytest.approx(expected[1], rel=RTOL) for s in range(2, STEPS_3D + 1))
    text = log.read_text()
    assert "ucp: 2 ranks: tensor_parallel 2 x pipeline_parallel 1 x data_parallel 1" in text
    assert "ucp: restart 3 -> 2 ranks" in text and "ucp: restart 2 -> 3 ranks" in text


HF_STEPS, HF_SAVE_STEPS = 6, 2


def test_readmes_ray_recipe_for_a_trainer_resumes_auto_after_a_lost_worker(tmp_path, nodes):
    """README's `TorchTrainer(lambda cfg: ucp.transformers.train(build_trainer()), ...)` (`train_hf_ray.py`) with
    the torchrun recipe's Trainer (ZeRO-2, tiny Llama, `"elastic": {"global_batch": 5}`): 3 workers, a node lost
    after checkpoint-2, Ray restarts the group at 2 workers and "auto" resumes from the newest checkpoint-N. Every
    logged loss equals an uninterrupted 1-rank run's, and every learning rate and epoch is the same."""
    args = ["--max-steps", HF_STEPS, "--save-steps", HF_SAVE_STEPS, "--global-batch", 5]
    run_torchrun(SUPPORT / "train_hf_elastic.py", [*args, "--output-dir", tmp_path / "ref",
                                                   "--log-out", tmp_path / "reference.jsonl"], 1,
                 tmp_path / "reference.log")
    expected = {s: rows[0] for s, rows in by_step(read_losses(tmp_path / "reference.jsonl")).items()}
    losses, log, out = tmp_path / "losses.jsonl", tmp_path / "driver.log", tmp_path / "out"
    address = nodes.ensure(3)
    with driver([SUPPORT / "train_hf_ray.py", "--address", address, "--storage", tmp_path / "storage",
                 "--min-workers", 2, "--max-workers", 3, "--", *args, "--output-dir", out, "--log-out", losses,
                 "--step-sleep", 0.3], nodes, log) as job:
        wait_for(reached(losses, HF_SAVE_STEPS + 1, world=3), 400, f"step {HF_SAVE_STEPS + 1} on 3 workers")
        lose_a_node(nodes)
        assert job.wait(timeout=600) == 0, log.read_text()[-5000:]
    records = read_losses(losses)
    resumed_at = assert_resumed(records, 3, 2, every=HF_SAVE_STEPS) - 1
    assert f"resuming from {out}/checkpoint-{resumed_at} on 2 ranks" in log.read_text()
    got = by_step(records)
    assert sorted(got) == sorted(expected) == list(range(1, HF_STEPS + 1))
    for step, rows in got.items():
        for r in rows:  # a step redone after the restart is the same step again
            assert r["loss"] == pytest.approx(expected[step]["loss"], rel=RTOL), (step, r, expected[step])
            assert r["lr"] == expected[step]["lr"] and r["epoch"] == expected[step]["epoch"], (step, r)
    # the check can fail: a fresh start at the restart would log step 1's loss again, another step's its own
    assert all(expected[s]["loss"] != pytest.approx(expected[1]["loss"], rel=RTOL) for s in range(2, HF_STEPS + 1))


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
