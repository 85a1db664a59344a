"""benchmarks/goodput.py's arithmetic on cases computed by hand (pure functions, no job): what a fault costs each
tool, the saves' share, the seeded trace, and controls where swapped parts change the answer. The benchmark's own
figures come from benchmarks/README.md's measurements (its "Goodput at scale" section)."""
from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import goodput  # noqa: E402

# Round numbers, so every figure below is worked out by hand in its comment.
PARTS = dataclasses.replace(goodput.MEASURED, detect_dead_s=2.0, detect_hung_s=15.0, regroup_s=3.0,
                            engine_inprocess_s=1.0, inprocess_steps_redone=0.0, ucp_bytes_per_param=10.0,
                            memory_load_bps=1e8, memory_save_bps=1e9, async_save_bps=1e9, disk_every_s=1000.0,
                            replace_s=100.0, step_in_flight=0.5, mtbf_gpu_s=1e6)
# 1e9 parameters on 100 GPUs: ucp's 10 B/param -> 1e8 B a GPU: load 1 s, memory save blocked 0.1 s.
JOB = goodput.Job("m", params=1e9, gpus=100, step_s=2.0, dp=10, share_lost_gpu=0.8, share_lost_node=0.5,
                  share_fewer_replicas=0.9)


def test_save_interval_is_youngs_optimum_in_whole_steps():
    # sqrt(2 x 0.1 s x 1e6 / 100 s) = 44.7 s = 22.4 steps of 2 s -> 22 steps, 44 s
    assert goodput.save_interval_s("ucp_inprocess", JOB, PARTS) == pytest.approx(44.0)
    rare = dataclasses.replace(PARTS, mtbf_gpu_s=1.0)  # faults all the time: still at least one step
    assert goodput.save_interval_s("ucp_inprocess", JOB, rare) == pytest.approx(2.0)


def test_one_fault_costs_the_sum_of_its_parts():
    r = goodput.recovery("ucp_inprocess", "node", JOB, PARTS)
    # detection 2, regroup 3 + engine 1, load 1e8 B / 1e8 B/s, redone: half a step 1 + half the 21 steps since
    # the last save (44 - 2) / 2 = 21; down 29 s, then 71 s at half speed (35.5), then the grow: a joining node
    # restarts the processes today, start-up 14.78 + load 1
    grow = PARTS.startup_ucp_s + 1.0
    assert (r.detect_s, r.wait_s, r.restart_s, r.convert_s, r.load_s) == (2.0, 0.0, 4.0, 0.0, 1.0)
    assert r.redone_s == pytest.approx(22.0)
    assert r.degraded_s == pytest.approx(35.5)
    assert r.grow_s == pytest.approx(grow)
    assert r.lost_s == pytest.approx(2 + 4 + 1 + 22 + 35.5 + grow)
    assert goodput.fault_to_training_s(r) == pytest.approx(7.0)
    hung = goodput.recovery("ucp_inprocess", "hung", JOB, PARTS)
    assert hung.detect_s == 15.0 and hung.degraded_s == pytest.approx((100 - 42) * (1 - 0.8))
    assert goodput.recovery("ucp_inprocess", "back", JOB, PARTS) == goodput.Recovery(grow_s=grow)


def test_same_size_restart_waits_for_the_hardware():
    r = goodput.recovery("dlrover", "gpu", JOB, PARTS)
    assert r.detect_s + r.wait_s == pytest.approx(PARTS.replace_s)  # idle until the replacement is there
    assert r.degraded_s == 0.0 and r.grow_s == 0.0
    node = goodput.recovery("dlrover", "node", JOB, PARTS)  # its node-local memory copy is gone: from disk
    assert node.redone_s == pytest.approx(1.0 + PARTS.disk_every_s / 2)
    assert goodput.recovery("dlrover", "back", JOB, PARTS).lost_s == 0.0


def test_no_faults_leave_only_the_save_stall():
    share = 0.1 / (44.0 + 0.1) + 0.1 / 1000  # memory save every 44 s, async disk save call every 1000 s
    assert goodput.save_stall_share("ucp_inprocess", JOB, PARTS) == pytest.approx(share)
    for tool in goodput.TOOLS:
        assert goodput.goodput(tool, 0, "node", 1e6, JOB, PARTS) == pytest.approx(
            1.0 - goodput.save_stall_share(tool, JOB, PARTS))
    lost = goodput.recovery("ucp_inprocess", "node", JOB, PARTS).lost_s
    assert goodput.goodput("ucp_inprocess", 3, "node", 1e4, JOB, PARTS) == pytest.approx(
        (1.0 - share) * (1.0 - 3 * lost / 1e4))


@pytest.mark.parametrize("case", ["gpu", "node", "hung", "back"])
def test_in_process_is_never_worse_than_a_process_restart(case):
    for gpus, params in ((1024, 7e9), (16384, 70e9), (8, 1e8)):
        job = dataclasses.replace(JOB, gpus=gpus, params=params)
        for parts in (goodput.MEASURED, PARTS):
            assert goodput.recovery("ucp_inprocess", case, job, parts).lost_s <= \
                goodput.recovery("ucp_restart", case, job, parts).lost_s


def test_control_swapped_parts_turn_the_answer():
    """The in-process path wins on its parts, not by construction: given the restart's start-up as its regroup and
    the restart the in-process regroup, the order turns."""
    swapped = dataclasses.replace(PARTS, regroup_s=PARTS.startup_ucp_s, startup_ucp_s=PARTS.regroup_s)
    # one GPU lost: 2 + 3 + 1 + 1 + 22 against 1.09 + 14.78 + 1 + 24 before; a lost node's detection (1.8 s
    # against 22.3 s) would still favour the survivors
    assert goodput.recovery("ucp_inprocess", "gpu", JOB, PARTS).lost_s < \
        goodput.recovery("ucp_restart", "gpu", JOB, PARTS).lost_s
    assert goodput.recovery("ucp_inprocess", "gpu", JOB, swapped).lost_s > \
        goodput.recovery("ucp_restart", "gpu", JOB, swapped).lost_s
    assert goodput.goodput("ucp_inprocess", 5, "gpu", 1e4, JOB, swapped) != \
        goodput.goodput("ucp_inprocess", 5, "gpu", 1e4, JOB, PARTS)


def test_trace_is_seeded_and_follows_the_mtbf():
    day = 86400.0
    one = goodput.failure_trace(16384, 54 * day, seed=3)
    assert one == goodput.failure_trace(16384, 54 * day, seed=3)
    assert one != goodput.failure_trace(16384, 54 * day, seed=4)
    assert all(0 <= a < b < 54 * day for a, b in zip(one, one[1:]))
    # the Llama 3 paper's 419 in 54 days on 16,384 GPUs: a Poisson count within 4 sigma of it
    assert abs(len(one) - 419) < 4 * math.sqrt(419)
    assert goodput.MTBF_GPU_S / 3600 == pytest.approx(54 * 24 * 16384 / 419)
    assert goodput.failure_trace(1024, 0.0, seed=0) == ()


def test_unknown_tool_or_case_is_refused():
    with pytest.raises(ValueError, match="tool 'elastor' / case 'node'"):
        goodput.recovery("elastor", "node", JOB, PARTS)


def test_report_names_every_tool_and_assumption(capsys):
    assert goodput.main(["--gpus", "1024", "--models", "llama2-7b"]) == 0
    out = capsys.readouterr().out
    for tool in goodput.TOOLS:
        assert tool in out
    for field in dataclasses.fields(goodput.Parts):
        assert f"* {field.name} = " in out
    assert "arXiv:2407.21783" in out and "| llama2-7b | 1,024 | a node lost |" in out
