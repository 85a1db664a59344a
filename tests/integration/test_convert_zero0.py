"""ZeRO-0 sources: the optimizer lives in the model file, keyed by position; names are recovered."""
from __future__ import annotations

import pytest
import torch

import ucp
from support.checkpoints import FROZEN_PARAM_SHAPES, PARAM_GROUPS, TinySpec, trained_state
from ucp.convert import convert
from ucp.errors import AmbiguousPatternError


@pytest.mark.parametrize("spec", [TinySpec(stage=0), TinySpec(stage=0, dtype="bf16")], ids=lambda s: s.name)
def test_zero0_equals_live_engine_state(spec, tiny_checkpoint, ckpt_root, tmp_path):
    convert(tiny_checkpoint(spec), tmp_path / "out", workers=1, progress=False)
    ckpt = ucp.open_checkpoint(tmp_path / "out")
    live = trained_state(spec, ckpt_root)
    # Reference 1: what torch.load makes of DeepSpeed's file, slot by slot in optimizer order.
    saved = torch.load(next(tiny_checkpoint(spec).glob("*/mp_rank_00_model_states.pt")), weights_only=False)
    optimizer = saved["optimizer"]
    state = optimizer.get("optimizer_state_dict", optimizer)["state"]
    masters = [t for group in optimizer.get("fp32_groups", []) for t in group]
    order = [n for g in PARAM_GROUPS for n in g["names"]]
    for slot, name in enumerate(order):
        for moment in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ckpt.tensor(name, moment), state[slot][moment]), (name, moment)
        if masters:
            assert torch.equal(ckpt.tensor(name, "fp32"), masters[slot]), name
    # Reference 2: the live engine's own gathered state: its fp32 master where the harness can reach
    # one, else (DeepSpeed's gather helper under bf16 ZeRO-0) the bf16 weight the master rounds to.
    for name, states in live["params"].items():
        weight = ckpt.tensor(name, "fp32")
        candidates = [weight, weight.bfloat16().float()] if masters else [weight]
        assert any(torch.equal(c, states["fp32"]) for c in candidates), name
    assert [g["params"] for g in ckpt.optimizer["param_groups"]] == [g["names"] for g in PARAM_GROUPS]
    assert {n for n in ckpt.names if ckpt.info(n).kind == "frozen"} == set(FROZEN_PARAM_SHAPES)


def test_zero0_wrong_names_are_refused(tiny_checkpoint, tmp_path):
    """Naming the optimizer's slots wrongly (a negative control for name recovery) is an error, not a guess."""
    names = [n for g in PARAM_GROUPS for n in g["names"]]
    names[0], names[1] = names[1], names[0]
    with pytest.raises(AmbiguousPatternError, match="check --param-names"):
        convert(tiny_checkpoint(TinySpec(stage=0)), tmp_path / "out", progress=False, param_names=names)
