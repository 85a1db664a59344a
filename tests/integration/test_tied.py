"""Tied weights (the tiny model with `head.weight` the very Parameter `emb.weight`, as GPT-2 or Llama with
`tie_word_embeddings`): every path records `head.weight` once, as an alias of `emb.weight`.

Converted ZeRO-0/1/2/3 checkpoints hold the same parameters and the alias, equal to DeepSpeed's own
`zero_to_fp32`; strict loading resumes the tied model; an asynchronous save equals `ucp convert` of
DeepSpeed's save of the same step; `--format deepspeed` writes for the alias what `ds_to_universal`
writes; and the mismatch rules of `ucp.deepspeed.load` (tied checkpoint into an untied
model, untied checkpoint into a tied one) hold, each with a negative control.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import ucp
from support.atomic import assert_same_checkpoint, stored_bytes, with_added_param, with_edited_index
from support.checkpoints import (
    TinySpec,
    load_ds_universal,
    read_tag,
    trained_losses,
    trained_state,
    ucp_load_errors,
    ucp_resume,
    ucp_save_run,
    ucp_stats,
    uninterrupted_losses,
)
from ucp.cli.main import main as cli_main
from ucp.convert import convert
from ucp.converters.deepspeed.slices import load_dict, tied_aliases
from ucp.deepspeed.engine.targets import module_aliases

ALIASES = {"head.weight": "emb.weight"}
TRAINABLE = {"emb.weight", "l1.weight", "l1.bias", "l2.weight", "l2.bias", "head.bias", "gain"}
UNTRAINED = {"proj.weight", "pos_scale"}
MOMENTS = ("exp_avg", "exp_avg_sq")
SOURCES = [TinySpec(stage=0, tie="tied"), TinySpec(stage=1, dtype="bf16", tie="tied"),
           TinySpec(stage=2, tie="tied"), TinySpec(stage=3, tie="tied")]
RESUMED_AT = {  # source stage -> where it resumes (another ZeRO family, or DP degree)
    0: TinySpec(stage=3, tie="tied"), 1: TinySpec(stage=2, dtype="bf16", tie="tied"),
    2: TinySpec(stage=1, world_size=1, tie="tied"), 3: TinySpec(stage=0, tie="tied")}
RESUME_STEPS, SAVE_EVERY = 2, 3
SAVED = TinySpec(stage=2, tie="tied")  # saved asynchronously too; its run is the uninterrupted fp32 run


# -- finding aliases, without DeepSpeed ---------------------------------------------------------------

def test_aliases_come_from_shared_params_and_from_storage_the_module_shares(tmp_path):
    weight, placeholder = torch.randn(3, 2), torch.empty(0)
    torch.save({"module": {"emb": weight, "head": weight, "other": weight.clone(), "z3.a": placeholder,
                           "z3.b": placeholder}, "shared_params": {"listed": "emb"}}, tmp_path / "model.pt")
    # "head" shares emb's bytes (torch.save keeps the sharing, as ZeRO-0 files do, which list no shared_params);
    # equal values are no alias, and ZeRO-3's empty placeholders share nothing.
    assert tied_aliases(load_dict(tmp_path / "model.pt")) == {"listed": "emb", "head": "emb"}


def test_module_aliases_name_each_parameter_held_twice_as_deepspeed_does():
    module = torch.nn.Sequential(torch.nn.Embedding(4, 3), torch.nn.Linear(3, 4, bias=False))
    assert module_aliases(module) == {}
    module[1].weight = module[0].weight
    assert module_aliases(module) == {"1.weight": "0.weight"}


# -- real DeepSpeed runs --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def async_run(ckpt_root):
    """SAVED's model trained from scratch for its steps + RESUME_STEPS, saving with ucp every SAVE_EVERY steps."""
    return ucp_save_run(dataclasses.replace(SAVED, steps=0), SAVED.steps + RESUME_STEPS, SAVE_EVERY, ckpt_root)


def _reference(spec: TinySpec, save_dir, ckpt_root) -> dict[str, dict[str, torch.Tensor]]:
    """DeepSpeed's own full fp32 state: `zero_to_fp32` (weights, alias included) for ZeRO-1/2/3; ZeRO-0,
    which it does not read, keeps fp32 weights in the module itself: the live engine's gathered state."""
    live = trained_state(spec, ckpt_root)["params"]
    if spec.stage == 0:
        return {**live, "head.weight": live["emb.weight"]}
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    weights = get_fp32_state_dict_from_zero_checkpoint(str(save_dir))
    return {name: {"fp32": weights[name], **{m: live[ALIASES.get(name, name)][m] for m in MOMENTS}}
            for name in TRAINABLE | set(ALIASES)}


@pytest.mark.parametrize("spec", SOURCES, ids=lambda s: s.name)
def test_a_tied_weight_is_recorded_once_as_an_alias_equal_to_zero_to_fp32(spec, tiny_conversion, tiny_checkpoint,
                                                                           ckpt_root):
    ckpt = ucp.open_checkpoint(tiny_conversion(spec))
    assert ckpt.index.aliases == ckpt.aliases == ALIASES
    # The same parameters whatever the ZeRO stage: no frozen copy of the alias, no data of its own.
    assert set(ckpt.names) == TRAINABLE | UNTRAINED
    assert {n for n in ckpt.names if ckpt.info(n).kind == "param"} == TRAINABLE
    assert not any(s.key.startswith("head.weight:") for e in ckpt.index.params.values() for s in e.states.values())
    assert ckpt.verify() == []
    reference = _reference(spec, tiny_checkpoint(spec), ckpt_root)
    for name, states in reference.items():
        for state, tensor in states.items():
            assert torch.equal(ckpt.tensor(name, state), tensor), (name, state)
    # Read through the plan, the DeepSpeed checkpoint shows the same alias and values.
    planned = ucp.open_checkpoint(tiny_checkpoint(spec))
    assert planned.aliases == ALIASES and set(planned.names) == set(ckpt.names)
    assert torch.equal(planned.tensor("head.weight", "exp_avg"), ckpt.tensor("emb.weight", "exp_avg"))


def test_negative_control_the_module_copy_of_a_bf16_alias_is_not_its_weight(tiny_checkpoint, ckpt_root):
    """What the converters recorded before (the alias as a frozen parameter, read from the module) fails
    the check above under bf16: the module holds the bf16 copy, not the fp32 master."""
    spec = SOURCES[1]
    save_dir = tiny_checkpoint(spec)
    module = torch.load(next(save_dir.glob("*/mp_rank_00_model_states.pt")), weights_only=False)["module"]
    assert module["head.weight"].dtype == torch.bfloat16
    assert not torch.equal(module["head.weight"].float(), _reference(spec, save_dir, ckpt_root)["head.weight"]["fp32"])


def test_inspect_shows_the_alias(tiny_conversion, capsys):
    assert cli_main(["inspect", str(tiny_conversion(SAVED))]) == 0
    assert "alias  head.weight -> emb.weight" in capsys.readouterr().out


def test_format_deepspeed_writes_for_the_alias_what_ds_to_universal_writes(tiny_checkpoint, ds_universal,
                                                                             tmp_path):
    # ds_to_universal (ZeRO-1/2) writes zero/head.weight/fp32.pt only, from the module's copy (stock
    # load_universal never reads it); under fp32 that copy is the weight itself.
    save_dir = tiny_checkpoint(SAVED)
    ours = tmp_path / "universal" / read_tag(save_dir)
    convert(save_dir, ours, fmt="deepspeed", workers=1, progress=False)
    mine, theirs = load_ds_universal(ours), load_ds_universal(ds_universal(SAVED))
    assert set(theirs) <= set(mine) and set(mine["head.weight"]) == set(theirs["head.weight"]) == {"fp32"}
    for name, states in theirs.items():
        assert all(torch.equal(mine[name][s], t) for s, t in states.items()), name
    assert torch.equal(mine["head.weight"]["fp32"], mine["emb.weight"]["fp32"])


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.name)
def test_strict_resume_of_the_tied_model_continues_the_uninterrupted_run(source, tiny_conversion, async_run, ckpt_root):
    path = tiny_conversion(source)
    target = RESUMED_AT[source.stage]
    resumed = ucp_resume(path, target, RESUME_STEPS, source.steps, ckpt_root)
    if source.dtype == "fp32":
        # The run that saved asynchronously (ZeRO-2, DP 2) is the uninterrupted fp32 run; other ZeRO stages and
        # DP degrees sum gradients in another order, ~1e-7 apart (as in test_load_hook).
        straight, tolerance = async_run.losses, 1e-6
    else:
        # bf16 runs at another ZeRO stage differ by ~1e-4 from scratch already (test_load_hook.tolerance).
        straight = uninterrupted_losses(dataclasses.replace(source, steps=0), source.steps + RESUME_STEPS, ckpt_root)
        tolerance = 1e-3
    assert resumed.losses == pytest.approx(straight[source.steps:], rel=tolerance)
    # The alias is read as its source, once: the group reads the checkpoint's bytes exactly once.
    assert sum(s["bytes_read"] - s["bytes_checked_extra"] for s in ucp_stats(resumed)) == stored_bytes(path)


def test_an_async_save_of_the_tied_model_equals_converting_deepspeeds_save(async_run, tiny_conversion, ckpt_root,
                                                                            tmp_path):
    # Saving does not disturb training: the first steps are DeepSpeed's own run's, to the bit.
    assert async_run.losses[:SAVED.steps] == trained_losses(SAVED, ckpt_root)
    saved = ucp.open_checkpoint(async_run.save_dir / f"global_step{SAVED.steps}")
    assert saved.aliases == ALIASES and saved.verify() == []
    assert_same_checkpoint(saved, ucp.open_checkpoint(tiny_conversion(SAVED)))
    # Negative control: the same conversion without its alias must fail the same comparison.
    bare = with_edited_index(tiny_conversion(SAVED), tmp_path / "bare", lambda index: index.update(aliases={}))
    with pytest.raises(AssertionError, match="aliases"):
        assert_same_checkpoint(saved, ucp.open_checkpoint(bare))


def _untie(index: dict) -> None:
    """`head.weight` a parameter of its own: in the optimizer's group, no longer an alias."""
    index["optimizer"]["param_groups"][0]["params"].append("head.weight")
    del index["aliases"]


def untied_copy(path: Path, copy: Path, other: bool) -> Path:
    """An untied checkpoint: `head.weight` stored on its own, a copy of every state of `emb.weight`, or
    (`other`) another weight of the same shape, `emb.weight`'s first moment."""
    ckpt = ucp.open_checkpoint(path)
    states = {s: ckpt.tensor("emb.weight", s) for s in ("fp32", *MOMENTS)}
    if other:
        states["fp32"] = states["exp_avg"].clone()
    return with_added_param(path, copy, "head.weight", "emb.weight", states, _untie)


def test_an_untied_checkpoint_loads_into_the_tied_model_only_when_both_copies_are_equal(tiny_conversion, ckpt_root,
                                                                                        tmp_path):
    path = tiny_conversion(SAVED)
    equal = untied_copy(path, tmp_path / "equal", other=False)
    other = untied_copy(path, tmp_path / "other", other=True)
    results = ucp_load_errors([equal, other], SAVED, ckpt_root)
    assert results[0]["error"] is None and not results[0]["untouched"]
    assert "head.weight: the model ties it to 'emb.weight'" in results[1]["error"]
    assert "pass strict=False" in results[1]["error"] and results[1]["untouched"]


def test_a_tied_checkpoint_gives_an_untied_copy_its_sources_weight_and_states(tiny_conversion, ckpt_root, tmp_path):
    path = tiny_conversion(SAVED)
    untied = TinySpec(stage=1, tie="untied")
    loaded = ucp_resume(path, untied, 0, SAVED.steps, ckpt_root, dump_state=True)
    state = torch.load(loaded.state_path, weights_only=False)["params"]
    ckpt = ucp.open_checkpoint(path)
    for name in ("head.weight", "emb.weight"):
        for s in ("fp32", *MOMENTS):
            assert torch.equal(state[name][s], ckpt.tensor("emb.weight", s)), (name, s)
    # Negative control: without its alias the checkpoint has no head.weight for the untied model.
    bare = with_edited_index(path, tmp_path / "bare", lambda index: index.pop("aliases"))
    [result] = ucp_load_errors([bare], untied, ckpt_root)
    assert "has no parameter 'head.weight'" in result["error"] and result["untouched"]
