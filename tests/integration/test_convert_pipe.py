"""Pipeline-parallel (PipelineModule, 2 stages) sources: ucp against the live engine and ds_to_universal.

ZeRO-1 in fp32 and bf16, bf16 without ZeRO (DeepSpeed's bf16 optimizer, whose files name the
parameters although the model files record no param_shapes), and fp32 without ZeRO: each stage's torch
optimizer state sits in its mp_rank file by slot position, and nothing in the checkpoint names the slots
(no param_shapes, no module, no tied-module keys, no layer-to-stage map), so the test names them as a
user would, from the live stages' `named_parameters()`, and ucp checks them against the layer files'
shapes; ds_to_universal 0.19.8 does not read ZeRO-0. The model (tests/support/train_pipe.py)
ties its embedding between the first and the last stage, so `tied_modules.embed.weight` is held by
both stages (Replicate); every other parameter lives on one stage (Unique). Every comparison is
`torch.equal`.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import ucp
from support.fragments import torch_fragment
from support.parallel import (
    PIPE,
    build_family,
    compare_with_ds_universal,
    ds_universal_of,
    reference_state,
    trainable_count,
)
from ucp.convert import convert
from ucp.converters.dispatch import plan_deepspeed
from ucp.errors import AmbiguousPatternError
from ucp.patterns import Pattern
from ucp.plan.assemble import assemble
from ucp.plan.primitives import ReplicaMismatchError

RUNS = [name for name, _ in PIPE.runs]
TIED = "tied_modules.embed.weight"
STATES = ("fp32", "exp_avg", "exp_avg_sq")


@pytest.fixture(scope="module")
def pipe(ckpt_root):
    return build_family(PIPE, ckpt_root)


def stage_names(run_dir) -> list[str]:
    """Every stage's trainable parameter names in optimizer order, stage after stage, from the live engine."""
    ranks = sorted(reference_state(run_dir)["ranks"], key=lambda r: (r["stage"], r["dp_rank"]))
    return [name for r in ranks if r["dp_rank"] == 0 for name in r["params"]]


@pytest.fixture(scope="module")
def converted(pipe, tmp_path_factory):
    memo = {}

    def make(run: str):
        if run not in memo:
            out = tmp_path_factory.mktemp("ucp-pipe") / run
            names = stage_names(pipe / run) if run == "z0-fp32" else None
            convert(pipe / run / "ckpt", out, workers=2, progress=False, strict=True, param_names=names)
            memo[run] = ucp.open_checkpoint(out)
        return memo[run]

    return make


@pytest.mark.parametrize("run", RUNS)
def test_equals_live_engine_state(run, pipe, converted):
    """Each stage's gathered fp32 master and moments, under the stage's own parameter names."""
    ckpt, live = converted(run), reference_state(pipe / run)
    stages = {r["stage"]: r["params"] for r in live["ranks"]}
    assert set(stages) == {0, 1}
    assert TIED in stages[0] and TIED in stages[1]
    names = set(stages[0]) | set(stages[1])
    assert {n for n in ckpt.names if ckpt.info(n).kind == "param"} == names
    for params in stages.values():  # the tied copy of each stage matches the one converted tensor
        for name, states in params.items():
            for state in STATES:
                assert torch.equal(ckpt.tensor(name, state), states[state]), (run, name, state)
            assert ckpt.tensor(name, "step").item() == live["global_steps"]


@pytest.mark.parametrize("run", RUNS)
def test_patterns_buffers_and_metadata(run, pipe, converted):
    ckpt = converted(run)
    tied = ckpt.index.params[TIED].pattern
    # ZeRO-1 partitions each stage's copy (flat runs); fp32 ZeRO-0 keeps it whole.
    assert tied["pattern"] == Pattern.REPLICATE.value and ("inner" not in tied if run == "z0-fp32" else
                                                           tied["inner"]["flat"])
    assert ckpt.index.params["3.weight"].pattern["pattern"] == Pattern.UNIQUE.value
    # Buffers of layers 1 and 2 (Block.scale = linspace(1, 0.5, 6) + seed), read from the layer files.
    for layer in (1, 2):
        assert ckpt.info(f"{layer}.scale").kind == "buffer"
        assert torch.equal(ckpt.tensor(f"{layer}.scale", "value"), torch.linspace(1.0, 0.5, 6) + layer)
    assert ckpt.source["pp"] == 2 and ckpt.source["tp"] == 1
    assert ckpt.index.params["1.fc1.weight"].model_dtype == ("bfloat16" if "bf16" in run else "float32")
    assert ckpt.client_state["client_marker"] == 11
    layer_files = sorted(p.name for p in (pipe / run / "ckpt").glob("*/layer_*"))
    assert layer_files[0] == ("layer_00-model_00-model_states.pt" if "topology" in run else "layer_00-model_states.pt")


@pytest.mark.parametrize("run", ["z1-fp32", "z1-bf16-topology"])
def test_equals_ds_to_universal(run, pipe, converted):
    from support.checkpoints import load_ds_universal

    ckpt, reference = converted(run), load_ds_universal(ds_universal_of(pipe / run))
    assert compare_with_ds_universal(ckpt, reference) == 4 * trainable_count(ckpt)


def test_fp32_zero0_without_names_says_why_and_what_to_do(pipe, tmp_path):
    """fp32 without ZeRO keeps the optimizer state by slot position and records no parameter names."""
    with pytest.raises(AmbiguousPatternError, match=r"global_step2: fp32 ZeRO-0 keeps each pipeline stage's optimizer "
                       r"state in mp_rank_SS_model_states.pt \(9 \+ 3 slots\) by position only, .* pass --param-names "
                       r"FILE listing every stage's trainable parameter names"):
        convert(pipe / "z0-fp32" / "ckpt", tmp_path / "out", progress=False)
    names = stage_names(pipe / "z0-fp32")
    with pytest.raises(AmbiguousPatternError,
                       match=r"--param-names lists 11 names, the 2 stages' optimizers hold 9 \+ 3"):
        convert(pipe / "z0-fp32" / "ckpt", tmp_path / "out", progress=False, param_names=names[:-1])
    with pytest.raises(AmbiguousPatternError, match=r"3.weight: optimizer slot 0 holds shape \(11, 6\), the module "
                       r"\(6,\)"):  # stage 1's first two names swapped: the layer files' shapes disagree
        convert(pipe / "z0-fp32" / "ckpt", tmp_path / "out", progress=False,
                param_names=names[:9] + [names[10], names[9], names[11]])


def test_negative_control_zero0_names_of_equal_shapes_swapped(pipe, tmp_path):
    """Naming layer 1's fc1 weight as layer 2's and back fits every shape; only the values can tell, and they
    must fail the comparison with the live engine."""
    names = stage_names(pipe / "z0-fp32")
    a, b = names.index("1.fc1.weight"), names.index("2.fc1.weight")
    names[a], names[b] = names[b], names[a]
    convert(pipe / "z0-fp32" / "ckpt", tmp_path / "out", progress=False, param_names=names)
    ckpt, live = ucp.open_checkpoint(tmp_path / "out"), reference_state(pipe / "z0-fp32")["ranks"]
    expected = next(r for r in live if r["stage"] == 0)["params"]["1.fc1.weight"]["exp_avg"]
    assert ckpt.tensor("1.fc1.weight", "exp_avg").shape == expected.shape
    assert not torch.equal(ckpt.tensor("1.fc1.weight", "exp_avg"), expected)


def test_strict_checks_the_tied_copies(pipe):
    """The stages' copies of a tied weight are compared under --strict; a diverged copy is an error."""
    source = plan_deepspeed(pipe / "z1-fp32" / "ckpt").param(TIED).states["fp32"]
    assert source.groups == (1, 1)
    pieces = [torch_fragment(f) for f in source.fragments]
    assert torch.equal(assemble(source, pieces, name=TIED, strict=True),
                       reference_state(pipe / "z1-fp32")["ranks"][0]["params"][TIED]["fp32"])
    pieces[1] = pieces[1].clone()
    pieces[1][3] += 1.0
    with pytest.raises(ReplicaMismatchError, match=TIED):
        assemble(source, pieces, name=TIED, strict=True)


def test_negative_control_replicate_for_unique_parameters(pipe):
    """Declaring two stage-local parameters replicas of one another (a wrong pattern) must fail both checks."""
    plan = plan_deepspeed(pipe / "z1-fp32" / "ckpt")
    live = reference_state(pipe / "z1-fp32")["ranks"][0]["params"]
    first, second = plan.param("1.fc1.weight").states["fp32"], plan.param("2.fc1.weight").states["fp32"]
    spec = dataclasses.replace(first.spec, pattern=Pattern.REPLICATE, inner=first.spec,
                               shard_shapes=((10, 6), (10, 6)))
    wrong = dataclasses.replace(first, spec=spec, fragments=first.fragments + second.fragments, groups=(1, 1))
    pieces = [torch_fragment(f) for f in wrong.fragments]
    assert not torch.equal(assemble(wrong, pieces, name="2.fc1.weight"), live["2.fc1.weight"]["fp32"])
    with pytest.raises(ReplicaMismatchError):
        assemble(wrong, pieces, name="2.fc1.weight", strict=True)
