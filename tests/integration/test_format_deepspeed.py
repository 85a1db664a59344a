"""`ucp convert --format deepspeed`: DeepSpeed's own universal layout, resumed by stock DeepSpeed."""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from support.checkpoints import TinySpec, load_ds_universal, read_tag, resume_losses, uninterrupted_losses
from ucp.convert import convert

CASES = [  # (saved with, resumed by stock DeepSpeed at)
    (TinySpec(stage=1), TinySpec(stage=2, world_size=3)),
    (TinySpec(stage=3, dtype="bf16", world_size=3), TinySpec(stage=3, dtype="bf16", world_size=2)),
]
RESUME_STEPS = 2


@pytest.mark.parametrize("source,target", CASES, ids=lambda s: s.name)
def test_stock_deepspeed_resumes_like_from_ds_to_universal(source, target, tiny_checkpoint, ds_universal,
                                                          ckpt_root, tmp_path):
    save_dir = tiny_checkpoint(source)
    tag = read_tag(save_dir)
    ours = tmp_path / "universal" / tag
    convert(save_dir, ours, fmt="deepspeed", workers=2, progress=False)
    theirs = ds_universal(source)

    # Same tensors, file for file, as DeepSpeed's converter wrote.
    mine, reference = load_ds_universal(ours), load_ds_universal(theirs)
    assert set(reference) <= set(mine)
    for name, states in reference.items():
        assert set(states) == set(mine[name]), name
        for state, tensor in states.items():
            assert torch.equal(mine[name][state], tensor), (name, state)

    ours_losses = resume_losses(ours.parent, tag, target, RESUME_STEPS, source.steps, ckpt_root)
    theirs_losses = resume_losses(theirs.parent, theirs.name, target, RESUME_STEPS, source.steps, ckpt_root)
    assert ours_losses == theirs_losses  # identical state in, identical computation out
    straight = uninterrupted_losses(dataclasses.replace(source, steps=0), source.steps + RESUME_STEPS, ckpt_root)
    # A different DP degree sums gradients in another order: equal within fp32 (bf16: bf16) rounding.
    tolerance = 1e-6 if source.dtype == "fp32" else 1e-2
    assert ours_losses == pytest.approx(straight[source.steps:], rel=tolerance)


# What stock load_universal reads from zero/optimizer_state.pt (deepspeed/runtime/base_optimizer.py,
# zero/stage_1_and_2.py `_load_global_state`, zero/stage3.py `load_hp_checkpoint_state_from_checkpoint_dir_stage3`).
READ_BY_LOAD_UNIVERSAL = {  # by ZeRO family: 1 for stages 1 and 2, 3 for stage 3
    1: {"loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad", "ds_version", "param_groups"},
    3: {"loss_scaler", "dynamic_loss_scale", "overflow", "optimizer_state_dict"},
}


def same(a, b) -> bool:
    """Deep equality of plain data, tensors (torch.equal) and objects (their fields)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return type(a) is type(b) and same(vars(a), vars(b))
    return a == b


def zero3_read(sd: dict) -> dict:
    """The part of a ZeRO-3 optimizer_state.pt that stage 3's load_universal reads."""
    inner = sd["optimizer_state_dict"]
    return {"state": {i: {"step": s["step"]} for i, s in inner["state"].items()}, "param_groups": inner["param_groups"]}


@pytest.mark.parametrize("source", [source for source, _ in CASES], ids=lambda s: s.name)
def test_optimizer_state_is_what_load_universal_reads(source, tiny_checkpoint, ds_universal, tmp_path):
    save_dir = tiny_checkpoint(source)
    ours = tmp_path / "universal" / read_tag(save_dir)
    convert(save_dir, ours, fmt="deepspeed", workers=1, progress=False)
    mine = torch.load(ours / "zero" / "optimizer_state.pt", weights_only=False)  # both files are trusted here
    theirs = torch.load(ds_universal(source) / "zero" / "optimizer_state.pt", weights_only=False)
    wanted = READ_BY_LOAD_UNIVERSAL[3 if source.stage == 3 else 1]
    assert set(mine) == wanted
    for key in wanted - {"optimizer_state_dict"}:
        assert same(mine[key], theirs[key]), key
    if source.stage == 3:
        assert same(mine["optimizer_state_dict"], zero3_read(theirs))
    # Negative control: a changed hyper-parameter is told apart.
    groups = theirs["param_groups"]
    assert not same(groups, [{**groups[0], "lr": groups[0]["lr"] * 2}, *groups[1:]])


def test_dynamic_loss_scaler_is_rebuilt(tiny_checkpoint, tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    # fp16 does not train on every CPU: put an fp16 run's scaler, mid-training, into a real ZeRO-1 file.
    source = tmp_path / "src"
    shutil.copytree(tiny_checkpoint(TinySpec(stage=1)), source)
    rank0 = source / read_tag(source) / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    scaler = DynamicLossScaler(init_scale=2.0 ** 16, scale_window=1000, min_scale=1, delayed_shift=2,
                               consecutive_hysteresis=False)
    scaler.cur_scale, scaler.cur_iter, scaler.last_overflow_iter, scaler.cur_hysteresis = 4096.0, 17, 9, 1
    sd = torch.load(rank0, weights_only=False)
    sd["optimizer_state_dict"]["loss_scaler"] = scaler
    torch.save(sd, rank0)
    out = tmp_path / "universal" / read_tag(source)
    convert(source, out, fmt="deepspeed", workers=1, progress=False)
    rebuilt = torch.load(out / "zero" / "optimizer_state.pt", weights_only=False)["loss_scaler"]
    assert type(rebuilt) is DynamicLossScaler and vars(rebuilt) == vars(scaler)
    assert rebuilt.loss_scale == 4096.0
