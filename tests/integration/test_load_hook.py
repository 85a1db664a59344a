"""Resume under a new parallelism through ucp.deepspeed: loss continuity, bypass byte counts, bad input.

Train k steps at layout A, save with DeepSpeed, convert with ucp, resume at layout B through the
hook, train m more steps; the losses must match an uninterrupted run at A over the same global
batches.
"""
from __future__ import annotations

import dataclasses

import pytest

import ucp
from support.atomic import stored_bytes, with_edited_index
from support.checkpoints import TinySpec, ucp_load_errors, ucp_resume, ucp_stats, uninterrupted_losses
from support.fp16 import needs_cpu_fp16

RESUME_STEPS = 2
CASES = [  # (saved at, resumed at)
    (TinySpec(stage=1), TinySpec(stage=1, world_size=1)),                               # DP 2 -> 1
    (TinySpec(stage=2, world_size=1), TinySpec(stage=2, world_size=3)),                 # DP 1 -> 3
    (TinySpec(stage=3, dtype="bf16", world_size=3), TinySpec(stage=3, dtype="bf16")),   # DP 3 -> 2
    (TinySpec(stage=1), TinySpec(stage=3)),                                             # ZeRO 1 -> 3
    (TinySpec(stage=3), TinySpec(stage=1)),                                             # ZeRO 3 -> 1
    (TinySpec(stage=2), TinySpec(stage=0)),                                             # ZeRO 2 -> 0
    (TinySpec(stage=0), TinySpec(stage=3, world_size=3)),                               # ZeRO 0 -> 3
    (TinySpec(stage=1), TinySpec(stage=2, dtype="bf16")),                               # fp32 -> bf16
    (TinySpec(stage=2, dtype="fp16", optimizer="Adam"),
     TinySpec(stage=1, dtype="fp16", optimizer="Adam", world_size=3)),                  # fp16, loss scale kept
]


def tolerance(source: TinySpec, target: TinySpec) -> float:
    if source.dtype == target.dtype == "fp32":
        # Another DP degree or ZeRO stage sums gradients in another order: ~1e-7 apart.
        return 1e-6
    if source.dtype == target.dtype:
        # bf16/fp16 runs at different DP degrees differ by ~1e-4 from scratch already (rounding of
        # bf16 gradients in another reduction order), so the resumed run can do no better.
        return 1e-3
    # fp32 training resumed in bf16: the forward pass now rounds to 8 mantissa bits (~4e-3).
    return 2e-2


def largest_layer_bytes(path) -> int:
    from ucp.deepspeed.loading.load import layer_of

    layers: dict[str, int] = {}
    for name, e in ucp.open_checkpoint(path).index.params.items():
        layers[layer_of(name)] = layers.get(layer_of(name), 0) + e.nbytes
    return max(layers.values())


@pytest.mark.parametrize("source,target", [needs_cpu_fp16(*c) for c in CASES], ids=lambda s: s.name)
def test_resume_continues_the_uninterrupted_run(source, target, tiny_conversion, ckpt_root):
    path = tiny_conversion(source)
    resumed = ucp_resume(path, target, RESUME_STEPS, source.steps, ckpt_root)
    straight = uninterrupted_losses(dataclasses.replace(source, steps=0), source.steps + RESUME_STEPS, ckpt_root)
    assert resumed.losses == pytest.approx(straight[source.steps:], rel=tolerance(source, target))
    # Redundancy bypassing: the data-parallel group reads the checkpoint exactly once between them.
    stats = ucp_stats(resumed)
    assert len(stats) == target.world_size
    assert sum(s["bytes_read"] - s["bytes_checked_extra"] for s in stats) == stored_bytes(path)
    # Every byte is checked, and none read only for that: the chunks where two ranks' partitions meet are
    # checked from the two parts, each rank's CRC-32 of its own (checked_read.close_chunks).
    assert sum(s["bytes_checked_extra"] for s in stats) == 0
    # Layer by layer: no rank ever held more than the largest layer's states at once.
    assert max(s["peak_layer_bytes"] for s in stats) <= largest_layer_bytes(path) < stored_bytes(path)


def test_negative_control_without_the_checkpoint_losses_differ(ckpt_root):
    """Proves the continuity check can fail: a fresh model does not continue the run."""
    source = TinySpec(stage=1)
    fresh = uninterrupted_losses(dataclasses.replace(source, steps=0), RESUME_STEPS, ckpt_root)
    straight = uninterrupted_losses(dataclasses.replace(source, steps=0), source.steps + RESUME_STEPS, ckpt_root)
    assert fresh != pytest.approx(straight[source.steps:], rel=1e-2)


def test_without_bypass_every_rank_reads_everything(tiny_conversion, ckpt_root):
    # Under ZeRO-3 every rank holds a part of every parameter, so with bypassing off each reads the
    # whole checkpoint, as stock load_universal does. (Under ZeRO-1/2 a rank skips the parameters it
    # holds no part of, as stock DeepSpeed does too.)
    source, target = TinySpec(stage=1), TinySpec(stage=3, world_size=3)
    path = tiny_conversion(source)
    resumed = ucp_resume(path, target, 1, source.steps, ckpt_root, bypass=False)
    stats = ucp_stats(resumed)
    assert [s["bytes_read"] - s["bytes_checked_extra"] for s in stats] == [stored_bytes(path)] * 3
    straight = uninterrupted_losses(dataclasses.replace(source, steps=0), source.steps + RESUME_STEPS, ckpt_root)
    assert resumed.losses == pytest.approx(straight[source.steps:source.steps + 1], rel=1e-6)


def test_bad_checkpoints_are_refused_before_the_engine_is_touched(tiny_conversion, ckpt_root, tmp_path):
    path = tiny_conversion(TinySpec(stage=1))

    def drop(index):
        del index["params"]["l1.bias"]

    def extra(index):
        index["params"]["extra.weight"] = index["params"]["l2.weight"]

    def reshape(index):
        index["params"]["l2.weight"]["shape"] = [9, 5]

    def other_optimizer(index):
        index["optimizer"]["states"] = ["momentum_buffer"]

    cases = {"missing": (drop, "l1.bias"), "extra": (extra, "extra.weight"),
             "shape": (reshape, "l2.weight"), "optimizer": (other_optimizer, "momentum_buffer")}
    dirs = [with_edited_index(path, tmp_path / label, edit) for label, (edit, _) in cases.items()]
    for target in (TinySpec(stage=2), TinySpec(stage=3)):
        results = ucp_load_errors(dirs, target, ckpt_root)
        for (label, (_, needle)), result in zip(cases.items(), results):
            assert result["error"] is not None and needle in result["error"], (label, result)
            assert result["untouched"], (label, target.name)
