"""Elastic MoE training under torchrun's own agents (issue #28): train_moe.py's model with a native DeepSpeed MoE
layer (4 experts, ep_size 2) and `"elastic": {..., "expert_parallel": 2}` (support/train_moe_elastic.py) loses a
node and gets it back. D stays a multiple of the ep_size: 4 ranks train D=4, the 3 left D=2 with a spare, then D=4
again; each restart loads the experts under their global ids. Every step's loss is the uninterrupted run's."""
from __future__ import annotations

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

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "train_moe_elastic.py"
STEPS = 6
# fp32: each micro-batch is routed on its own rank whatever D is, so a sample's loss and gradient are the same at
# every layout; D changes the order in which DeepSpeed sums the gradients (and the gradient-accumulation count),
# so the losses agree to rounding, not bit for bit.
RTOL = 1e-6


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """The uninterrupted 4-rank run (D=4), without ucp's saves."""
    tmp = tmp_path_factory.mktemp("reference-moe")
    run_torchrun(SCRIPT, ["--save-dir", tmp / "unused", "--steps", STEPS, "--stock", "--losses-out",
                          tmp / "losses.jsonl"], 4, tmp / "log")
    assert {r["dp"] for r in read_losses(tmp / "losses.jsonl")} == {4}
    return first_losses(tmp / "losses.jsonl")


def test_an_moe_job_loses_a_node_then_gets_it_back(tmp_path, reference):
    losses = tmp_path / "losses.jsonl"
    # 4 ranks: D=4; 3 ranks: D=2 (a multiple of ep_size 2) and a spare; a node back: D=4 again
    logs = lose_a_node_then_get_it_back(SCRIPT, ["--save-dir", tmp_path / "ckpt", "--steps", STEPS, "--every", 1,
                                                 "--losses-out", losses], tmp_path / "agents", losses)
    records = read_losses(losses)
    assert {(r["world"], r["dp"]) for r in records} == {(4, 4), (3, 2)}
    assert_continues_the_run(records, reference, STEPS, RTOL)
    assert "ucp: 3 ranks: tensor_parallel 1 x pipeline_parallel 1 x data_parallel 2, 1 spare(s)" in logs
    assert "ucp: restart 4 -> 2 ranks: loaded" in logs and "ucp: restart 2 -> 4 ranks: loaded" in logs
