"""Tensor-parallel (DeepSpeed AutoTP) sources: a tiny Hugging Face Llama with GQA at TP=2 x DP=2.

The reference is each rank's gathered fp32 state at save time (its TP shard, gathered over DP),
consolidated here by hand from what AutoTP does to a Llama, independently of the checkpoint's own
metadata: q/k/v/gate/up (and a tied, vocabulary-split embedding) split along dim 0, o/down along
dim 1, norms and an untied embedding replicated. Every comparison is `torch.equal`.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import ucp
from support.checkpoints import load_ds_universal
from support.parallel import Family, build_family, ds_universal_of, reference_state
from ucp.assemble import read_fragment
from ucp.converters.deepspeed_declared import affine_params, declared_layout
from ucp.converters.deepspeed_zero import plan_deepspeed
from ucp.convert import convert
from ucp.errors import CorruptCheckpointError, UnsupportedLayoutError
from ucp.patterns import Pattern, PatternSpec
from ucp.primitives import strip_pad, union

AUTOTP = Family.of("autotp", "train_llama_tp.py", 4, {
    "z1-fp32": {"stage": 1},
    "z2-bf16-tied": {"stage": 2, "dtype": "bf16", "tied": True},
    "z1-bf16-tied": {"stage": 1, "dtype": "bf16", "tied": True},
    "z2-fp32": {"stage": 2},
})
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


def consolidated(live: dict, tied: bool) -> dict[str, dict[str, torch.Tensor]]:
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
        out[name] = {s: ordered[0][s] if dim is None else torch.cat([o[s] for o in ordered], dim) for s in STATES}
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
    full = consolidated(live, tied="tied" in run)
    assert {n for n in ckpt.names if ckpt.info(n).kind == "param"} == set(full)
    for name, states in full.items():
        for state, expected in states.items():
            assert torch.equal(ckpt.tensor(name, state), expected), (run, name, state)
        assert ckpt.tensor(name, "step").item() == live["global_steps"]
    assert ckpt.shape("model.embed_tokens.weight") == (37, 16)  # odd vocabulary, split 19 + 18 when tied


@pytest.mark.parametrize("run", RUNS)
def test_patterns_and_metadata(run, converted):
    ckpt, tied = converted(run), "tied" in run
    pattern = {n: ckpt.index["params"][n]["pattern"] for n in ckpt.names}
    q, o = pattern["model.layers.0.self_attn.q_proj.weight"], pattern["model.layers.1.mlp.down_proj.weight"]
    assert (q["pattern"], q["dim"], o["pattern"], o["dim"]) == ("shard_hy", 0, "shard_hy", 1)
    # Every TP shard is a flat run, or runs, of its DP ranks' ZeRO partitions.
    assert all(p["inner"]["pattern"] == "shard_v" and p["inner"]["flat"] for p in pattern.values() if "inner" in p)
    assert pattern["model.norm.weight"]["pattern"] == "replicate" and pattern["model.norm.weight"]["inner"]
    assert pattern["model.embed_tokens.weight"]["pattern"] == ("shard_hy" if tied else "replicate")
    assert ("lm_head.weight" in ckpt.names) != tied  # a tied head is an alias, not a parameter
    assert (ckpt.source["tp"], ckpt.source["dp"], ckpt.source["zero_stage"]) == (2, 2, int(run[1]))
    assert ckpt.client_state["client_marker"] == 17


@pytest.mark.parametrize("run", ["z1-fp32", "z2-bf16-tied"])
def test_equals_ds_to_universal(run, autotp, converted):
    ckpt, reference = converted(run), load_ds_universal(ds_universal_of(autotp / run))
    compared = 0
    for name, states in reference.items():
        if name == "lm_head.weight" and "tied" in run:
            # ds_to_universal 0.19 writes a tied head's TP shard as if it were the whole weight.
            assert tuple(states["fp32"].shape) == (19, 16)
            continue
        for state, expected in states.items():
            got = ckpt.tensor(name, state)
            assert torch.equal(got, expected.float().reshape(got.shape)), (name, state)
            compared += 1
    assert compared == 4 * sum(1 for n in ckpt.names if ckpt.info(n).kind == "param")


def test_negative_control_non_contiguous_split(autotp):
    """Reading gate_proj's TP shards as a fused gate/up (Shard-NC) instead of Shard-V must fail the check."""
    name = "model.layers.0.mlp.gate_proj.weight"
    source = plan_deepspeed(autotp / "z1-fp32" / "ckpt").param(name).states["fp32"]
    groups = source.arrange([read_fragment(f) for f in source.fragments])
    shards = []
    for shape, pieces in zip(source.spec.shard_shapes, groups):
        inner = dataclasses.replace(source.spec.inner, shape=shape)
        shards.append(strip_pad(union(inner, pieces), inner))
    expected = consolidated(reference_state(autotp / "z1-fp32"), tied=False)[name]["fp32"]
    right = union(PatternSpec(Pattern.SHARD_V, (24, 16), dim=0), shards)
    wrong = union(PatternSpec(Pattern.SHARD_NC, (24, 16), dim=0, sub_widths=((6, 6), (6, 6))), shards)
    assert torch.equal(right, expected)
    assert wrong.shape == expected.shape and not torch.equal(wrong, expected)


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
