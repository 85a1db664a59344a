"""ucp convert against DeepSpeed itself, on real checkpoints trained on CPU ranks.

Every comparison is `torch.equal`: conversion only moves fp32 bytes, it never computes.
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import ucp
from support.checkpoints import (
    BUFFER_SHAPES,
    FROZEN_PARAM_SHAPES,
    PARAM_GROUPS,
    TRAINABLE_PARAM_SHAPES,
    TinySpec,
    load_ds_universal,
    trained_state,
)
from support.fp16 import needs_cpu_fp16
from ucp.plan.plan import BUFFER, FROZEN, TRAINABLE

MOMENTS = ("exp_avg", "exp_avg_sq")
SPECS = [
    TinySpec(stage=1),
    TinySpec(stage=1, dtype="bf16", world_size=3),
    TinySpec(stage=2),
    TinySpec(stage=2, dtype="fp16", optimizer="Adam"),
    TinySpec(stage=3),
    TinySpec(stage=3, dtype="bf16", world_size=3),
    TinySpec(stage=1, uc_info=True),  # the model declares universal_checkpoint_info
]


@pytest.fixture(scope="module")
def converted(tiny_conversion):
    memo = {}

    def make(spec: TinySpec):
        if spec not in memo:
            memo[spec] = ucp.open_checkpoint(tiny_conversion(spec))
        return memo[spec]

    return make


@pytest.mark.parametrize("spec", [needs_cpu_fp16(s) for s in SPECS], ids=lambda s: s.name)
def test_equals_ds_to_universal(spec, converted, ds_universal):
    ckpt = converted(spec)
    reference = load_ds_universal(ds_universal(spec))
    compared = 0
    for name, states in reference.items():
        for state, expected in states.items():
            if state == "step" or (spec.stage == 3 and name not in TRAINABLE_PARAM_SHAPES):
                continue
            state_name = "value" if name in BUFFER_SHAPES else state
            got = ckpt.tensor(name, state_name)
            if spec.stage == 3:  # ds_to_universal writes plain ZeRO-3 states flat; ucp keeps real shapes
                assert got.shape == TRAINABLE_PARAM_SHAPES[name]
                got = got.reshape(-1)
            assert torch.equal(got.float(), expected), (name, state)
            compared += 1
        if "step" in states:
            assert torch.equal(ckpt.tensor(name, "step"), states["step"].float().reshape(())), name
    assert compared >= 3 * len(TRAINABLE_PARAM_SHAPES)


@pytest.mark.parametrize("spec", [needs_cpu_fp16(s) for s in SPECS], ids=lambda s: s.name)
def test_equals_live_engine_state(spec, converted, ckpt_root):
    """Against the full fp32 state the engine itself gathered right before saving."""
    ckpt = converted(spec)
    live = trained_state(spec, ckpt_root)
    assert set(live["params"]) == set(TRAINABLE_PARAM_SHAPES)
    for name, states in live["params"].items():
        for state in ("fp32", *MOMENTS):
            assert torch.equal(ckpt.tensor(name, state), states[state]), (name, state)
        assert ckpt.tensor(name, "step").item() == live["global_steps"]
    assert ckpt.step == live["global_steps"]


@pytest.mark.parametrize("spec", SPECS[:1] + SPECS[4:5], ids=lambda s: s.name)
def test_every_parameter_frozen_and_buffer_present_with_metadata(spec, converted):
    ckpt = converted(spec)
    kinds = {n: ckpt.info(n).kind for n in ckpt.names}
    assert kinds == {**{n: TRAINABLE for n in TRAINABLE_PARAM_SHAPES}, **{n: FROZEN for n in FROZEN_PARAM_SHAPES},
                     **{n: BUFFER for n in BUFFER_SHAPES}}
    for name, shape in {**TRAINABLE_PARAM_SHAPES, **FROZEN_PARAM_SHAPES, **BUFFER_SHAPES}.items():
        assert ckpt.shape(name) == shape
    groups = ckpt.optimizer["param_groups"]
    assert [g["params"] for g in groups] == [g["names"] for g in PARAM_GROUPS]
    assert [g["hyperparams"]["weight_decay"] for g in groups] == [g["weight_decay"] for g in PARAM_GROUPS]
    assert ckpt.optimizer["type"] == spec.optimizer and ckpt.optimizer["states"] == list(MOMENTS)
    assert ckpt.client_state["client_marker"] == 7
    assert ckpt.lr_scheduler is not None


def test_output_is_few_safetensors_files_and_json_only(converted):
    ckpt = converted(SPECS[0])
    files = sorted(p.name for p in ckpt.path.iterdir())
    assert files == sorted(["ucp_index.json", *ckpt.index.files])
    assert all(f.endswith(".safetensors") for f in ckpt.index.files)
    seen = 0
    for file_name in ckpt.index.files:
        with safe_open(str(ckpt.path / file_name), framework="pt") as f:
            for key in f.keys():
                name, state = key.rsplit(":", 1)
                assert torch.equal(f.get_tensor(key), ckpt.tensor(name, state))
                seen += 1
    assert seen == sum(len(e.states) for e in ckpt.index.params.values())
    assert ckpt.verify() == []


def test_planned_reader_equals_converted_output(converted, tiny_checkpoint):
    spec = SPECS[2]
    atomic, planned = converted(spec), ucp.open_checkpoint(tiny_checkpoint(spec))
    assert planned.names == atomic.names
    for name in atomic.names:
        for state in atomic.states(name):
            assert torch.equal(planned.tensor(name, state), atomic.tensor(name, state))


def test_negative_control_wrong_fragment_order_is_caught(tiny_checkpoint, ds_universal):
    """Joining the ZeRO fragments in the wrong rank order must fail the same comparison."""
    import dataclasses

    from ucp.converters.dispatch import plan_deepspeed
    from ucp.plan.assemble import materialize_tensor

    spec = SPECS[4]
    plan = plan_deepspeed(tiny_checkpoint(spec))
    reference = load_ds_universal(ds_universal(spec))
    source = plan.param("emb.weight").states["fp32"]
    assert len(source.fragments) > 1
    swapped = dataclasses.replace(source, fragments=tuple(reversed(source.fragments)))
    good = materialize_tensor(source, name="emb.weight").reshape(-1)
    bad = materialize_tensor(swapped, name="emb.weight").reshape(-1)
    assert torch.equal(good, reference["emb.weight"]["fp32"])
    assert not torch.equal(bad, reference["emb.weight"]["fp32"])
