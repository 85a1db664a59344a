"""`ucp convert --format deepspeed`: DeepSpeed's own universal layout, resumed by stock DeepSpeed."""
from __future__ import annotations

import dataclasses

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
