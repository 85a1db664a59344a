"""Megatron-DeepSpeed-style sources: a tiny GPT at TP=2 x PP=2 (4 ranks), ZeRO-1, fp32 and bf16.

The model (tests/support/train_megatron.py) declares its layout with Megatron-DeepSpeed's pattern
lists: fused QKV under GQA and fused SwiGLU gate/up (Shard-NC), row-parallel linears (Shard-H), a
vocabulary-parallel embedding padded from 37 to 40 rows and tied to the output head across the two
stages (Shard-V + StripPad), replicated layernorms and biases, and `mlp.input_scale`, whose TP
copies drift apart and are declared to average (Partial).

The reference is every rank's fp32 master and Adam moments of its own shard at save time,
consolidated here by hand from how the model cuts its weights, independently of the checkpoint's
metadata. Every comparison is `torch.equal`.
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
from support.parallel import (
    Family,
    build_family,
    compare_with_ds_universal,
    ds_universal_of,
    reference_state,
    trainable_count,
)
from support.train_megatron import FFN, HEAD_DIM, HIDDEN, KV_HEADS, PADDED_VOCAB, VOCAB
from ucp.convert import convert
from ucp.converters.deepspeed.lists import list_layout
from ucp.converters.dispatch import plan_deepspeed
from ucp.errors import AmbiguousPatternError, CheckpointNotFoundError, CorruptCheckpointError
from ucp.patterns import Pattern
from ucp.plan.assemble import assemble

MEGATRON = Family.of("megatron", "train_megatron.py", 4, {
    "z1-fp32": {"stage": 1},
    "z1-bf16": {"stage": 1, "dtype": "bf16"},
})
RUNS = [name for name, _ in MEGATRON.runs]
STATES = ("fp32", "exp_avg", "exp_avg_sq")
QKV, GATE_UP = "1.self_attention.query_key_value.weight", "2.mlp.dense_h_to_4h.weight"
SCALE, WORDS = "1.mlp.input_scale", "tied_modules.embed.word_embeddings.weight"


def _fused(shards: list[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """Each rank holds its share of every sub-parameter (`sizes` rows in all), one after the other."""
    per_rank = [s // len(shards) for s in sizes]
    pieces = [shard.split(per_rank, dim=0) for shard in shards]
    return torch.cat([pieces[r][i] for i in range(len(sizes)) for r in range(len(shards))], dim=0)


def consolidate(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor of `name` from its TP shards, in TP rank order, as the model cut it."""
    kv = KV_HEADS * HEAD_DIM
    if name.endswith("query_key_value.weight"):
        return _fused(shards, [HIDDEN, kv, kv])
    if name.endswith("dense_h_to_4h.weight"):
        return _fused(shards, [FFN, FFN])
    if name.endswith(("self_attention.dense.weight", "dense_4h_to_h.weight")):
        return torch.cat(shards, dim=1)
    if name == WORDS:
        return torch.cat(shards, dim=0)[:VOCAB]
    if name.endswith("input_scale"):
        return (shards[0] + shards[1]) / 2
    assert all(torch.equal(shards[0], s) for s in shards[1:]), (name, "replicated TP copies differ")
    return shards[0]


def reference(run_dir) -> dict[str, dict[str, torch.Tensor]]:
    """{name: {state: full tensor}} from every rank's live state.

    The tied embedding module lives on both stages: its word embedding is kept in sync (its stage copies
    must agree), its position embedding is used by the first stage only, whose copy is the parameter.
    """
    shards: dict[str, dict[int, dict]] = {}
    for rank in sorted(reference_state(run_dir)["ranks"], key=lambda r: r["stage"]):
        for name, states in rank["params"].items():
            seen = shards.setdefault(name, {}).setdefault(rank["tp_rank"], states)
            if name == WORDS:
                assert all(torch.equal(seen[s], states[s]) for s in STATES), (name, "stage copies differ")
    return {name: {s: consolidate(name, [by_tp[t][s] for t in sorted(by_tp)]) for s in STATES}
            for name, by_tp in shards.items()}


@pytest.fixture(scope="module")
def megatron(ckpt_root):
    return build_family(MEGATRON, ckpt_root)


@pytest.fixture(scope="module")
def converted(megatron, tmp_path_factory):
    memo = {}

    def make(run: str):
        if run not in memo:
            out = tmp_path_factory.mktemp("ucp-megatron") / run
            convert(megatron / run / "ckpt", out, workers=2, progress=False, strict=True)
            memo[run] = ucp.open_checkpoint(out)
        return memo[run]

    return make


@pytest.mark.parametrize("run", RUNS)
def test_equals_live_engine_state(run, megatron, converted):
    ckpt, full = converted(run), reference(megatron / run)
    assert {n for n in ckpt.names if ckpt.info(n).kind == "param"} == set(full)
    steps = reference_state(megatron / run)["global_steps"]
    for name, states in full.items():
        for state, expected in states.items():
            assert torch.equal(ckpt.tensor(name, state), expected), (run, name, state)
        assert ckpt.tensor(name, "step").item() == steps
    assert ckpt.shape(WORDS) == (VOCAB, HIDDEN) and ckpt.shape(QKV) == (HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN)


@pytest.mark.parametrize("run", RUNS)
def test_patterns_and_metadata(run, converted):
    ckpt = converted(run)
    pattern = {n: ckpt.index.params[n].pattern for n in ckpt.names}
    assert pattern[QKV]["pattern"] == "shard_nc" and pattern[QKV]["sub_widths"] == [[4, 4], [2, 2], [2, 2]]
    assert pattern[GATE_UP]["pattern"] == "shard_nc" and pattern[GATE_UP]["sub_widths"] == [[6, 6], [6, 6]]
    assert (pattern["2.self_attention.dense.weight"]["pattern"], pattern["2.self_attention.dense.weight"]["dim"]) == (
        "shard_hy", 1)
    assert pattern[WORDS]["pattern"] == "shard_hy" and pattern[WORDS]["padded_size"] == PADDED_VOCAB
    assert pattern[SCALE]["pattern"] == "partial" and pattern["3.weight"]["pattern"] == "replicate"
    assert all(p["inner"]["flat"] for n, p in pattern.items() if ckpt.info(n).kind == "param")  # ZeRO-partitioned
    assert (ckpt.source["tp"], ckpt.source["pp"], ckpt.source["dp"], ckpt.source["zero_stage"]) == (2, 2, 1, 1)
    assert ckpt.index.params["1.mlp.dense_4h_to_h.weight"].model_dtype == (
        "bfloat16" if run == "z1-bf16" else "float32")
    assert ckpt.client_state["client_marker"] == 23
    # A buffer no list names is read from the TP ranks' layer files, its equal copies checked: Replicate.
    assert ckpt.info("2.causal_mask").kind == "buffer" and pattern["2.causal_mask"]["pattern"] == "replicate"
    assert torch.equal(ckpt.tensor("2.causal_mask", "value"), torch.ones(5, 5, dtype=torch.bool).triu(1))


@pytest.mark.parametrize("run", RUNS)
def test_equals_ds_to_universal(run, megatron, converted):
    """ds_to_universal reads the same declared lists; its tensors equal ucp's."""
    ckpt, theirs = converted(run), load_ds_universal(ds_universal_of(megatron / run))
    assert compare_with_ds_universal(ckpt, theirs) == 4 * trainable_count(ckpt)


def test_format_deepspeed_tells_load_universal_how_to_cut(megatron, tmp_path):
    """--format deepspeed writes the keys ds_to_universal writes (cat_dim, param_n_sub_params, sub_param_shape,
    vocab_tensor), with which stock load_universal cuts each full tensor for a TP rank."""
    out = tmp_path / "uc" / "global_step2"
    convert(megatron / "z1-fp32" / "ckpt", out, fmt="deepspeed", workers=1, progress=False)
    theirs = ds_universal_of(megatron / "z1-fp32") / "zero"
    checked = 0
    for folder in sorted(p for p in theirs.iterdir() if p.is_dir()):
        want = torch.load(folder / "fp32.pt", weights_only=False)
        got = torch.load(out / "zero" / folder.name / "fp32.pt", weights_only=False)
        assert torch.equal(got.pop("param"), want.pop("param")), folder.name
        if "sub_param_shape" in want:  # ucp's names no patterns; load_universal reads the shape and dim only
            shape, ours = want.pop("sub_param_shape"), got.pop("sub_param_shape")
            assert (ours.shape, ours.partition_dim) == (shape.shape, shape.partition_dim), folder.name
            checked += 1
        assert got == want, folder.name  # the same keys: none where DeepSpeed writes none (replicated, averaged)
    assert checked == 2


def _rebuilt(source, spec, name: str) -> torch.Tensor:
    wrong = dataclasses.replace(source, spec=spec)
    return assemble(wrong, [torch_fragment(f) for f in wrong.fragments], name=name)


def test_negative_control_fused_qkv_read_as_plain_shard_v(megatron):
    """Concatenating the fused QKV shards (Shard-V over TP) instead of regrouping q, k, v must fail the check."""
    source = plan_deepspeed(megatron / "z1-fp32" / "ckpt").param(QKV).states["fp32"]
    expected = reference(megatron / "z1-fp32")[QKV]["fp32"]
    assert torch.equal(_rebuilt(source, source.spec, QKV), expected)
    plain = dataclasses.replace(source.spec, pattern=Pattern.SHARD_HY, sub_widths=None)
    wrong = _rebuilt(source, plain, QKV)
    assert wrong.shape == expected.shape and not torch.equal(wrong, expected)


def test_negative_control_averaged_copies_read_as_replicas(megatron):
    """The drifting copies of input_scale differ: Replicate (rank 0's copy) instead of Partial must fail."""
    source = plan_deepspeed(megatron / "z1-fp32" / "ckpt").param(SCALE).states["fp32"]
    expected = reference(megatron / "z1-fp32")[SCALE]["fp32"]
    assert torch.equal(_rebuilt(source, source.spec, SCALE), expected)
    wrong = _rebuilt(source, dataclasses.replace(source.spec, pattern=Pattern.REPLICATE), SCALE)
    assert not torch.equal(wrong, expected)


def _with_uc_info(megatron, tmp_path, change) -> Path:
    """A copy of the z1-fp32 checkpoint whose model files' universal_checkpoint_info went through `change`."""
    copy = tmp_path / "ckpt"
    shutil.copytree(megatron / "z1-fp32" / "ckpt", copy)
    for path in copy.glob("*/mp_rank_*_model_states.pt"):
        state = torch.load(path, map_location="cpu", weights_only=False)
        state["universal_checkpoint_info"] = change(state["universal_checkpoint_info"])
        if state["universal_checkpoint_info"] is None:
            del state["universal_checkpoint_info"]
        torch.save(state, path)
    return copy


def test_without_declared_lists_the_error_names_parameter_and_flag(megatron, tmp_path):
    copy = _with_uc_info(megatron, tmp_path, lambda info: None)
    with pytest.raises(AmbiguousPatternError, match=r"^tied_modules\.embed\.word_embeddings\.weight: .*--pattern"):
        convert(copy, tmp_path / "out", progress=False)
    assert not (tmp_path / "out" / "ucp_index.json").exists()
    # A flag settles the embedding; the fused QKV has no flag, only a declaration, and the error says so.
    fused = r"^1\.self_attention\.query_key_value\.weight: .*declared in universal_checkpoint_info \(parameter_with_sub"
    with pytest.raises(AmbiguousPatternError, match=fused):
        convert(copy, tmp_path / "out", progress=False, patterns={WORDS: "shard_v"})


def test_contradicting_lists_are_refused_by_name(megatron, tmp_path):
    def both(info):
        info["tp_replicated_parameter_patterns"] = [*info["tp_replicated_parameter_patterns"],
                                                    r"\d+.self_attention.dense.weight"]
        return info

    copy = _with_uc_info(megatron, tmp_path, both)
    with pytest.raises(AmbiguousPatternError, match=r"^1\.self_attention\.dense\.weight: universal_checkpoint_info "
                                                    r"lists it under tp_replicated_parameter_patterns, "
                                                    r"parameter_with_row_parallelism_patterns"):
        convert(copy, tmp_path / "out", progress=False)


def test_pattern_flag_overrides_a_declared_list(megatron, converted, tmp_path):
    """--pattern NAME=replicate over the declared average: TP rank 0's copy, which is not the mean."""
    out = tmp_path / "out"
    convert(megatron / "z1-fp32" / "ckpt", out, progress=False, patterns={r"\d+\.mlp\.input_scale": "replicate"})
    ckpt = ucp.open_checkpoint(out)
    assert ckpt.index.params[SCALE].pattern["pattern"] == "replicate"
    ranks = reference_state(megatron / "z1-fp32")["ranks"]
    rank0 = next(r["params"][SCALE] for r in ranks if r["tp_rank"] == 0 and SCALE in r["params"])
    assert torch.equal(ckpt.tensor(SCALE), rank0["fp32"])
    assert not torch.equal(ckpt.tensor(SCALE), converted("z1-fp32").tensor(SCALE))


def test_a_missing_slice_file_is_named(megatron, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(megatron / "z1-fp32" / "ckpt", copy)
    next(copy.glob("*/mp_rank_03_model_states.pt")).unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"mp_rank_03_model_states\.pt: missing \(the checkpoint has 2 "
                                                      r"pipeline stages x 2 tensor-parallel ranks\)"):
        convert(copy, tmp_path / "out", progress=False)


def test_missing_layer_files_of_a_tp_rank_are_named(megatron, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(megatron / "z1-fp32" / "ckpt", copy)
    for path in copy.glob("*/layer_*-model_01-model_states.pt"):
        path.unlink()
    with pytest.raises(CheckpointNotFoundError, match=r"records tensor parallelism 2 but holds the layer files of "
                                                      r"TP rank 0 only; copy every layer_\*-model_\*"):
        convert(copy, tmp_path / "out", progress=False)


# ----------------------------------------------------------------------------- declared lists, without processes

def _sub_params(shape, widths=None) -> dict:
    info = {"parameter_with_sub_params": [{"patterns": [r"qkv"], "shape": shape, "partition_dim": 0}]}
    if widths is not None:
        info["sub_param_shard_widths"] = {r"qkv": widths}
    return info


def test_list_layouts():
    shape, hints = list_layout("qkv", [(5, 3), (3, 3)], _sub_params(((4, 2, 2), 3), [[3, 1], [1, 1], [1, 1]]))
    assert shape == (8, 3) and hints.pattern is Pattern.SHARD_NC and hints.sub_widths == ((3, 1), (1, 1), (1, 1))
    # Before version 0.4: the number of equal sub-parameters.
    shape, hints = list_layout("qkv", [(6, 3), (6, 3)], _sub_params((3, 3)))
    assert shape == (12, 3) and hints.sub_widths == ((2, 2), (2, 2), (2, 2))
    info = {"vocabulary_parameter_patterns": ["emb"], "original_vocab_size": 7}
    shape, hints = list_layout("emb", [(4, 2), (4, 2)], info)
    assert shape == (7, 2) and (hints.pattern, hints.padded_dim_size) == (Pattern.SHARD_V, 8)
    assert list_layout("other", [(4, 2), (4, 2)], info)[1].pattern is Pattern.SHARD_V  # unlisted: split on dim 0
    assert list_layout("buffer", [(4, 2), (4, 2)], info, trainable=False) is None  # left to its shards


def test_list_layouts_refuse_what_they_cannot_rebuild():
    with pytest.raises(AmbiguousPatternError, match=r"^qkv: its sub-parameters of sizes \[4, 3, 3\] do not split"):
        list_layout("qkv", [(5, 3), (5, 3)], _sub_params(((4, 3, 3), 3)))
    with pytest.raises(CorruptCheckpointError, match=r"^qkv: its declared sub-parameter widths"):
        list_layout("qkv", [(5, 3), (3, 3)], _sub_params(((4, 2, 2), 3), [[2, 2], [1, 1], [1, 1]]))
    with pytest.raises(CorruptCheckpointError, match=r"^emb: declared in vocabulary_parameter_patterns but"):
        list_layout("emb", [(4, 2), (4, 2)], {"vocabulary_parameter_patterns": ["emb"]})
    with pytest.raises(AmbiguousPatternError, match=r"^n: declared in tp_replicated_parameter_patterns but"):
        list_layout("n", [(4,), (3,)], {"tp_replicated_parameter_patterns": ["n"]})
