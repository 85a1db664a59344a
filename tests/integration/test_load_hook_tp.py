"""Resume DeepSpeed AutoTP (tensor-parallel) training through ucp.deepspeed under another TP degree.

A tiny Hugging Face Llama (GQA, vocabulary 37) trains 2 steps at layout A, saves with DeepSpeed and
trains 2 more (the uninterrupted run); ucp converts the checkpoint, and an engine at layout B loads
it through the hook and trains the same 2 global batches:

* TP 2 -> 1: AutoTP=2 x DP=1, ZeRO-1, tied embeddings (split by vocabulary, 19 + 18 rows) ->
  plain DP=2, ZeRO-2.
* TP 2 -> 2: the tied checkpoint -> AutoTP=2 x DP=2, ZeRO-2, tied.
* TP 1 -> 2: plain DP=2, ZeRO-1, untied -> AutoTP=2 x DP=2, ZeRO-1 (each TP shard partitioned again
  by ZeRO, flat), ZeRO-3 (each TP shard partitioned on its own), ZeRO-0 fp32 and bf16 (TP shards
  whole, read by one rank of each DP group and broadcast), and ZeRO-1 with a column- and a
  row-parallel weight frozen (loaded, not trained).

The loaded TP shards are compared with torch.equal to the checkpoint's tensors cut by how AutoTP
splits a Llama (stated here independently of the affine map the loader reads). A negative control
loads each TP rank the other's block of every row-parallel weight: both the tensor and the loss
comparisons fail. (Swapping every split parameter would not do: it only permutes attention heads and
MLP units consistently, the same function, which the tensor comparison alone catches.)
"""
from __future__ import annotations

import json
import math

import pytest
import torch

import ucp
from support.atomic import stored_bytes
from support.llama_tp_runs import build_sources, load_stats, losses, resume
from ucp.convert import convert
from ucp.convert.split_policy import SplitPolicy
from ucp.converters.deepspeed.declared import RankBlock
from ucp.deepspeed.engine.autotp import rank_block, to_box
from ucp.deepspeed.engine.targets import TargetTensor
from ucp.errors import UnsupportedLayoutError
from ucp.format.index import StoredState
from ucp.format.safetensors_stream import TORCH_DTYPES
from ucp.format.slice_read import plan_flat_read
from ucp.format.splits import to_split_major

SAVED_AT, RESUMED = 2, 2
TRAIN = {"global_batch": 4, "steps": SAVED_AT + RESUMED, "save_after": SAVED_AT, "save_dir": True,
         "losses_out": True}
RESUME = {"global_batch": 4, "steps": RESUMED, "start_step": SAVED_AT, "losses_out": True, "ucp_stats_out": True}
STATES = ("fp32", "exp_avg", "exp_avg_sq")
TP = 2
FUSED = "model.layers.1.mlp.up_proj.weight"
FROZEN = ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"]


def split_dim(name: str, tied: bool) -> int | None:
    """How AutoTP splits a Llama parameter: 0 (column- or vocabulary-parallel), 1 (row-parallel), None (whole)."""
    if "o_proj" in name or "down_proj" in name:
        return 1
    if "norm" in name or (name == "model.embed_tokens.weight" and not tied):
        return None
    return 0


def tp_box(name: str, shape: tuple[int, ...], tied: bool, rank: int) -> tuple[slice, ...]:
    """TP rank `rank`'s part of the full tensor: AutoTP gives the first ranks one row more when uneven."""
    dim = split_dim(name, tied)
    if dim is None:
        return tuple(slice(None) for _ in shape)
    sizes = [shape[dim] // TP + (r < shape[dim] % TP) for r in range(TP)]
    lo = sum(sizes[:rank])
    return tuple(slice(lo, lo + sizes[rank]) if d == dim else slice(None) for d in range(len(shape)))


@pytest.fixture(scope="module")
def sources(ckpt_root, tmp_path_factory):
    """Both sources trained and saved once, each converted by ucp (the DP one split-major for TP=2 reads)."""
    tp2 = build_sources("tp-resume-tp2", 2, 2, {"tied-z1": {**TRAIN, "stage": 1, "tied": True}}, ckpt_root)
    dp2 = build_sources("tp-resume-dp2", 1, 2, {"untied-z1": {**TRAIN, "stage": 1}}, ckpt_root)
    out = tmp_path_factory.mktemp("ucp-tp-resume")
    convert(tp2 / "tied-z1" / "ckpt", out / "tp2", workers=2, progress=False)
    convert(dp2 / "untied-z1" / "ckpt", out / "dp2", workers=2, progress=False, splits=SplitPolicy(TP))
    return {"tp2": (out / "tp2", losses(tp2 / "tied-z1")), "dp2": (out / "dp2", losses(dp2 / "untied-z1"))}


def tp_rank_bytes(path, tied: bool, rank: int) -> int:
    """The bytes of TP rank `rank`'s boxes of every state: what its DP group needs."""
    ckpt = ucp.open_checkpoint(path)
    total = 0
    for name in ckpt.names:
        shape = ckpt.shape(name)
        numel = torch.empty(shape, device="meta")[tp_box(name, shape, tied, rank)].numel()
        for state in ckpt.index.params[name].states.values():
            total += numel * TORCH_DTYPES[state.dtype].itemsize
    return total


def mismatched_shards(path, loaded: dict, tied: bool, swap: bool = False) -> list[tuple]:
    """(TP rank, parameter, state) whose loaded shard differs from its box of the checkpoint's tensor
    (of the other TP rank's box with `swap`)."""
    ckpt = ucp.open_checkpoint(path)
    bad = []
    for rank in loaded["ranks"]:
        tp_rank = rank["tp_rank"]
        for name, states in rank["params"].items():
            box = tp_box(name, ckpt.shape(name), tied, (TP - 1 - tp_rank) if swap else tp_rank)
            for state in states:
                expected = ckpt.tensor(name, state)[box]
                if expected.shape != states[state].shape or not torch.equal(states[state], expected):
                    bad.append((tp_rank, name, state))
    return bad


def test_tp2_to_1_continues_the_uninterrupted_run(sources, ckpt_root):
    path, straight = sources["tp2"]
    run = resume("tp2-to-dp2", 1, 2, {"z2": {**RESUME, "stage": 2, "tied": True, "ucp_load": str(path)}}, ckpt_root)
    # TP sums row-parallel products over ranks and the vocabulary-parallel loss over shards, so A and B add
    # in another order (~1e-7 apart in fp32), as another DP degree does.
    assert losses(run / "z2") == pytest.approx(straight[SAVED_AT:], rel=1e-6)
    # One DP group of 2, no TP: together the ranks read the checkpoint exactly once.
    assert sum(s["bytes_read"] - s["bytes_checked_extra"] for s in load_stats(run / "z2")) == stored_bytes(path)


@pytest.fixture(scope="module")
def tp2_engines(sources, ckpt_root):
    """One launch of AutoTP=2 x DP=2 engines: the DP checkpoint loaded by every ZeRO family, the
    negative control, the fused refusal, and the tied TP=2 checkpoint into a tied TP=2 engine."""
    path, _ = sources["dp2"]
    load = {**RESUME, "ucp_load": str(path), "dump_loaded": True}
    return resume("to-tp2", TP, 4, {
        "tied": {**RESUME, "stage": 2, "tied": True, "ucp_load": str(sources["tp2"][0]), "dump_loaded": True},
        "z1": {**load, "stage": 1},
        "z0": {**load, "stage": 0},
        "z3": {**load, "stage": 3},
        "z0-bf16": {**load, "stage": 0, "dtype": "bf16", "dump_loaded": False},
        "frozen": {**load, "stage": 1, "steps": 0, "frozen": FROZEN},
        "swapped": {**load, "stage": 1, "ucp_swap_row_blocks": True},
        "fused": {"stage": 1, "steps": 0, "ucp_load": str(path), "ucp_fuse": FUSED, "error_out": True},
    }, ckpt_root)


@pytest.mark.parametrize("run", ["z1", "z0", "z3", "frozen"])
def test_tp1_to_2_loads_each_tp_rank_its_box(run, sources, tp2_engines):
    path, _ = sources["dp2"]
    loaded = torch.load(tp2_engines / run / "loaded.pt", weights_only=False)
    assert {r["tp_rank"] for r in loaded["ranks"]} == {0, 1}
    frozen = FROZEN if run == "frozen" else []
    for rank in loaded["ranks"]:
        assert {n for n, states in rank["params"].items() if set(states) == {"fp32"}} == set(frozen)
        assert all(set(states) == set(STATES) for n, states in rank["params"].items() if n not in frozen)
    assert mismatched_shards(path, loaded, tied=False) == []


def test_tp1_to_2_continues_the_uninterrupted_run(sources, tp2_engines):
    _, straight = sources["dp2"]
    for run in ("z1", "z0", "z3"):
        assert losses(tp2_engines / run) == pytest.approx(straight[SAVED_AT:], rel=1e-6), run  # reduction order
    # fp32 training resumed in bf16: the forward pass now rounds to 8 mantissa bits (~4e-3), as in test_load_hook.
    assert losses(tp2_engines / "z0-bf16") == pytest.approx(straight[SAVED_AT:], rel=2e-2)


@pytest.mark.parametrize("run", ["z1", "z0", "z3", "z0-bf16"])
def test_tp1_to_2_each_dp_group_reads_its_boxes_once(run, sources, tp2_engines):
    path, _ = sources["dp2"]
    stats = load_stats(tp2_engines / run)
    assert len(stats) == 4
    for tp_rank in range(TP):
        group = [s for s in stats if s["tp_rank"] == tp_rank]
        assert len(group) == 2
        read = sum(s["bytes_read"] - s["bytes_checked_extra"] for s in group)
        assert read == tp_rank_bytes(path, tied=False, rank=tp_rank), (run, tp_rank)


def test_tied_tp2_to_tp2_dp2_splits_the_shared_embedding_by_vocabulary(sources, tp2_engines):
    """TP=2 x DP=1 ZeRO-1 -> TP=2 x DP=2 ZeRO-2, tied: the head is the embedding, 19 + 18 rows per TP rank."""
    path, straight = sources["tp2"]
    loaded = torch.load(tp2_engines / "tied" / "loaded.pt", weights_only=False)
    embed = [r["params"]["model.embed_tokens.weight"]["fp32"].shape[0] for r in loaded["ranks"]]
    assert sorted(embed) == [18, 18, 19, 19] and all("lm_head.weight" not in r["params"] for r in loaded["ranks"])
    assert mismatched_shards(path, loaded, tied=True) == []
    assert losses(tp2_engines / "tied") == pytest.approx(straight[SAVED_AT:], rel=1e-6)  # reduction order, as above


def test_negative_control_the_other_tp_ranks_blocks_fail_both_checks(sources, tp2_engines):
    """Proves the checks can fail: each TP rank loaded the other's block of every row-parallel weight."""
    path, straight = sources["dp2"]
    loaded = torch.load(tp2_engines / "swapped" / "loaded.pt", weights_only=False)
    wrong = mismatched_shards(path, loaded, tied=False)
    assert {name for _, name, _ in wrong} == {f"model.layers.{i}.{m}.weight" for i in range(2)
                                              for m in ("self_attn.o_proj", "mlp.down_proj")}
    # ... and those are exactly the other rank's blocks.
    assert not set(mismatched_shards(path, loaded, tied=False, swap=True)) & set(wrong)
    assert losses(tp2_engines / "swapped") != pytest.approx(straight[SAVED_AT:], rel=1e-3)
    # The correct run fails the comparison with the other rank's boxes too.
    correct = torch.load(tp2_engines / "z1" / "loaded.pt", weights_only=False)
    assert mismatched_shards(path, correct, tied=False, swap=True) != []


def test_a_fused_tp_layout_is_refused_before_the_engine_is_touched(tp2_engines):
    results = json.loads((tp2_engines / "fused" / "error.json").read_text())
    assert len(results) == 4
    for result in results:
        assert result["error"] is not None and result["error"].startswith(f"{FUSED}: ")
        assert "fused parameter" in result["error"] and "without tensor parallelism" in result["error"]
        assert result["untouched"]


# ----------------------------------------------------------------------------- without processes

def _entry(logical, blocks, shards=None):
    """An affine_map entry as DeepSpeed builds it: one block (source offset, shape) per rank, row-major."""
    strides = [math.prod(logical[d + 1:]) for d in range(len(logical))]
    ranks = {}
    for r, (start, shape) in enumerate(blocks):
        shard = list(shards[r]) if shards else list(shape)
        ranks[r] = {"shard_shape": shard, "pieces": [{"shape": list(shape), "source": [start, strides],
                                                      "dest": [0, [1] * len(shape)], "locations": [r]}]}
    return {"logical_shape": list(logical), "ranks": ranks}


ENTRIES = {
    r"^col$": _entry((5, 4), [(0, (3, 4)), (12, (2, 4))]),
    r"^row$": _entry((4, 6), [(0, (4, 2)), (2, (4, 4))]),
    r"^rep$": _entry((6,), [(0, (6,)), (0, (6,))]),
    r"^vocab$": _entry((5, 4), [(0, (3, 4)), (12, (2, 4))], shards=[(3, 4), (3, 4)]),
}


def test_rank_blocks_from_the_affine_map():
    assert rank_block("col", ENTRIES, 1, 2) == ((5, 4), RankBlock(((3, 5), (0, 4)), (2, 4)))
    assert rank_block("row", ENTRIES, 0, 2) == ((4, 6), RankBlock(((0, 4), (0, 2)), (4, 2)))
    assert rank_block("row", ENTRIES, 1, 2)[1].box == ((0, 4), (2, 6))
    assert rank_block("rep", ENTRIES, 1, 2)[1].box == ((0, 6),)
    assert rank_block("vocab", ENTRIES, 1, 2) == ((5, 4), RankBlock(((3, 5), (0, 4)), (3, 4)))  # 1 pad row


def test_rank_blocks_refuse_what_the_loader_cannot_serve():
    fused = _entry((4, 4), [(0, (2, 4)), (8, (2, 4))])
    fused["ranks"][0]["pieces"].append(fused["ranks"][1]["pieces"][0])
    scaled = _entry((4,), [(0, (4,)), (0, (4,))])
    scaled["ranks"][1]["pieces"][0]["scale"] = 0.5
    wide = _entry((4, 6), [(0, (4, 2)), (2, (4, 4))], shards=[(4, 2), (4, 5)])  # padded along dim 1
    for name, entry, text in [("fused", fused, "blocks on the TP ranks .* without tensor parallelism"),
                              ("scaled", scaled, "scaled blocks .* without tensor parallelism"),
                              ("wide", wide, "pads its shard along dim 1")]:
        with pytest.raises(UnsupportedLayoutError, match=f"^{name}: .*{text}"):
            rank_block(name, {f"^{name}$": entry}, 1, 2)
    with pytest.raises(UnsupportedLayoutError, match="^other: the engine's AutoTP affine_map does not describe it"):
        rank_block("other", ENTRIES, 0, 2)
    with pytest.raises(UnsupportedLayoutError, match="^col: .* on 2 TP ranks, the engine has autotp_size 4"):
        rank_block("col", ENTRIES, 0, 4)


def _tensor(shard: torch.Tensor, start: int, numel: int, whole: bool) -> TargetTensor:
    flat = shard.view(-1)
    return TargetTensor("vocab", "param", tuple(shard.shape), start, numel, whole,
                        lambda state: flat.narrow(0, start, numel))


def test_padded_rows_keep_what_the_engine_holds():
    """The last rank's shard has 3 rows for a 2-row block: its ZeRO runs are cut at the block's 8 elements."""
    shard = torch.full((3, 4), -1.0)
    logical, block = rank_block("vocab", ENTRIES, 1, 2)
    shards = (_tensor(shard, 0, 6, False), _tensor(shard, 6, 6, False), _tensor(shard, 0, 12, True))
    runs = [to_box(t, logical, block, dp_group=None) for t in shards]
    # The shard descriptions stay as they were: a box is a new TargetTensor.
    assert [(t.shape, t.box, t.start, t.numel) for t in shards] == [((3, 4), None, 0, 6), ((3, 4), None, 6, 6),
                                                                    ((3, 4), None, 0, 12)]
    assert [(t.shape, t.box, t.start, t.numel) for t in runs] == [
        ((5, 4), ((3, 5), (0, 4)), 0, 6), ((5, 4), ((3, 5), (0, 4)), 6, 2), ((5, 4), ((3, 5), (0, 4)), 0, 8)]
    runs[1].install("fp32", torch.tensor([6.0, 7.0]))
    runs[0].install("fp32", torch.arange(6.0))
    assert torch.equal(shard[:2].reshape(-1), torch.arange(8.0)) and torch.equal(shard[2], torch.full((4,), -1.0))


def test_a_replicated_tensor_is_the_whole_tensor():
    t = to_box(_tensor(torch.zeros(6), 0, 6, True), *rank_block("rep", ENTRIES, 1, 2), dp_group="dp")
    assert (t.shape, t.box, t.numel, t.dp_group) == ((6,), None, 6, "dp")


def test_a_zero_partition_of_one_split_is_one_exact_read():
    full = torch.arange(4 * 6, dtype=torch.float32).reshape(4, 6)
    stored = to_split_major(full, 1, 2)  # columns [0, 3) then [3, 6), each row-major
    entry = StoredState("f", "w", "float32", (4, 6), 100, 100 + 4 * stored.numel(), 0, splits=(1, 2))
    box = ((0, 4), (3, 6))
    read = plan_flat_read(("w", "fp32"), entry, box, 5, 4)
    got = stored.reshape(-1)[(read.range.begin - 100) // 4:(read.range.end - 100) // 4]
    assert torch.equal(got, full[:, 3:6].reshape(-1)[5:9]) and read.exact and not read.whole
    assert plan_flat_read(("w", "fp32"), entry, ((0, 4), (2, 6)), 0, 4) is None   # not one split
    assert plan_flat_read(("w", "fp32"), entry, ((0, 2), (3, 6)), 0, 4) is None   # cut along another dim too
