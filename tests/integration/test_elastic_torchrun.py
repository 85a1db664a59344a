"""Elastic training under torchrun's own elastic agents: lose a node, get one back, lose a worker; the run
finishes at its planned step with every step's loss equal to the uninterrupted 4-rank run's (issue #20)."""
from __future__ import annotations

from pathlib import Path

import pytest

from support.elastic_agents import ElasticJob, assert_same_losses, by_step, first_losses, reached, read_losses
from support.launch import run_torchrun
from support.processes import wait_for

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic" / "torchrun" / "train.py"
STEPS = 16   # the steps of the uninterrupted runs (conftest's elastic_reference, 4 ranks) too
# fp32, no dropout: runs at different world sizes sum the same gradients in another order, so losses agree to
# rounding (~1e-7 relative per step, compounding over a few Adam steps), not to the bit.
RTOL = 1e-6


def assert_same_run(records: list[dict], reference: dict[int, float]) -> None:
    assert sorted(reference) == list(range(1, STEPS + 1))
    got = by_step(records)
    assert sorted(got) == sorted(reference), f"steps logged: {sorted(got)}"
    assert_same_losses(records, reference, RTOL)


@pytest.mark.parametrize("stage, global_batch", [(1, 10), (3, 12)])
def test_lose_a_node_get_one_back_lose_a_worker(tmp_path, elastic_reference, stage, global_batch):
    losses = tmp_path / "losses.jsonl"
    with ElasticJob(EXAMPLE, ["--save-dir", tmp_path / "ckpt", "--steps", STEPS, "--stage", stage,
                              "--global-batch", global_batch, "--every", 1, "--keep", 2, "--losses-out", losses],
                    tmp_path / "agents") as job:
        for _ in range(4):
            job.start_agent()
        wait_for(reached(losses, 4, world=4), 300, "step 4 on 4 ranks")
        job.lose_node(3)                                            # a node is gone: 3 ranks go on
        wait_for(reached(losses, 6, world=3), 300, "step 6 on 3 ranks")
        job.join_while_paused()                                     # hardware back: 4 ranks at the next restart
        wait_for(reached(losses, 9, world=4), 300, "step 9 on 4 ranks")
        job.lose_worker(1)                                          # one worker killed mid-step
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    records = read_losses(losses)
    assert {r["world"] for r in records} == {3, 4}
    assert max(r["step"] for r in records) == STEPS
    assert len({r["pid"] for r in records}) >= 4, "the job restarted at least three times"
    assert_same_run(records, elastic_reference(stage, global_batch))
    kept = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("global_step"))
    assert kept == [f"global_step{STEPS - 1}", f"global_step{STEPS}"]
    logs = job.logs(tail=None)
    assert "ucp: restart 4 -> 3 ranks" in logs and "ucp: restart 3 -> 4 ranks" in logs


def test_without_elastic_batches_a_resume_at_another_size_is_another_run(tmp_path):
    """Negative control: with the stock DistributedSampler and per-rank batch keys (no "elastic"), a run resumed
    on 3 ranks from its own 4-rank step-4 checkpoint does not continue its uninterrupted 4-rank losses."""
    args = ["--stage", 1, "--global-batch", 12, "--stock"]
    whole, resumed = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    run_torchrun(EXAMPLE, [*args, "--save-dir", tmp_path / "a", "--steps", 8, "--losses-out", whole], 4,
                 tmp_path / "log")
    run_torchrun(EXAMPLE, [*args, "--save-dir", tmp_path / "b", "--steps", 4, "--losses-out", resumed], 4,
                 tmp_path / "log")
    run_torchrun(EXAMPLE, [*args, "--save-dir", tmp_path / "b", "--steps", 8, "--losses-out", resumed], 3,
                 tmp_path / "log")
    uninterrupted, got = first_losses(whole), first_losses(resumed)
    assert all(got[s] == uninterrupted[s] for s in range(1, 5))
    assert any(got[s] != pytest.approx(uninterrupted[s], rel=1e-3) for s in range(5, 9))
