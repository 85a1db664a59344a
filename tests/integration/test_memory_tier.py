"""The host-memory tier under torchrun's elastic agents, 2 nodes x 2 ranks, each node its own memory folder
(issue #22): a lost node's pieces come back from its peer's copy at the new world size, newer than the disk
tier; a node that lost its memory fetches the checkpoint from its peer; with no copy left of some pieces the
run falls back to the disk tier with a warning."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

import ucp
from support.elastic_agents import ElasticJob, reached, read_losses
from support.memory_runs import copy_of, manifest
from support.processes import wait_for

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic" / "torchrun" / "train.py"
STEPS = 10
DISK_EVERY = 4
# fp32, no dropout: runs at different world sizes sum the same gradients in another order, so losses agree to
# rounding (~1e-7 relative per step, compounding over a few Adam steps), not to the bit.
RTOL = 1e-6


def job_args(tmp: Path, steps: int, replicas: int = 1) -> list:
    # "$UCP_TEST_NODE" is expanded by each worker: every agent (node) gets its own memory folder.
    return ["--save-dir", tmp / "ckpt", "--steps", steps, "--stage", 1, "--global-batch", 10, "--every", DISK_EVERY,
            "--keep", 2, "--memory-every", 1, "--replicas", replicas, "--memory-dir", "$UCP_TEST_NODE",
            "--losses-out", tmp / "losses.jsonl"]


def node_env(tmp: Path, node: int) -> dict[str, str]:
    return {"UCP_TEST_NODE": str(tmp / f"node{node}")}


def run_two_nodes(tmp: Path, steps: int, replicas: int) -> str:
    """2 agents x 2 ranks to `steps`, both agents to the end; their logs."""
    with ElasticJob(EXAMPLE, job_args(tmp, steps, replicas), tmp / f"agents{steps}", nodes="2:2", nproc=2) as job:
        for node in (0, 1):
            job.start_agent(node_env(tmp, node))
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    return job.logs(tail=None)


@pytest.fixture(scope="module")
def reference(elastic_reference) -> dict[int, float]:
    """The uninterrupted 4-rank run's loss at each step (conftest's, shared with the other elastic tests: ZeRO-1,
    global batch 10, as job_args; steps 1-16)."""
    return elastic_reference(1, 10)


@pytest.fixture(scope="module")
def six_steps(tmp_path_factory) -> dict[int, Path]:
    """2 nodes x 2 ranks trained to step 6 (memory every step, disk every 4), per number of replicas."""
    runs = {}
    for replicas in (0, 1):
        tmp = tmp_path_factory.mktemp(f"memory-six-{replicas}")
        run_two_nodes(tmp, 6, replicas)
        runs[replicas] = tmp
    return runs


def assert_same_losses(records: list[dict], reference: dict[int, float]) -> None:
    assert records
    for r in records:  # a step redone after a restart is the same step again
        assert r["loss"] == pytest.approx(reference[r["step"]], rel=RTOL), (r, reference[r["step"]])


def test_lose_a_node_resume_from_the_peer_copy_newer_than_disk(tmp_path, reference):
    losses = tmp_path / "losses.jsonl"
    with ElasticJob(EXAMPLE, job_args(tmp_path, STEPS), tmp_path / "agents", nodes="1:2", nproc=2) as job:
        for node in (0, 1):
            job.start_agent(node_env(tmp_path, node))
        # step 6 logged: memory save 5, which save 6 waited for, is committed on both nodes
        wait_for(reached(losses, DISK_EVERY + 2, world=4), 300, f"step {DISK_EVERY + 2} on 4 ranks")
        paused = job.pause()                         # nothing moves while the node goes
        job.lose_node(1)                             # node 1 is gone, with its memory
        shutil.rmtree(tmp_path / "node1")
        lost_at = manifest(tmp_path / "node0")
        job.resume(paused)
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    logs = job.logs(tail=None)
    node0 = re.escape(str(tmp_path / "node0"))
    resumed = re.findall(rf"resuming from {node0}/global_step(\d+) \(step \d+\) on 2 ranks", logs)
    assert resumed, logs[-6000:]
    step = int(resumed[-1])
    assert step % DISK_EVERY, f"step {step} is on disk too: the memory tier must be newer"
    assert lost_at["ranks"] == 4 and sorted(lost_at["holds"]) == ["0", "1", "2", "3"]  # its own and the peer's
    assert not (tmp_path / "node1").exists()
    records = read_losses(losses)
    assert {r["world"] for r in records} == {2, 4} and max(r["step"] for r in records) == STEPS
    last_at_4 = max(i for i, r in enumerate(records) if r["world"] == 4)
    assert records[last_at_4 + 1]["step"] == step + 1 and records[last_at_4 + 1]["world"] == 2  # right after it
    # without ucp.elastic.run (test_inprocess_restart's control): the fault restarted the processes
    assert {r["pid"] for r in records if r["world"] == 2}.isdisjoint(r["pid"] for r in records if r["world"] == 4)
    assert_same_losses(records, reference)


def test_a_node_that_lost_its_memory_fetches_the_checkpoint_from_its_peer(six_steps, tmp_path, reference):
    run = copy_of(six_steps[1], tmp_path)
    # every node holds every piece: drop node 1's copy, and node 0's copy of node 1's pieces only
    shutil.rmtree(run / "node1")
    logs = run_two_nodes(run, 8, 1)
    assert "filled the memory checkpoint global_step6 from peer copies" in logs
    nodes = re.escape(str(run))
    assert re.search(rf"resuming from {nodes}/node[01]/global_step6 \(step 6\) on 4 ranks", logs), logs[-6000:]
    records = read_losses(run / "losses.jsonl")
    assert [r["step"] for r in records][-3:] == [6, 7, 8]
    assert_same_losses(records, reference)
    for node in ("node0", "node1"):  # with a copy on the other node, each node's copy is a whole checkpoint
        assert ucp.open_checkpoint(run / node / (run / node / "latest").read_text()).verify() == []


def test_without_a_copy_of_every_piece_it_falls_back_to_disk_with_a_warning(six_steps, tmp_path, reference):
    """Negative control: no peer copies ("replicas": 0), and one node's memory gone: the newest memory
    checkpoint is incomplete; the run resumes from the disk tier, older, and says what was lost."""
    run = copy_of(six_steps[0], tmp_path)
    held = manifest(run / "node0")["holds"]
    assert len(held) == 2  # its own two ranks' pieces only: not a checkpoint on its own
    assert ucp.open_checkpoint(run / "node0" / "global_step6").verify() != []
    shutil.rmtree(run / "node1")
    logs = run_two_nodes(run, 8, 0)
    lost = sorted(set(range(4)) - {int(r) for r in held})
    assert (f"memory checkpoint global_step6 (step 6) is incomplete: the pieces of saving rank(s) "
            f"{lost[0]}, {lost[1]} of 4 were on nodes that are gone") in logs, logs[-6000:]
    assert f"resuming from {run}/ckpt/global_step4 (step 4) on 4 ranks" in logs
    records = read_losses(run / "losses.jsonl")
    assert [r["step"] for r in records][-4:] == [5, 6, 7, 8]  # steps 5 and 6 redone from disk
    assert_same_losses(records, reference)


def test_a_peer_copy_that_cannot_be_sent_falls_back_to_disk_before_any_transfer(six_steps, tmp_path, reference):
    """Node 1 lost its memory and node 0's copy is cut short: the fill is called off before any rank waits for
    bytes (one warning), and the disk tier loads."""
    run = copy_of(six_steps[1], tmp_path)
    shutil.rmtree(run / "node1")
    data = next((run / "node0" / "global_step6").glob("data-*.safetensors"))
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 8)
    logs = run_two_nodes(run, 8, 1)
    assert "memory checkpoint global_step6 cannot be filled from its peers" in logs, logs[-6000:]
    assert f"resuming from {run}/ckpt/global_step4 (step 4) on 4 ranks" in logs
    assert_same_losses(read_losses(run / "losses.jsonl"), reference)
