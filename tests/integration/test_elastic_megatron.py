"""Elastic Megatron-style TP x PP training under torchrun's own agents (issue #28): a tiny GPT with an `mpu` for
tensor parallelism inside a `PipelineModule` (support/train_megatron_elastic.py), `"tensor_parallel": [2, 1],
"pipeline_parallel": [2, 1]`, global batch 4 in micro-batches of 1, loses a node and gets it back; every step's loss
is the uninterrupted run's.

The layouts `ucp.elastic.layout_choice` picks, given the model's shape (`"model"`, `"seq_len"`):
* 4 ranks: T=2 x P=2 x D=1. Every layout of 4 ranks uses all of them, so the cost model's step time decides, and
  for this model it is the shortest.
* 3 ranks: T=2 x P=1 x D=1 and one spare. T=1 x P=1 x D=3, the one layout that would use all 3, cannot share the
  batch (4 samples over 3 ranks: some would run fewer micro-batches of 1 sample than others); of the 2-rank
  layouts the cost model prefers T=2 over P=2.

The same layers in a plain module with the `mpu` passed to `initialize` (no PipelineModule, `--no-pipeline`),
`"tensor_parallel": 2, "pipeline_parallel": 1`: T=2 x D=2 on 4 ranks, T=2 x D=1 and a spare on 3, T=2 x D=2 again.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from support.elastic_agents import (
    assert_continues_the_run,
    assert_stock_resume_is_not_the_run,
    first_losses,
    lose_a_node_then_get_it_back,
    read_losses,
)
from support.launch import run_torchrun

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "train_megatron_elastic.py"
STEPS = 6
# fp32, no dropout, one data-parallel replica in every layout: the same micro-batches in the same order; P=1 and
# P=2 run the same arithmetic, so the losses agree to rounding (bit-equal here, 1e-6 allowed as for AutoTP).
RTOL = 1e-6


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict[int, float], Path]:
    """The uninterrupted 4-rank run (T=2 x P=2), DeepSpeed saving every step (for the negative control)."""
    tmp = tmp_path_factory.mktemp("reference-megatron")
    run_torchrun(SCRIPT, ["--save-dir", tmp / "ds", "--steps", STEPS, "--stock", "--losses-out", tmp / "losses.jsonl"],
                 4, tmp / "log")
    assert {(r["tp"], r["pp"], r["dp"]) for r in read_losses(tmp / "losses.jsonl")} == {(2, 2, 1)}
    return first_losses(tmp / "losses.jsonl"), tmp / "ds"


def test_tp_x_pp_loses_a_node_then_gets_it_back(tmp_path, reference):
    losses = tmp_path / "losses.jsonl"
    # 4 ranks: T=2 x P=2 x D=1; 3 ranks: T=2 x P=1 x D=1 and a spare; a node back: T=2 x P=2 x D=1 again
    logs = lose_a_node_then_get_it_back(SCRIPT, ["--save-dir", tmp_path / "ckpt", "--steps", STEPS, "--every", 1,
                                                 "--losses-out", losses], tmp_path / "agents", losses)
    records = read_losses(losses)
    assert {(r["world"], r["tp"], r["pp"], r["dp"]) for r in records} == {(4, 2, 2, 1), (3, 2, 1, 1)}
    assert_continues_the_run(records, reference[0], STEPS, RTOL)
    assert "ucp: 3 ranks: tensor_parallel 2 x pipeline_parallel 1 x data_parallel 1, 1 spare(s)" in logs
    assert "of 3 is a spare" in logs
    # Each restart's report (a pipeline engine steps in train_batch, which ucp's bookkeeping wraps): 4 training ranks
    # -> 2 (and the spare) -> 4.
    assert "ucp: restart 4 -> 2 ranks: loaded" in logs and "ucp: restart 2 -> 4 ranks: loaded" in logs


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted 4-rank run of the plain module (T=2 x D=2), without ucp's saves."""
    tmp = tmp_path_factory.mktemp("reference-megatron-plain")
    run_torchrun(SCRIPT, ["--no-pipeline", "--save-dir", tmp / "ds", "--steps", STEPS, "--stock", "--losses-out",
                          tmp / "losses.jsonl"], 4, tmp / "log")
    assert {(r["tp"], r["pp"], r["dp"]) for r in read_losses(tmp / "losses.jsonl")} == {(2, 1, 2)}
    return first_losses(tmp / "losses.jsonl")


def test_an_mpu_without_a_pipeline_loses_a_node_then_gets_it_back(tmp_path, plain_reference):
    """Elastic restarts of a Megatron-style mpu in a plain module: the layout follows the ranks, each restart
    loads the last save by its TP boxes (`ucp.deepspeed.loading.mpu`), and every step's loss is the uninterrupted
    run's (D changes 2 -> 1 -> 2: the gradient's sum runs in another order, hence RTOL rather than equality)."""
    losses = tmp_path / "losses.jsonl"
    # 4 ranks: T=2 x D=2; 3 ranks: T=2 x D=1 and a spare; a node back: T=2 x D=2 again
    logs = lose_a_node_then_get_it_back(SCRIPT, ["--no-pipeline", "--save-dir", tmp_path / "ckpt", "--steps", STEPS,
                                                 "--every", 1, "--losses-out", losses], tmp_path / "agents", losses)
    records = read_losses(losses)
    assert {(r["world"], r["tp"], r["pp"], r["dp"]) for r in records} == {(4, 2, 1, 2), (3, 2, 1, 1)}
    assert_continues_the_run(records, plain_reference, STEPS, RTOL)
    assert "ucp: 3 ranks: tensor_parallel 2 x pipeline_parallel 1 x data_parallel 1, 1 spare(s)" in logs
    assert "ucp: restart 4 -> 2 ranks: loaded" in logs and "ucp: restart 2 -> 4 ranks: loaded" in logs


def test_without_ucp_a_resume_at_another_layout_is_not_the_run(tmp_path, reference):
    """Negative control: DeepSpeed's own load_checkpoint of the reference's T=2 x P=2 step-3 checkpoint on 3 ranks
    (T=2 x P=1 and a spare, the same batches) does not continue the uninterrupted run."""
    assert_stock_resume_is_not_the_run(SCRIPT, reference[1], reference[0], 3, tmp_path)
