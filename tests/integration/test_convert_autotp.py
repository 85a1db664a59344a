"""Tensor-parallel (DeepSpeed AutoTP) sources: a tiny Hugging Face Llama with GQA at TP=2 x DP=2, ZeRO 0-3.

The reference is each rank's gathered fp32 state at save time (its TP shard, gathered over DP),
consolidated here by hand from what AutoTP does to a Llama, independently of the checkpoint's own
metadata: q/k/v/gate/up (and a tied, vocabulary-split embedding) split along dim 0, o/down along
dim 1, norms and an untied embedding replicated. Every comparison is `torch.equal`.

DeepSpeed 0.19.8 trains AutoTP under ZeRO-3 on CPU ("AutoTP + ZeRO stage 3 is supported for both
inference and training", runtime/engine.py): each TP rank's shard is partitioned again, on its own,
over the DP ranks of that TP rank (`zero_pp_rank_{D}_mp_rank_{TT}_*_states.pt`), which ucp reads as
Shard-Hy. Its ds_to_universal converts such a checkpoint (no step.pt) but stops on a frozen
parameter ("Unused patterns=['^model\\.norm\\.weight$'] while merging tp slices").
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

import ucp
from support.checkpoints import load_ds_universal
from support.fragments import torch_fragment
from support.llama_tp_runs import AUTOTP, lists_only_copy
from support.parallel import (
    build_family,
    compare_with_ds_universal,
    ds_universal_of,
    reference_state,
    trainable_count,
)
from ucp.cli.main import main
from ucp.convert import convert
from ucp.converters.deepspeed.declared import affine_params, declared_layout
from ucp.converters.dispatch import plan_deepspeed
from ucp.errors import AmbiguousPatternError, CorruptCheckpointError, UnsupportedLayoutError
from ucp.patterns import Pattern, PatternSpec
from ucp.plan.primitives import strip_pad, union

RUNS = [name for name, _ in AUTOTP.runs]
STATES = ("fp32", "exp_avg", "exp_avg_sq")
ROW_PARALLEL = ("o_proj", "down_proj")


def split_dim(name: str, tied: bool) -> int | None:
    """How AutoTP splits a Llama parameter: 0 (column), 1 (row) or None (replicated)."""
    if any(k in name for k in ROW_PARALLEL):
        return 1
    if "norm" in name or (name == "model.embed_tokens.weight" and not tied):
        return None
    return 0


def consolidated(live: dict, tied: bool, states=STATES) -> dict[str, dict[str, torch.Tensor]]:
    """Full tensors from every TP rank's shard (DP replicas of a shard must agree)."""
    shards: dict[str, dict[int, dict]] = {}
    for rank in live["ranks"]:
        for name, states in rank["params"].items():
            seen = shards.setdefault(name, {}).setdefault(rank["tp_rank"], states)
            assert all(torch.equal(seen[s], states[s]) for s in states), (name, "DP copies differ")
    out = {}
    for name, by_tp in shards.items():
        ordered = [by_tp[t] for t in sorted(by_tp)]
        dim = split_dim(name, tied)
        if dim is None:
            assert all(torch.equal(ordered[0]["fp32"], o["fp32"]) for o in ordered), (name, "TP copies differ")
        out[name] = {s: ordered[0][s] if dim is None else torch.cat([o[s] for o in ordered], dim) for s in states}
    return out


@pytest.fixture(scope="module")
def autotp(ckpt_root):
    return build_family(AUTOTP, ckpt_root)


@pytest.fixture(scope="module")
def converted(autotp, tmp_path_factory):
    memo = {}

    def make(run: str):
        if run not in memo:
            out = tmp_path_factory.mktemp("ucp-autotp") / run
            convert(autotp / run / "ckpt", out, workers=2, progress=False, strict=True)
            memo[run] = ucp.open_checkpoint(out)
        return memo[run]

    return make


@pytest.mark.parametrize("run", RUNS)
def test_equals_live_engine_state(run, autotp, converted):
    ckpt, live = converted(run), reference_state(autotp / run)
    # Under bf16 ZeRO-0 the engine's helpers see only the bf16 module weights, which the fp32 masters round to;
    # test_zero0_bf16_equals_the_saved_masters_and_moments checks the rest against the files.
    rounded = run == "z0-bf16-tied"
    full = consolidated(live, tied="tied" in run, states=("fp32",) if rounded else STATES)
    assert {n for n in ckpt.names if ckpt.info(n).kind == "param"} == set(full)
    for name, states in full.items():
        for state, expected in states.items():
            got = ckpt.tensor(name, state)
            assert torch.equal(got.bfloat16().float() if rounded else got, expected), (run, name, state)
        if not rounded:  # DeepSpeed 0.19's bf16 ZeRO-0 optimizer counts one step more than the engine
            assert ckpt.tensor(name, "step").item() == live["global_steps"]
    assert ckpt.shape("model.embed_tokens.weight") == (37, 16)  # odd vocabulary, split 19 + 18 when tied


def test_zero0_bf16_equals_the_saved_masters_and_moments(autotp, converted):
    """ZeRO-0 bf16 keeps fp32 masters and moments per optimizer slot (module order, the tied head skipped)
    in each TP rank's model file; consolidated by hand, they are what ucp wrote."""
    ckpt, tag = converted("z0-bf16-tied"), next(p for p in (autotp / "z0-bf16-tied" / "ckpt").iterdir() if p.is_dir())
    shards: dict[str, dict[int, dict]] = {}
    for tp in range(2):
        saved = torch.load(tag / f"mp_rank_{tp:02d}_model_states.pt", map_location="cpu", weights_only=False)
        names = [n for n in saved["module"] if n != "lm_head.weight"]
        masters, slots = saved["optimizer"]["fp32_groups"][0], saved["optimizer"]["optimizer_state_dict"]["state"]
        assert len(names) == len(masters)
        for slot, name in enumerate(names):
            shards.setdefault(name, {})[tp] = {"fp32": masters[slot], **{k: slots[slot][k] for k in STATES[1:]}}
    full = consolidated({"ranks": [{"tp_rank": tp, "params": {n: s[tp] for n, s in shards.items()}}
                                   for tp in range(2)]}, tied=True)
    for name, states in full.items():
        for state, expected in states.items():
            assert torch.equal(ckpt.tensor(name, state), expected), (name, state)
        assert torch.equal(ckpt.tensor(name, "step"), slots[0]["step"].float())


@pytest.mark.parametrize("run", RUNS)
def test_patterns_and_metadata(run, converted):
    ckpt, tied = converted(run), "tied" in run
    pattern = {n: ckpt.index.params[n].pattern for n in ckpt.names}
    q, o = pattern["model.layers.0.self_attn.q_proj.weight"], pattern["model.layers.1.mlp.down_proj.weight"]
    assert (q["dim"], o["dim"]) == (0, 1)
    assert ("lm_head.weight" in ckpt.names) != tied  # a tied head is an alias, not a parameter
    assert ckpt.aliases == ({"lm_head.weight": "model.embed_tokens.weight"} if tied else {})
    assert (ckpt.source["tp"], ckpt.source["dp"], ckpt.source["zero_stage"]) == (2, 2, int(run[1]))
    assert ckpt.client_state["client_marker"] == 17
    if run.endswith("frozen"):  # read from every TP rank's module state, declared replicated, checked equal
        assert ckpt.info("model.norm.weight").kind == "frozen"
        assert pattern["model.norm.weight"]["pattern"] == "replicate"
        assert torch.equal(ckpt.tensor("model.norm.weight"), torch.ones(16))
    embed = pattern["model.embed_tokens.weight"]["pattern"]
    if run.startswith("z0"):  # ZeRO-0 keeps every TP shard whole: plain Shard-V/H, nothing nested
        assert (q["pattern"], o["pattern"], embed) == ("shard_v", "shard_h", "shard_v" if tied else "replicate")
        assert pattern["model.norm.weight"] == {"pattern": "replicate"}
        return
    assert (q["pattern"], o["pattern"], embed) == ("shard_hy", "shard_hy", "shard_hy" if tied else "replicate")
    # Every TP shard is a flat run, or runs, of its DP ranks' ZeRO partitions.
    assert all(p["inner"]["pattern"] == "shard_v" and p["inner"]["flat"] for n, p in pattern.items()
               if ckpt.info(n).kind == "param")


@pytest.mark.parametrize("run", ["z1-fp32", "z2-bf16-tied", "z3-bf16-tied"])
def test_equals_ds_to_universal(run, autotp, converted):
    ckpt, reference = converted(run), load_ds_universal(ds_universal_of(autotp / run))
    per_param = 3 if run.startswith("z3") else 4  # ds_to_universal writes no step.pt for ZeRO-3
    if "tied" in run and "lm_head.weight" in reference:
        # ds_to_universal 0.19 writes a tied head's TP shard as if it were the whole weight.
        assert tuple(reference.pop("lm_head.weight")["fp32"].shape) == (19, 16)
    assert compare_with_ds_universal(ckpt, reference) == per_param * trainable_count(ckpt)


def test_negative_control_zero3_partitions_joined_across_tp_ranks(autotp, converted):
    """Under ZeRO-3 every TP shard of the row-parallel down_proj is partitioned on its own. Joining all four
    ranks' partitions as one flat tensor (TP rank after TP rank, as if the shards split dim 0) must fail the
    check that the nested Shard-Hy read passes."""
    name = "model.layers.0.mlp.down_proj.weight"
    source = plan_deepspeed(autotp / "z3-fp32-frozen" / "ckpt").param(name).states["fp32"]
    assert source.spec.pattern is Pattern.SHARD_HY and source.spec.dim == 1 and source.groups == (2, 2)
    pieces = [torch_fragment(f) for f in source.fragments]
    expected = consolidated(reference_state(autotp / "z3-fp32-frozen"), tied=False)[name]["fp32"]
    assert torch.equal(converted("z3-fp32-frozen").tensor(name), expected)
    wrong = strip_pad(union(PatternSpec(Pattern.SHARD_V, (16, 24), flat=True, padded_size=384), pieces),
                      PatternSpec(Pattern.SHARD_V, (16, 24), flat=True, padded_size=384))
    assert wrong.shape == expected.shape and not torch.equal(wrong, expected)


def test_negative_control_non_contiguous_split(autotp):
    """Reading gate_proj's TP shards as a fused gate/up (Shard-NC) instead of Shard-V must fail the check."""
    name = "model.layers.0.mlp.gate_proj.weight"
    source = plan_deepspeed(autotp / "z1-fp32" / "ckpt").param(name).states["fp32"]
    groups = source.arrange([torch_fragment(f) for f in source.fragments])
    shards = []
    for shape, pieces in zip(source.spec.shard_shapes, groups):
        inner = dataclasses.replace(source.spec.inner, shape=shape)
        shards.append(strip_pad(union(inner, pieces), inner))
    expected = consolidated(reference_state(autotp / "z1-fp32"), tied=False)[name]["fp32"]
    right = union(PatternSpec(Pattern.SHARD_V, (24, 16), dim=0), shards)
    wrong = union(PatternSpec(Pattern.SHARD_NC, (24, 16), dim=0, sub_widths=((6, 6), (6, 6))), shards)
    assert torch.equal(right, expected)
    assert wrong.shape == expected.shape and not torch.equal(wrong, expected)


# ----------------------------------------------------------------------------- no declared layout

COLUMN_ROW = [r".*\.(q|k|v|gate|up)_proj\.weight=shard_v", r".*\.(o|down)_proj\.weight=shard_h"]


@pytest.fixture(scope="module")
def undeclared(autotp, tmp_path_factory):
    """A copy of the z1-fp32 checkpoint whose model files lose universal_checkpoint_info, as a model trained
    without DeepSpeed recording it (Hugging Face / Accelerate users, Megatron without declarations) saves."""
    source = autotp / "z1-fp32" / "ckpt"
    copy = tmp_path_factory.mktemp("undeclared") / "ckpt"
    shutil.copytree(source, copy)
    for path in copy.glob("*/mp_rank_*_model_states.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        del state["universal_checkpoint_info"]
        torch.save(state, path)
    return copy


def test_without_declared_layout_the_error_names_parameter_and_flag(undeclared, tmp_path, capsys):
    code = main(["convert", "--input", str(undeclared), "--output", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    # The embedding (identical copies, checked) and norms are inferred Replicate; q_proj's equal-shaped shards
    # differ and could join along dim 0 or 1.
    assert err.startswith("ucp convert: error: model.layers.0.self_attn.q_proj.weight: ")
    assert "--pattern 'model.layers.0.self_attn.q_proj.weight=shard_v'" in err and "=shard_h'" in err
    assert not (tmp_path / "out" / "ucp_index.json").exists()


def test_pattern_flags_settle_an_undeclared_layout(undeclared, converted, tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["convert", "--input", str(undeclared), "--output", str(out), "--quiet", "--strict"]
    assert main(argv + [f"--pattern={p}" for p in COLUMN_ROW]) == 0, capsys.readouterr().err
    ckpt, declared = ucp.open_checkpoint(out), converted("z1-fp32")
    assert ckpt.names == declared.names
    for name in ckpt.names:
        for state in ckpt.states(name):
            assert torch.equal(ckpt.tensor(name, state), declared.tensor(name, state)), (name, state)
    assert ckpt.index.params["model.norm.weight"].pattern["pattern"] == "replicate"  # inferred, checked


def test_negative_control_a_wrong_pattern_flag_fails_the_comparison(undeclared, converted, tmp_path):
    """o_proj declared column-parallel (it is row-parallel) rebuilds a tensor that is not the weight."""
    wrong = {r".*\.(q|k|v|gate|up|o)_proj\.weight": "shard_v", r".*\.down_proj\.weight": "shard_h"}
    convert(undeclared, tmp_path / "out", progress=False, patterns=wrong)
    name = "model.layers.0.self_attn.o_proj.weight"
    got, want = ucp.open_checkpoint(tmp_path / "out").tensor(name), converted("z1-fp32").tensor(name)
    assert got.shape == (32, 8) and want.shape == (16, 16)
    assert not torch.equal(got.reshape(-1), want.reshape(-1))


def _rewritten_info(save_dir: Path, dest: Path, edit) -> Path:
    """A copy of `save_dir` whose model files' universal_checkpoint_info is `edit(info)`."""
    shutil.copytree(save_dir, dest)
    for path in dest.glob("*/mp_rank_*_model_states.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        state["universal_checkpoint_info"] = edit(state["universal_checkpoint_info"])
        torch.save(state, path)
    return dest


def test_pattern_lists_alone_read_as_the_affine_map(autotp, converted, tmp_path):
    """Issue #32: DeepSpeed versions without affine maps describe AutoTP splits by pattern lists only (row-parallel,
    replicated, vocabulary; the rest column-parallel). Read as ds_to_universal reads them, they rebuild every
    tensor the affine map does (test_format_deepspeed compares the same copy with ds_to_universal's output)."""
    copy = lists_only_copy(autotp / "z1-fp32" / "ckpt", tmp_path / "ckpt")
    ckpt, declared = ucp.open_checkpoint(convert(copy, tmp_path / "out", progress=False, strict=True).output), \
        converted("z1-fp32")
    assert ckpt.names == declared.names
    for name in ckpt.names:
        for state in ckpt.states(name):
            assert torch.equal(ckpt.tensor(name, state), declared.tensor(name, state)), (name, state)
    # Negative control: without the row-parallel list, o_proj's shards join along dim 0, not into the weight.
    wrong = _rewritten_info(copy, tmp_path / "no-rows", lambda info: {
        **info, "parameter_with_row_parallelism_patterns": []})
    name = "model.layers.0.self_attn.o_proj.weight"
    got = ucp.open_checkpoint(convert(wrong, tmp_path / "wrong", progress=False).output).tensor(name)
    assert got.shape == (32, 8) and not torch.equal(got.reshape(-1), declared.tensor(name).reshape(-1))


def test_info_without_a_layout_for_a_parameter_is_named_so(autotp, tmp_path, capsys):
    """A universal_checkpoint_info that declares nothing for q_proj (neither map nor lists) is not 'no
    universal_checkpoint_info'."""
    copy = _rewritten_info(autotp / "z1-fp32" / "ckpt", tmp_path / "ckpt",
                           lambda info: {"universal_checkpoint_version": info["universal_checkpoint_version"]})
    code = main(["convert", "--input", str(copy), "--output", str(tmp_path / "out"), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "the checkpoint's universal_checkpoint_info declares no tensor-parallel layout for it" in err, err
    assert "(no universal_checkpoint_info)" not in err


def test_pattern_flag_errors_name_the_flag(undeclared, tiny_checkpoint, tmp_path):
    from support.checkpoints import TinySpec

    with pytest.raises(AmbiguousPatternError, match=r"^--pattern 'no_such_weight' matches no tensor-parallel"):
        convert(undeclared, tmp_path / "a", progress=False, patterns={"no_such_weight": "shard_v", **dict(
            p.split("=") for p in COLUMN_ROW)})
    with pytest.raises(AmbiguousPatternError, match=r"^--pattern 'x=shard_hy': the pattern must be one of"):
        convert(undeclared, tmp_path / "b", progress=False, patterns={"x": "shard_hy"})
    with pytest.raises(UnsupportedLayoutError, match="--pattern applies to tensor-parallel checkpoints"):
        convert(tiny_checkpoint(TinySpec(stage=1)), tmp_path / "c", progress=False, patterns={"x": "shard_v"})


# ----------------------------------------------------------------------------- affine maps, without processes

def _entry(logical, blocks, shards=None):
    """An affine_map entry: one block (offset along dim, shape) per rank, row-major strides."""
    strides = [1] * len(logical)
    for d in range(len(logical) - 2, -1, -1):
        strides[d] = strides[d + 1] * logical[d + 1]
    ranks = {}
    for r, (start, shape) in enumerate(blocks):
        shard = list(shards[r]) if shards else list(shape)
        ranks[str(r)] = {"shard_shape": shard, "pieces": [{"shape": list(shape), "source": [start, strides],
                                                           "dest": [0, [1] * len(shape)], "locations": [r]}]}
    return {"logical_shape": list(logical), "ranks": ranks}


def test_declared_layouts_from_affine_maps():
    entries = {
        r"^col$": _entry((5, 4), [(0, (3, 4)), (12, (2, 4))]),
        r"^row$": _entry((4, 6), [(0, (4, 2)), (2, (4, 4))]),
        r"^rep$": _entry((6,), [(0, (6,)), (0, (6,))]),
        r"^vocab$": _entry((5, 4), [(0, (3, 4)), (12, (2, 4))], shards=[(3, 4), (4, 4)]),
    }
    col, row, rep, vocab = (declared_layout(n, entries) for n in ("col", "row", "rep", "vocab"))
    assert col[0] == (5, 4) and (col[1].pattern, col[1].padded_dim_size) == (Pattern.SHARD_V, None)
    assert row[1].pattern is Pattern.SHARD_H and rep[1].pattern is Pattern.REPLICATE
    assert vocab[1].padded_dim_size == 7  # the last rank's shard carries 2 padding rows
    assert declared_layout("other", entries) is None


def test_declared_layouts_refuse_what_they_cannot_rebuild():
    fused = _entry((4, 4), [(0, (2, 4)), (8, (2, 4))])
    fused["ranks"]["0"]["pieces"].append(fused["ranks"]["1"]["pieces"][0])
    scaled = _entry((4,), [(0, (4,)), (0, (4,))])
    scaled["ranks"]["1"]["pieces"][0]["scale"] = 0.5
    middle = _entry((5, 4), [(0, (3, 4)), (12, (2, 4))], shards=[(4, 4), (2, 4)])
    gap = _entry((5, 4), [(0, (2, 4)), (12, (2, 4))])
    for name, entry, error, text in [("fused", fused, UnsupportedLayoutError, "blocks on the TP ranks"),
                                     ("scaled", scaled, UnsupportedLayoutError, "scaled blocks"),
                                     ("middle", middle, UnsupportedLayoutError, "pads its shard in the middle"),
                                     ("gap", gap, UnsupportedLayoutError, "not where the previous rank's ends")]:
        with pytest.raises(error, match=f"^{name}: .*{text}"):
            declared_layout(name, {f"^{name}$": entry})
    with pytest.raises(CorruptCheckpointError, match="^w: several affine_map entries"):
        declared_layout("w", {"^w": _entry((4,), [(0, (4,))]), "w$": _entry((4,), [(0, (4,))])})
    with pytest.raises(UnsupportedLayoutError, match="version 2"):
        affine_params({"affine_map": {"version": 2, "params": {}}}, "mp_rank_00_model_states.pt")
