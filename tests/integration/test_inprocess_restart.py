"""Recovery without a restart (issue #42): under ucp-torchrun's agents, the survivors of a lost node go on in the
same processes through `ucp.elastic.run`, from the peers' memory copies, with the uninterrupted run's losses;
a node that joins later restarts the processes (torchrun's agents do), and the job finishes at 3 ranks.

The negative control, without `ucp.elastic.run` the same fault restarts the processes (their ids change), is
test_memory_tier's node loss (examples/elastic/torchrun/train.py without --in-process) and test_elastic_torchrun's.
"""
from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from support.elastic_agents import ElasticJob, assert_same_losses, by_step, cmdline, reached, read_losses
from support.processes import wait_for

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic" / "torchrun" / "train.py"
STEPS = 16   # conftest's ELASTIC_STEPS: room for the test to find its moment before the run ends
DISK_EVERY = 4
DETECT_S = 5   # the heartbeat's, short for the test (the default is 15 s)
# Each step takes at least this long: longer than the tiny model's memory save, as a real model's step is, so that
# the moment a fault redoes no step (the newest step's memory save committed) lasts long enough to be caught. Without
# it the save of step N commits after step N + 1 on an idle machine and no such moment comes.
STEP_S = 0.5
# fp32, no dropout: runs at different world sizes sum the same gradients in another order, so losses agree to
# rounding (~1e-7 relative per step, compounding over a few Adam steps), not to the bit.
RTOL = 1e-6


def job_args(tmp: Path, stage: int, global_batch: int) -> list:
    # "$UCP_TEST_NODE" is expanded by each worker: every agent (node) gets its own memory folder.
    return ["--save-dir", tmp / "ckpt", "--steps", STEPS, "--stage", stage, "--global-batch", global_batch,
            "--every", DISK_EVERY, "--keep", 2, "--memory-every", 1, "--replicas", 1, "--memory-dir", "$UCP_TEST_NODE",
            "--losses-out", tmp / "losses.jsonl", "--in-process", "--detect-s", DETECT_S, "--step-s", STEP_S]


def node_env(tmp: Path, node: int) -> dict[str, str]:
    return {"UCP_TEST_NODE": str(tmp / f"node{node}")}


def worker_pid(job: ElasticJob, agent: int) -> int | None:
    pids = [p.pid for p in job.workers(agent) if job.script.name in cmdline(p)]
    return pids[0] if pids else None


def newest_memory_step(node: Path) -> int | None:
    latest = node / "latest"
    return int(latest.read_text().removeprefix("global_step")) if latest.is_file() else None


def pause_with_the_newest_step_in_memory(job: ElasticJob, tmp: Path, nodes: list[int]) -> tuple[list, int]:
    """Every worker stopped at a moment when the memory save of the newest step finished, one not saved to disk,
    is committed on `nodes` (so that a fault now redoes no step, from memory); (the stopped workers, that step)."""
    deadline = time.monotonic() + 300
    while True:
        paused = job.pause()
        # the newest optimizer step rank 0 finished (recorded before its loss is logged: the report's "before")
        last = json.loads((tmp / "ckpt" / "ucp_progress.json").read_text())["step"]
        if last % DISK_EVERY and all(newest_memory_step(tmp / f"node{n}") == last for n in nodes):
            return paused, last
        job.resume(paused)
        assert last < STEPS - 4 and time.monotonic() < deadline, "no step's memory save committed while paused"
        time.sleep(0.05)


@pytest.mark.parametrize("stage, global_batch", [(1, 10), (3, 12)])
def test_a_lost_node_the_survivors_go_on_in_the_same_processes(tmp_path, elastic_reference, stage, global_batch):
    losses = tmp_path / "losses.jsonl"
    with ElasticJob(EXAMPLE, job_args(tmp_path, stage, global_batch), tmp_path / "agents", nodes="1:3") as job:
        for node in range(3):
            job.start_agent(node_env(tmp_path, node))
        wait_for(reached(losses, 3, world=3), 300, "step 3 on 3 ranks")
        rank0 = read_losses(losses)[-1]["pid"]
        # The node of rank 0 is lost: it hosted the world's store, so the survivors must meet elsewhere.
        lost = next(i for i in range(3) if worker_pid(job, i) == rank0)
        survivors = [i for i in range(3) if i != lost]
        pids = {i: worker_pid(job, i) for i in survivors}
        assert None not in pids.values()
        paused, last = pause_with_the_newest_step_in_memory(job, tmp_path, survivors)
        job.lose_node(lost)
        shutil.rmtree(tmp_path / f"node{lost}")
        job.resume(paused)
        wait_for(reached(losses, last + 2, world=2), 300, f"step {last + 2} on 2 ranks")
        assert {i: worker_pid(job, i) for i in survivors} == pids, "the survivors' processes were replaced"
        job.join_while_paused(node_env(tmp_path, 3))            # hardware back: torchrun's agents restart all
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    logs = job.logs(tail=None)
    report = re.search(r"ucp: in-process restart 3 -> 2 ranks: loaded (\S+) \(step (\d+)\), (\d+) steps? redone; "
                       r"fault to first step [\d.]+ s = detection [\d.]+ s \+ regroup [\d.]+ s \+ engine [\d.]+ s \+ "
                       r"load [\d.]+ s \+ first step [\d.]+ s", logs)
    assert report, logs[-8000:]
    assert int(report[2]) == last and report[3] == "0", report[0]
    assert re.search(rf"node({'|'.join(map(str, survivors))})/global_step{last}$", report[1]), report[0]  # memory
    records = read_losses(losses)
    at_two = [r for r in records if r["world"] == 2]
    assert at_two and {r["pid"] for r in at_two} <= set(pids.values())   # trained on by the same processes
    assert at_two[0]["step"] == last + 1                                 # right after the step before the fault
    assert records[-1]["world"] == 3 and records[-1]["step"] == STEPS
    assert sorted(by_step(records)) == list(range(1, STEPS + 1))
    assert_same_losses(records, elastic_reference(stage, global_batch), RTOL)


def test_a_hung_rank_is_taken_for_lost_after_detect_s_of_silence(tmp_path, elastic_reference):
    """A rank stopped (SIGSTOP), not killed: its connections stay open, so only its silence tells. The others go on
    in their processes; woken, it finds the world regrouped without it and exits 1 with one line, and its agent's
    process restart brings all three back (torchrun's agents restart every worker when a node rejoins)."""
    losses = tmp_path / "losses.jsonl"
    with ElasticJob(EXAMPLE, job_args(tmp_path, 1, 10), tmp_path / "agents", nodes="1:3") as job:
        for node in range(3):
            job.start_agent(node_env(tmp_path, node))
        wait_for(reached(losses, 3, world=3), 300, "step 3 on 3 ranks")
        rank0 = read_losses(losses)[-1]["pid"]
        hung = next(i for i in range(3) if worker_pid(job, i) != rank0)
        survivors = {i: worker_pid(job, i) for i in range(3) if i != hung}
        worker = next(p for p in job.workers(hung) if EXAMPLE.name in cmdline(p))
        worker.suspend()
        stopped = time.monotonic()
        wait_for(lambda: any(r["world"] == 2 for r in read_losses(losses)), 300, "a step on 2 ranks")
        took = time.monotonic() - stopped
        assert {i: worker_pid(job, i) for i in survivors} == survivors, "the survivors' processes were replaced"
        # The survivors wait (else they may finish at 2 first) until their agents see the woken node rejoin.
        seen = {i: job._detections([i]) for i in survivors}
        paused = job.pause()
        worker.resume()
        wait_for(lambda: all(job._detections([i]) > seen[i] for i in survivors), 300,
                 "the survivors' agents to see the woken node rejoin")
        job.resume(paused)
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    logs = job.logs(tail=None)
    assert re.search(rf"sent no heartbeat for \d+ s \(detect_s {DETECT_S}\)", logs), logs[-8000:]
    # detection after detect_s of silence (checked every beat), then the regroup and a step: bounded, never a hang
    assert took < DETECT_S + 60, took
    assert "ucp: in-process restart 3 -> 2 ranks" in logs
    assert re.search(r"ucp: in-process restart failed: rank \d arrived after the other survivors had regrouped "
                     r"without it; exiting with 1 so that the launcher restarts the processes", logs), logs[-8000:]
    records = read_losses(losses)
    assert {r["pid"] for r in records if r["world"] == 2} <= set(survivors.values())
    assert records[-1]["world"] == 3 and records[-1]["step"] == STEPS
    assert sorted(by_step(records)) == list(range(1, STEPS + 1))
    assert_same_losses(records, elastic_reference(1, 10), RTOL)


def test_a_second_fault_during_the_regroup_falls_back_to_a_process_restart(tmp_path, elastic_reference):
    """A node lost, then a second one while the survivors regroup: the last survivor exits 1 with one line, its
    agent restarts its process (at 1 rank), a node joins (2), and the job still finishes with the same losses."""
    losses = tmp_path / "losses.jsonl"
    with ElasticJob(EXAMPLE, job_args(tmp_path, 1, 10), tmp_path / "agents", nodes="1:3") as job:
        for node in range(3):
            job.start_agent(node_env(tmp_path, node))
        wait_for(reached(losses, 3, world=3), 300, "step 3 on 3 ranks")
        first, second, last = 0, 1, 2
        before = worker_pid(job, last)
        job.lose_node(first)
        wait_for(lambda: "waits for the other survivors" in (tmp_path / "agents" / f"agent{second}.log").read_text(),
                 120, f"agent {second}'s worker in the regroup")
        job.lose_node(second)                                    # it arrived: the others count on it
        wait_for(reached(losses, 1, world=1), 300, "a step on 1 rank")
        job.join_while_paused(node_env(tmp_path, 3))
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    log = (tmp_path / "agents" / f"agent{last}.log").read_text()
    assert re.search(r"ucp: in-process restart failed: a second fault during the regroup: rank \d of the old world "
                     r"sent no heartbeat for \d+ s; exiting with 1 so that the launcher restarts the processes",
                     log), log[-8000:]
    records = read_losses(losses)
    assert before not in {r["pid"] for r in records if r["world"] == 1}   # a new process
    assert records[-1]["world"] == 2 and records[-1]["step"] == STEPS
    assert sorted(by_step(records)) == list(range(1, STEPS + 1))
    assert_same_losses(records, elastic_reference(1, 10), RTOL)


def test_autotp_a_lost_node_the_survivors_take_the_new_layout_in_the_same_processes(tmp_path, elastic_3d_reference):
    """AutoTP `"tensor_parallel": [2, 1]` on 4 ranks (T=2 x D=2) loses a node: the 3 survivors take T=1 x D=3 in
    their processes (DeepSpeed's TP groups left and made again), from the disk save of every step; a node joins
    and the job finishes at T=2 x D=2 with the uninterrupted run's losses."""
    steps = 8   # conftest's ELASTIC_3D_STEPS
    losses = tmp_path / "losses.jsonl"
    example = EXAMPLE.with_name("train_3d.py")
    with ElasticJob(example, ["--save-dir", tmp_path / "ckpt", "--steps", steps, "--every", 1, "--keep", 2,
                              "--losses-out", losses, "--in-process", "--detect-s", DETECT_S],
                    tmp_path / "agents") as job:
        for _ in range(4):
            job.start_agent()
        wait_for(reached(losses, 2, world=4), 300, "step 2 on 4 ranks")
        rank0 = read_losses(losses)[-1]["pid"]
        lost = next(i for i in range(4) if worker_pid(job, i) != rank0)
        survivors = {i: worker_pid(job, i) for i in range(4) if i != lost}
        assert None not in survivors.values() and rank0 in survivors.values()
        job.lose_node(lost)
        wait_for(reached(losses, 5, world=3), 300, "step 5 on 3 ranks")
        assert {i: worker_pid(job, i) for i in survivors} == survivors, "the survivors' processes were replaced"
        job.join_while_paused()
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    logs = job.logs(tail=None)
    assert re.search(r"ucp: in-process restart 4 -> 3 ranks: loaded \S+ \(step \d+\), [01] steps? redone; fault to "
                     r"first step .*; layout tensor_parallel 1 x pipeline_parallel 1 x data_parallel 3", logs), \
        logs[-8000:]
    records = read_losses(losses)
    assert {(r["world"], r["tp"], r["dp"]) for r in records} == {(4, 2, 2), (3, 1, 3)}
    assert {r["pid"] for r in records if r["world"] == 3} <= set(survivors.values())
    assert records[-1]["world"] == 4 and records[-1]["step"] == steps
    assert sorted(by_step(records)) == list(range(1, steps + 1))
    assert_same_losses(records, elastic_3d_reference[0], RTOL)
