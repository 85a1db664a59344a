"""The host-memory tier with a 3D engine (issue #28): a tiny AutoTP Llama, AutoTP 2 x DP 2 on 2 nodes x 2
ranks under torchrun's elastic agents, each node its own memory folder (support/train_memory_3d.py).

A node lost with its memory folder: the survivor resumes from its peer copy of the lost node's TP shards,
newer than the disk tier, at AutoTP 2 x DP 1, and continues the run's losses; its last memory checkpoint
is the checkpoint the disk save of the same step wrote, tensor for tensor. Negative control: without peer
copies ("replicas": 0) the newest memory checkpoint is incomplete once a node is gone: `"auto"` warns and
leaves the load to the older disk checkpoint (test_memory_tier.py runs that fallback end to end).
"""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest

import ucp
from support.atomic import assert_same_checkpoint
from support.elastic_agents import ElasticJob, reached, read_losses
from support.memory_runs import manifest
from support.processes import wait_for
from ucp.deepspeed.config import MemoryEvery
from ucp.deepspeed.memory.resume import memory_resume_point

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "train_memory_3d.py"
STEPS = 8
# World size -> AutoTP degree of a start at that size: 4 ranks train AutoTP 2 x DP 2, a restart on 2 ranks
# AutoTP 2 x DP 1 (the checkpoint is resharded from DP 2; test_save_3d resumes AutoTP saves on plain DP).
KEEP_TP = '{"4": 2, "2": 2}'
# fp32, no dropout: another layout sums the same products in another order (row-parallel matmuls, the mean
# over data-parallel ranks), ~1e-7 relative per step, compounding over a few Adam steps; not bit-equal.
RTOL = 1e-6


def job_args(tmp: Path, tp: str, every: int, replicas: int) -> list:
    # "$UCP_TEST_NODE" is expanded by each worker: every agent (node) gets its own memory folder.
    return ["--save-dir", tmp / "ckpt", "--steps", STEPS, "--tp", tp, "--every", every, "--replicas", replicas,
            "--memory-dir", "$UCP_TEST_NODE", "--losses-out", tmp / "losses.jsonl"]


def run_job(tmp: Path, args: list, nodes: int, lose_after: int | None = None) -> str:
    """`nodes` agents x 2 ranks to the end (with `lose_after`: node 1 and its memory folder are lost once that
    step is logged on 4 ranks); the agents' logs."""
    with ElasticJob(SCRIPT, args, tmp / "agents", nodes=f"1:{nodes}", nproc=2) as job:
        for node in range(nodes):
            job.start_agent({"UCP_TEST_NODE": str(tmp / f"node{node}")})
        if lose_after is not None:
            wait_for(reached(tmp / "losses.jsonl", lose_after, world=4), 300, f"step {lose_after} on 4 ranks")
            paused = job.pause()                 # nothing moves while the node goes
            job.lose_node(1)
            shutil.rmtree(tmp / "node1")         # with its memory folder
            job.resume(paused)
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    return job.logs(tail=None)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The uninterrupted run on 2 nodes x 2 ranks (AutoTP 2 x DP 2), without peer copies, disk every 3 steps:
    its newest memory checkpoint (step 8) is newer than its newest disk one (step 6)."""
    tmp = tmp_path_factory.mktemp("memory-3d-reference")
    run_job(tmp, job_args(tmp, KEEP_TP, every=3, replicas=0), nodes=2)
    return tmp


def losses_of(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_losses(run / "losses.jsonl")}


def assert_same_losses(records: list[dict], reference: dict[int, float]) -> None:
    assert records
    for r in records:  # a step redone after a restart is the same step again
        assert r["loss"] == pytest.approx(reference[r["step"]], rel=RTOL), (r, reference[r["step"]])


def test_an_autotp_job_loses_a_node_and_resumes_from_the_peer_copy(tmp_path, reference):
    logs = run_job(tmp_path, job_args(tmp_path, KEEP_TP, every=4, replicas=1), nodes=2, lose_after=6)
    node0 = re.escape(str(tmp_path / "node0"))
    resumed = re.findall(rf"resuming from {node0}/global_step(\d+) \(step \d+\) on 2 ranks", logs)
    assert resumed, logs[-6000:]
    step = int(resumed[-1])
    assert step >= 5 and step % 4, f"step {step}: the memory tier must be newer than the disk tier (step 4)"
    records = read_losses(tmp_path / "losses.jsonl")
    assert {(r["world"], r["tp"]) for r in records} == {(4, 2), (2, 2)}
    last_at_4 = max(i for i, r in enumerate(records) if r["world"] == 4)
    assert records[last_at_4 + 1]["step"] == step + 1  # right after the memory checkpoint
    assert max(r["step"] for r in records) == STEPS
    assert_same_losses(records, losses_of(reference))
    # The memory save is the disk save's checkpoint: both of step 8 (AutoTP 2), every state of every tensor.
    memory = ucp.open_checkpoint(tmp_path / "node0" / f"global_step{STEPS}")
    assert memory.verify() == [] and memory.source["tp"] == 2
    assert_same_checkpoint(memory, ucp.open_checkpoint(tmp_path / "ckpt" / f"global_step{STEPS}"))
    with pytest.raises(AssertionError):  # negative control: another step's disk checkpoint differs
        assert_same_checkpoint(memory, ucp.open_checkpoint(tmp_path / "ckpt" / "global_step4"))


def test_without_a_peer_copy_the_lost_node_takes_the_memory_checkpoint_along(reference, caplog):
    """Negative control: no peer copies ("replicas": 0) and node 1 gone: node 0's copy of step 8 holds its own
    ranks' TP shards only, so `"auto"`'s memory step (`memory_resume_point`, here on node 0 alone) finds no
    complete memory checkpoint newer than disk step 6, warns, and leaves the load to the disk tier."""
    node0 = reference / "node0"
    held = manifest(node0)
    assert held["step"] == STEPS and sorted(held["holds"]) == ["0", "1"]
    assert ucp.open_checkpoint(node0 / f"global_step{STEPS}").verify() != []  # not a checkpoint on its own
    config = MemoryEvery(1, 0, str(node0), str(reference / "ckpt"))
    with caplog.at_level(logging.WARNING, logger="ucp.elastic"):
        assert memory_resume_point(config, 6, "resuming from the disk tier") is None
    assert (f"memory checkpoint global_step{STEPS} (step {STEPS}) is incomplete: the pieces of saving rank(s) "
            "2, 3 of 4 were on nodes that are gone") in caplog.text
