"""Elastic AutoTP training under torchrun's own agents: the layout follows the ranks (T=2 x D=2 on 4, T=1 x D=3 on
3, back to T=2 x D=2 on 4), a rank the layout cannot use waits as a spare holding a copy of every memory checkpoint,
and every step's loss is the uninterrupted run's (issue #28, items 2-4)."""
from __future__ import annotations

import logging
import re
import shutil
from pathlib import Path

import pytest

import ucp
from support.atomic import assert_same_checkpoint
from support.elastic_agents import (
    ElasticJob,
    assert_restarts_redo_at_most,
    assert_same_losses,
    assert_stock_resume_is_not_the_run,
    by_step,
    reached,
    read_losses,
)
from support.launch import run_torchrun
from support.memory_runs import manifest
from support.processes import wait_for
from ucp.deepspeed.config import MemoryEvery
from ucp.deepspeed.memory.files import read_copies
from ucp.deepspeed.memory.resume import memory_resume_point

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic" / "torchrun" / "train_3d.py"
STEPS = 8   # the steps of the uninterrupted run (conftest's elastic_3d_reference) too
# fp32, no dropout, the same global batch of 8: layouts sum the same gradients in another order (TP splits the
# matmuls, DP the batch), so losses agree to rounding (~1e-7 relative a step, compounding over a few Adam steps).
RTOL = 1e-6


@pytest.fixture(scope="module")
def reference(elastic_3d_reference) -> tuple[dict[int, float], Path]:
    """The uninterrupted 4-rank run (T=2 x D=2) of STEPS steps and its DeepSpeed checkpoints of every step (for the
    negative control): conftest's, shared with test_elastic_ray."""
    return elastic_3d_reference


def assert_same_run(records: list[dict], reference: dict[int, float], steps: range) -> None:
    got = by_step(records)
    assert sorted(got) == list(steps), f"steps logged: {sorted(got)}"
    assert_same_losses(records, reference, RTOL)


def test_lose_a_node_then_get_it_back_the_layout_follows(tmp_path, reference):
    """4 ranks take T=2 x D=2: both use all 4, and the cost model (the tiny Llama's step is all gradient all-reduce,
    which TP halves) prefers T=2. On 3 ranks T=1 x D=3 wins by the first rule: it uses all 3 ranks, T=2 x D=1 two."""
    losses = tmp_path / "losses.jsonl"
    with ElasticJob(EXAMPLE, ["--save-dir", tmp_path / "ckpt", "--steps", STEPS, "--every", 1, "--keep", 2,
                              "--losses-out", losses], tmp_path / "agents") as job:
        for _ in range(4):
            job.start_agent()
        wait_for(reached(losses, 2, world=4), 300, "step 2 on 4 ranks")
        job.lose_node(3)                                            # a node is gone: 3 ranks go on, at T=1 x D=3
        wait_for(reached(losses, 5, world=3), 300, "step 5 on 3 ranks")
        job.join_while_paused()                                     # hardware back: T=2 x D=2 at the next restart
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    records = read_losses(losses)
    assert {(r["world"], r["tp"], r["dp"]) for r in records} == {(4, 2, 2), (3, 1, 3)}
    assert records[-1]["world"] == 4 and records[-1]["step"] == STEPS
    assert_same_run(records, reference[0], range(1, STEPS + 1))
    assert_restarts_redo_at_most(records, every=1, restarts=2)
    logs = job.logs(tail=None)
    assert "ucp: 3 ranks: tensor_parallel 1 x pipeline_parallel 1 x data_parallel 3" in logs


def test_a_rank_the_layout_cannot_use_waits_as_a_spare(tmp_path, reference):
    """"tensor_parallel": 2 on 3 ranks: T=2 x D=1 trains on ranks 0-1 with the whole global batch (the same losses),
    rank 2 joins no group, says so in one line, and exits 0 when the run ends. With a memory tier of no peer copies
    ("replicas": 0) and each rank a node of its own ($RANK in the memory folder), the spare's node ends up holding
    the run's last memory checkpoint whole: the disk save of the same step, every state of every tensor."""
    losses = tmp_path / "losses.jsonl"
    run_torchrun(EXAMPLE, ["--save-dir", tmp_path / "ckpt", "--steps", 3, "--tp", 2, "--losses-out", losses,
                           "--memory-dir", f"{tmp_path}/node$RANK", "--replicas", 0], 3, tmp_path / "log")
    records = read_losses(losses)
    assert {(r["world"], r["tp"], r["dp"]) for r in records} == {(3, 2, 1)}
    assert_same_run(records, reference[0], range(1, 4))
    log = (tmp_path / "log").read_text()
    assert log.count("is a spare") == 1 and "rank 2 of 3 is a spare" in log
    assert manifest(tmp_path / "node2")["step"] == 3 and sorted(manifest(tmp_path / "node2")["holds"]) == ["0", "1"]
    spare = ucp.open_checkpoint(tmp_path / "node2" / "global_step3")
    assert spare.verify() == [] and spare.source["tp"] == 2
    assert_same_checkpoint(spare, ucp.open_checkpoint(tmp_path / "ckpt" / "global_step3"))
    with pytest.raises(AssertionError):   # negative control: another step's disk save differs
        assert_same_checkpoint(spare, ucp.open_checkpoint(tmp_path / "ckpt" / "global_step2"))
    # A training node holds its own rank's pieces only: without the spare, no node holds the checkpoint whole.
    assert sorted(manifest(tmp_path / "node0")["holds"]) == ["0"]
    assert ucp.open_checkpoint(tmp_path / "node0" / "global_step3").verify() != []


def _whole_copy(node: Path, job: Path) -> int | None:
    """The step of `node`'s newest committed memory checkpoint (as `"auto"` sees them) when it holds both saving
    ranks' pieces, else None."""
    copies = read_copies(node, str(job)) if node.is_dir() else {}
    newest = max(copies.values(), key=lambda m: m.step, default=None)
    return newest.step if newest and sorted(newest.holds) == [0, 1] else None


def test_the_spare_copy_serves_the_restart_when_a_training_node_is_lost(tmp_path, reference, caplog):
    """3 nodes at "tensor_parallel": 2: T=2 x D=1 and a spare; a memory save every step without peer copies
    ("replicas": 0), no disk save in the run (every 100). Once the spare's node holds a memory checkpoint, every
    worker is stopped (SIGSTOP: no step moves) and the node of training rank 0 is lost with its memory folder (it
    also hosts the job's store: the spare must restart, not end as if the run were over). The 2 nodes left take
    T=2 x D=1, the spare now training, resume from the spare's copy (filled onto the other node) and continue the
    run's losses. Negative control: the surviving training node alone holds no complete memory checkpoint, so
    without the spare's copy the restart would start again from step 0 (there is no disk save)."""
    losses = tmp_path / "losses.jsonl"
    nodes = [tmp_path / f"node{i}" for i in range(3)]
    job_dir = (tmp_path / "ckpt").resolve()   # the job a manifest names
    with ElasticJob(EXAMPLE, ["--save-dir", tmp_path / "ckpt", "--steps", STEPS, "--tp", 2, "--every", 100,
                              "--memory-dir", "$UCP_TEST_NODE", "--replicas", 0, "--losses-out", losses],
                    tmp_path / "agents", nodes="2:3") as job:
        for node in nodes:
            job.start_agent({"UCP_TEST_NODE": str(node)})
        wait_for(lambda: read_losses(losses) and any(_whole_copy(n, job_dir) for n in nodes), 300,
                 "a spare's complete memory copy")
        paused = job.pause()                                   # nothing moves while the node goes
        spare = next(i for i, n in enumerate(nodes) if _whole_copy(n, job_dir))
        held = _whole_copy(nodes[spare], job_dir)
        assert held is not None and held < STEPS, f"the run ended before a node could be lost (copy of {held})"
        rank0 = read_losses(losses)[-1]["pid"]
        lost = next(i for i in range(3) if any(p.pid == rank0 for p in job.workers(i)))
        survivor = next(i for i in range(3) if i not in (spare, lost))
        job.lose_node(lost)
        shutil.rmtree(nodes[lost])                              # with its memory folder
        config = MemoryEvery(1, 0, str(nodes[survivor]), str(job_dir))
        with caplog.at_level(logging.WARNING, logger="ucp.elastic"):   # negative control (docstring)
            assert memory_resume_point(config, 0, "starting from step 0") is None
        job.resume(paused)
        codes = job.wait(timeout=600)
    assert "is incomplete" in caplog.text
    assert {c for i, c in codes.items() if i != lost} == {0}, job.logs()
    logs = job.logs(tail=None)
    resumed = [int(s) for s in re.findall(r"resuming from \S+/global_step(\d+) \(step \d+\) on 2 ranks", logs)]
    # The spare may commit the copy that was in flight at the stop (held + 1) before its agent restarts it.
    assert resumed and resumed[0] in (held, held + 1), logs[-6000:]
    assert re.search(rf"filled the memory checkpoint global_step{resumed[0]} from peer copies", logs), logs[-6000:]
    records = read_losses(losses)
    assert {(r["world"], r["tp"], r["dp"]) for r in records} == {(3, 2, 1), (2, 2, 1)}
    first_at_2 = next(i for i, r in enumerate(records) if r["world"] == 2)
    assert records[first_at_2]["step"] == resumed[0] + 1   # right after the spare's copy, not from step 1
    assert records[-1]["step"] == STEPS and records[-1]["world"] == 2
    assert_same_losses(records, reference[0], RTOL)


def test_without_ucp_a_resume_at_another_layout_is_not_the_run(tmp_path, reference):
    """Negative control: DeepSpeed's own load_checkpoint of the reference's T=2 x D=2 step-3 checkpoint on 3 ranks
    (T=1 x D=3, the same global batch and sample order) does not continue the uninterrupted run."""
    assert_stock_resume_is_not_the_run(EXAMPLE, reference[1], reference[0], 3, tmp_path)
