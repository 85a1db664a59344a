"""Heterogeneous restarts in the elastic loop (issue #30, item 5): examples/hmp/train.py --elastic under torchrun's
own agents, `"elastic": {"tensor_parallel": [2], "heterogeneous": true}`. 4 ranks take two TP-2 replicas; a lost
node leaves 3, which no TP-2 layout uses without a spare, so they take one TP-2 and one TP-1 replica (5 and 3
samples of each global batch of 8, by the cost model's speeds), trained by the HMP sync and loaded by the layout;
a node joins and the job goes back to TP 2 x 2, loading the save made at TP 2 + 1. Every step's loss is the
uninterrupted run's. The negative control of the sync (unweighted replicas diverge) is test_hmp_train's; that
of the choice (heterogeneous off leaves a spare) is tests/unit/test_elastic_layout.py's.

With the model's shape (`--model examples/hmp/model.json`) and two pipeline stages allowed, every start takes the
layout the cost model chooses: 4 ranks a TP 2 x PP 2 pipeline, 3 ranks the plan `ucp plan --gpus 3` prints first
(one replica, a TP-1 stage then a TP-2 stage), trained through the pipeline and loaded between the layouts."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.elastic_agents import (
    assert_continues_the_run,
    first_losses,
    lose_a_node_then_get_it_back,
    read_losses,
)
from support.launch import run_torchrun

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hmp" / "train.py"
MODEL = EXAMPLE.parent / "model.json"
STEPS = 8
ARGS = ["--elastic", "--tp-sizes", "2", "--deepspeed", "--zero", "1", "--global-batch", "8", "--steps", STEPS]
# fp32: the layouts sum the same gradients in another order (TP's partial sums, the replicas' weighted shares against
# equal ones), a few ulps a step; test_hmp_train measured at most 3e-7 relative over 12 AdamW steps.
RTOL = 1e-6


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted run of the same model, global batch and sample order in one process (plain AdamW, no
    DeepSpeed): what every layout must train, to rounding. Cheaper than an uninterrupted 4-rank run, and a stronger
    check (test_hmp_train shows DeepSpeed's HMP and homogeneous engines train its losses)."""
    tmp = tmp_path_factory.mktemp("reference-hmp-elastic")
    run_torchrun(EXAMPLE, ["--tp-sizes", "1", "--global-batch", "8", "--steps", STEPS,
                           "--losses-out", tmp / "losses.jsonl"], 1, tmp / "log")
    return first_losses(tmp / "losses.jsonl")


def test_a_lost_node_trains_on_unequal_replicas_then_goes_back(tmp_path, reference):
    from ucp.checkpoint import open_checkpoint

    losses, ckpt = tmp_path / "losses.jsonl", tmp_path / "ckpt"
    # 4 ranks: TP 2 x 2; 3 ranks: TP 2 + TP 1, no spare; a node back: TP 2 x 2 again
    logs = lose_a_node_then_get_it_back(EXAMPLE, [*ARGS, "--save-dir", ckpt, "--losses-out", losses],
                                        tmp_path / "agents", losses, on_three=5)
    records = read_losses(losses)
    assert {(r["world"], tuple(r["tp"])) for r in records} == {(4, (2, 2)), (3, (2, 1))}
    assert_continues_the_run(records, reference, STEPS, RTOL)
    hmp = "heterogeneous tensor_parallel 2 + 1 (one replica each, batch shares 5 + 3)"
    assert f"ucp: 3 ranks: {hmp}" in logs and "is a spare" not in logs
    assert f"ucp: restart 4 -> 3 ranks: loaded {ckpt}/global_step" in logs and f"layout {hmp}" in logs
    assert "ucp: restart 3 -> 4 ranks: loaded" in logs
    assert "layout tensor_parallel 2 x pipeline_parallel 1 x data_parallel 2" in logs
    # The saves record the layout that wrote them: a step first logged on 3 ranks, then the last one (on 4).
    at_three = min(r["step"] for r in records if r["world"] == 3)
    for step, tp_sizes in ((at_three, [2, 1]), (STEPS, [2, 2])):
        saved = open_checkpoint(ckpt / f"global_step{step}")
        assert saved.verify() == []
        assert [len(r["stages"][0]["ranks"]) for r in saved.source["layout"]["replicas"]] == tp_sizes, step
        assert saved.training["global_samples"] == step * 8   # B per step at every layout


def test_the_memory_tier_carries_the_restarts_through_the_hmp_layout(tmp_path, reference):
    """The same trace with the memory tier every step and the disk tier only at the last step: the restart to 3 ranks
    loads the memory checkpoint of TP 2 x 2 into TP 2 + 1, the one back to 4 ranks the memory checkpoint saved from
    TP 2 + 1, and every step's loss is the uninterrupted run's."""
    losses, ckpt, memory = tmp_path / "losses.jsonl", tmp_path / "ckpt", tmp_path / "memory"
    logs = lose_a_node_then_get_it_back(EXAMPLE, [*ARGS, "--save-dir", ckpt, "--save-every", STEPS, "--memory-every", 1,
                                                  "--memory-dir", memory, "--losses-out", losses],
                                        tmp_path / "agents", losses, on_three=5)
    records = read_losses(losses)
    assert {(r["world"], tuple(r["tp"])) for r in records} == {(4, (2, 2)), (3, (2, 1))}
    assert_continues_the_run(records, reference, STEPS, RTOL)
    # Negative control: the disk tier holds no step before the last, so a restart that did not load from memory
    # would have started over, and failed the losses above.
    assert sorted(p.name for p in ckpt.glob("global_step*")) == [f"global_step{STEPS}"]
    loaded = {}
    for line in logs.splitlines():
        for restart in ("4 -> 3", "3 -> 4"):
            if f"ucp: restart {restart} ranks: loaded {memory}/global_step" in line:
                loaded[restart] = int(line.split(f"{memory}/global_step", 1)[1].split(" ", 1)[0])
    assert set(loaded) == {"4 -> 3", "3 -> 4"}, logs[-4000:]
    assert loaded["3 -> 4"] in {r["step"] for r in records if r["world"] == 3}  # saved from TP 2 + 1


def test_with_the_models_shape_each_start_takes_ucp_plans_plan_pipelines_included(tmp_path, reference):
    from ucp.checkpoint import open_checkpoint
    from ucp.hmp.layout import Layout

    printed = subprocess.run([sys.executable, "-m", "ucp.cli.main", "plan", "--gpus", "3", "--model", MODEL,
                              "--gpu-memory", "4", "--global-batch", "8", "--seq-len", "8", "--tp-max", "2", "--json"],
                             capture_output=True, text=True, timeout=120, check=True)
    first = Layout.from_json(json.loads(printed.stdout)["plans"][0]["layout"])
    planned = [[[s.tp, *s.layers] for s in r.stages] for r in first.replicas]
    assert any(len(r) > 1 for r in planned)   # the premise: ucp plan's plan for 3 ranks has a pipeline
    losses, ckpt = tmp_path / "losses.jsonl", tmp_path / "ckpt"
    logs = lose_a_node_then_get_it_back(EXAMPLE, [*ARGS, "--model", MODEL, "--pipeline-parallel", "2,1", "--save-dir",
                                                  ckpt, "--losses-out", losses], tmp_path / "agents", losses,
                                        on_three=5)
    records = read_losses(losses)
    pipeline = [[[2, 0, 1], [2, 1, 2]]]   # TP 2 x PP 2: layer 0 on ranks 0-1, layer 1 (and the head) on ranks 2-3
    assert {(r["world"], json.dumps(r["stages"])) for r in records} == {(4, json.dumps(pipeline)),
                                                                       (3, json.dumps(planned))}
    assert_continues_the_run(records, reference, STEPS, RTOL)
    assert "ucp: 3 ranks: heterogeneous replicas TP1 | TP2" in logs and "is a spare" not in logs
    assert "layout tensor_parallel 2 x pipeline_parallel 2 x data_parallel 1" in logs
    at_three = min(r["step"] for r in records if r["world"] == 3)
    saved = open_checkpoint(ckpt / f"global_step{at_three}")
    assert saved.verify() == []
    assert Layout.from_json(saved.source["layout"]).replicas[0].stages == first.replicas[0].stages
