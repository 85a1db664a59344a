"""`ucp convert --format deepspeed`: DeepSpeed's own universal layout, judged by DeepSpeed itself.

Per family (ZeRO-1/2/3 x fp32/bf16 on the tiny model; AutoTP x ZeRO-1/3 on the Llama, and AutoTP described by
pattern lists only; pipeline ZeRO-1 fp32/bf16; MoE ep_size 1) the output is compared file for file with what
`ds_to_universal` writes from the same checkpoint, then (all but MoE) loaded by stock DeepSpeed (`load_universal`,
no ucp code) at another size beside `ds_to_universal`'s output: every fp32 master, moment, optimizer step and
hyper-parameter the engines end up with must be equal (torch.equal). One launch loads every family of a model,
and a deliberately wrong copy of one output (negative control). What stock DeepSpeed cannot do is stated where it
is tested: ZeRO-0 has no universal layout (ucp refuses it in one line, below); MoE with ep_size > 1 has no
ds_to_universal reference (it joins different experts), and stock load_universal restores experts by local ids
(docs/RELIABILITY.md).
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import ucp
from support.checkpoints import TinySpec, read_tag, run_ds_to_universal, trained_state
from support.llama_tp_runs import AUTOTP, lists_only_copy
from support.parallel import MOE, PIPE, build_family, ds_universal_of, reference_state
from support.stock_loads import engine_differences, stock_loads
from ucp.cli.main import main
from ucp.convert import convert

TINY = {  # family: its source, saved on 2 DP ranks; stock DeepSpeed loads both outputs on TINY_WORLD
    "z1-fp32": TinySpec(stage=1),
    "z2-fp32": TinySpec(stage=2),
    "z3-fp32": TinySpec(stage=3),
    "z1-bf16-tied": TinySpec(stage=1, dtype="bf16", tie="tied"),
    "z2-bf16": TinySpec(stage=2, dtype="bf16"),
    "z3-bf16": TinySpec(stage=3, dtype="bf16"),
}
TINY_WORLD = 3
# family: (AutoTP source run of support.llama_tp_runs.AUTOTP, saved at TP 2 x DP 2, its stage, dtype, tied).
# Stock DeepSpeed loads both outputs at TP 2 x DP 1 (this Llama cannot run AutoTP at TP 4: 2 key/value heads).
AUTOTP_FAMILIES = {
    "autotp-z1-fp32": ("z1-fp32", 1, "fp32", False),
    "autotp-z3-bf16-tied": ("z3-bf16-tied", 3, "bf16", True),
    "autotp-z1-fp32-lists": ("z1-fp32", 1, "fp32", False),  # its universal_checkpoint_info without affine_map
}
LLAMA_WORLD = 2
# Pipeline (PipelineModule, 2 stages x DP 1, ZeRO-1) and MoE (4 experts, ep_size 1) sources, compared file for
# file with ds_to_universal. Stock DeepSpeed loads the pipeline ones at 2 stages x DP 2 (one launch).
OTHER_FAMILIES = {"pipe-z1-fp32": (PIPE, "z1-fp32"), "pipe-z1-bf16-topology": (PIPE, "z1-bf16-topology"),
                  "moe-ep1-z1": (MOE, "ep1-z1")}
PIPE_LOADS = {"pipe-z1-fp32": {"stage": 1, "dtype": "fp32"},
              "pipe-z1-bf16-topology": {"stage": 1, "dtype": "bf16", "topology": True}}
PIPE_WORLD = 4
# MoE, loaded by stock DeepSpeed at ep_size 1 on MOE_WORLD ranks: ep1-z1 beside ds_to_universal's output, and ucp's
# output of ep2-z2 (which ds_to_universal cannot convert) against the state the source run saved.
MOE_WORLD = 3


def ours_of(save_dir: Path, out_root: Path) -> Path:
    out = out_root / read_tag(save_dir)
    convert(save_dir, out, fmt="deepspeed", workers=2, progress=False)
    return out


@pytest.fixture(scope="module")
def pairs(tiny_checkpoint, ds_universal, ckpt_root, tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """family -> (ucp's --format deepspeed output, ds_to_universal's output) of the same checkpoint, each folder
    named by its tag (its parent holds latest_universal)."""
    root = tmp_path_factory.mktemp("format-deepspeed")
    out = {name: (ours_of(tiny_checkpoint(spec), root / name), ds_universal(spec)) for name, spec in TINY.items()}
    family = build_family(AUTOTP, ckpt_root)
    for name, (run, *_) in AUTOTP_FAMILIES.items():
        save_dir = family / run / "ckpt"
        if name.endswith("-lists"):
            save_dir = lists_only_copy(save_dir, root / name / "source")
            theirs = run_ds_to_universal(save_dir / read_tag(save_dir), root / name / "theirs" / read_tag(save_dir))
        else:
            theirs = ds_universal_of(family / run)
        out[name] = (ours_of(save_dir, root / name / "ours"), theirs)
    for name, (other, run) in OTHER_FAMILIES.items():
        folder = build_family(other, ckpt_root) / run
        out[name] = (ours_of(folder / "ckpt", root / name), ds_universal_of(folder))
    return out


def wrong_copy(ours: Path, name: str, dim: int, root: Path) -> Path:
    """A copy of ucp's output with the two halves of `name`'s exp_avg swapped along `dim`: a conversion that joins
    shards (TP blocks, or ZeRO partitions) in the wrong order. Its parent holds latest_universal."""
    wrong = root / ours.name
    shutil.copytree(ours, wrong)
    path = wrong / "zero" / name / "exp_avg.pt"
    saved = torch.load(path, weights_only=False)  # our own output: trusted
    full = saved["param"] if isinstance(saved, dict) else saved
    swapped = torch.cat(full.chunk(2, dim)[::-1], dim)
    torch.save({**saved, "param": swapped} if isinstance(saved, dict) else swapped, path)
    (root / "latest_universal").write_text(wrong.name)
    return wrong


def where(folder: Path) -> dict:
    return {"load_dir": str(folder.parent), "tag": folder.name}


@pytest.fixture(scope="module")
def tiny_engines(pairs, tmp_path_factory) -> dict[str, dict]:
    """What stock DeepSpeed's engines hold after load_universal of each tiny family's two outputs (`<family>:ours`,
    `<family>:theirs`) and of the negative control (`wrong`: z1-fp32 with l1.weight's partitions swapped), all in
    one launch on TINY_WORLD processes."""
    loads = {}
    for name, spec in TINY.items():
        ours, theirs = pairs[name]
        options = {"stage": spec.stage, "dtype": spec.dtype, "tie": spec.tie}
        loads[f"{name}:ours"], loads[f"{name}:theirs"] = {**options, **where(ours)}, {**options, **where(theirs)}
    wrong = wrong_copy(pairs["z1-fp32"][0], "l1.weight", 0, tmp_path_factory.mktemp("wrong-tiny"))
    loads["wrong"] = {**loads["z1-fp32:ours"], **where(wrong)}
    return stock_loads("tiny", 1, TINY_WORLD, loads, tmp_path_factory.mktemp("tiny-engines"))


@pytest.fixture(scope="module")
def autotp_engines(pairs, tmp_path_factory) -> dict[str, dict]:
    """The same for the AutoTP families, at TP 2 x DP 1, in one launch; the negative control (`wrong`) swaps the
    TP blocks of the row-parallel o_proj (dim 1) in the ZeRO-3 output."""
    loads = {}
    for name, (_, stage, dtype, tied) in AUTOTP_FAMILIES.items():
        ours, theirs = pairs[name]
        options = {"stage": stage, "dtype": dtype, "tied": tied}
        loads[f"{name}:ours"], loads[f"{name}:theirs"] = {**options, **where(ours)}, {**options, **where(theirs)}
    wrong = wrong_copy(pairs["autotp-z3-bf16-tied"][0], "model.layers.0.self_attn.o_proj.weight", 1,
                       tmp_path_factory.mktemp("wrong-autotp"))
    loads["wrong"] = {**loads["autotp-z3-bf16-tied:ours"], **where(wrong)}
    return stock_loads("llama", 2, LLAMA_WORLD, loads, tmp_path_factory.mktemp("autotp-engines"))


@pytest.fixture(scope="module")
def pipe_engines(pairs, tmp_path_factory) -> dict[str, dict]:
    """The same for the pipeline families, at 2 stages x DP 2, in one launch."""
    loads = {}
    for name, options in PIPE_LOADS.items():
        ours, theirs = pairs[name]
        loads[f"{name}:ours"], loads[f"{name}:theirs"] = {**options, **where(ours)}, {**options, **where(theirs)}
    return stock_loads("pipe", 1, PIPE_WORLD, loads, tmp_path_factory.mktemp("pipe-engines"))


@pytest.fixture(scope="module")
def moe_engines(pairs, ckpt_root, tmp_path_factory) -> dict[str, dict]:
    """The same for MoE at ep_size 1 on MOE_WORLD ranks, in one launch; `moe-ep2-z2:ours` is ucp's output of the
    ep_size 2 source."""
    ours, theirs = pairs["moe-ep1-z1"]
    options = {"stage": 1, "dtype": "fp32", "ep_size": 1}
    ep2 = ours_of(build_family(MOE, ckpt_root) / "ep2-z2" / "ckpt", tmp_path_factory.mktemp("moe-ep2"))
    loads = {"moe-ep1-z1:ours": {**options, **where(ours)}, "moe-ep1-z1:theirs": {**options, **where(theirs)},
             "moe-ep2-z2:ours": {**options, "stage": 2, **where(ep2)}}
    return stock_loads("moe", 1, MOE_WORLD, loads, tmp_path_factory.mktemp("moe-engines"))


def same_file(a, b) -> bool:
    """Equal content of two universal files: tensors torch.equal (dtype included), dicts key for key."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_file(a[k], b[k]) for k in a)
    return a == b


@pytest.mark.parametrize("family", [*TINY, *AUTOTP_FAMILIES, *OTHER_FAMILIES])
def test_files_are_those_of_ds_to_universal(family, pairs):
    """Every zero/<param>/<state>.pt holds what ds_to_universal writes there: the same tensor in the same shape
    (flat only for plain ZeRO-3) and the same keys (cat_dim, vocab_tensor, ... or none), and the same model-state
    files sit beside zero/. zero/optimizer_state.pt holds less (test_optimizer_state_is_what_load_universal_reads)."""
    ours, theirs = pairs[family]
    files = sorted(p.relative_to(theirs) for p in (theirs / "zero").rglob("*.pt") if p.name != "optimizer_state.pt")
    assert files == sorted(p.relative_to(ours) for p in (ours / "zero").rglob("*.pt")
                           if p.name != "optimizer_state.pt")
    for f in files:
        assert same_file(torch.load(ours / f, weights_only=False), torch.load(theirs / f, weights_only=False)), f
    assert sorted(p.name for p in ours.glob("*.pt")) == sorted(p.name for p in theirs.glob("*.pt"))
    # Negative control: one changed element is told apart.
    state = torch.load(ours / files[0], weights_only=False)
    tensor = state["param"] if isinstance(state, dict) else state
    changed = tensor.clone().reshape(-1)
    changed[0] += 1
    assert not same_file(changed.reshape(tensor.shape), tensor)


def judged(engines: dict, family: str, saved: dict[int, dict], steps: int, holder: str = "tp_rank") -> None:
    """ucp's output loads into the engine state ds_to_universal's does; and that state is the one the source run
    saved (`saved`: by TP rank, or pipeline stage, each parameter's shard or copy there, gathered over DP), so
    neither load was a no-op."""
    ours, theirs = engines[f"{family}:ours"], engines[f"{family}:theirs"]
    assert engine_differences(ours, theirs) == []
    assert theirs["global_steps"] == steps
    for rank in theirs["ranks"]:
        expected = saved[rank[holder]]
        assert rank["params"].keys() == expected.keys()
        for name, states in rank["params"].items():
            assert states.keys() == expected[name].keys() == {"fp32", "exp_avg", "exp_avg_sq"}, name
            assert all(torch.equal(t, expected[name][s]) for s, t in states.items()), name


@pytest.mark.parametrize("family", TINY)
def test_stock_load_universal_of_tiny_families(family, tiny_engines, ckpt_root):
    spec = TINY[family]
    judged(tiny_engines, family, {0: trained_state(spec, ckpt_root)["params"]}, spec.steps)


@pytest.mark.parametrize("family", AUTOTP_FAMILIES)
def test_stock_load_universal_of_autotp_families(family, autotp_engines, ckpt_root):
    """Issue #32: stock ZeRO-3 load_universal at TP 2 cuts each rank's share out of the full-shape dict (it failed
    with 'start (0) + length (1212) exceeds dimension size (650)' on a flat tensor)."""
    saved = reference_state(build_family(AUTOTP, ckpt_root) / AUTOTP_FAMILIES[family][0])
    by_tp = {r["tp_rank"]: r["params"] for r in saved["ranks"] if r["dp_rank"] == 0}
    judged(autotp_engines, family, by_tp, saved["global_steps"])


@pytest.mark.parametrize("family", PIPE_LOADS)
def test_stock_load_universal_of_pipeline_families(family, pipe_engines, ckpt_root):
    saved = reference_state(build_family(PIPE, ckpt_root) / OTHER_FAMILIES[family][1])
    by_stage = {r["stage"]: r["params"] for r in saved["ranks"] if r["dp_rank"] == 0}
    judged(pipe_engines, family, by_stage, saved["global_steps"], holder="stage")


def test_stock_load_universal_of_moe(moe_engines, ckpt_root):
    """ep_size 1, DP 2 -> 3, beside ds_to_universal's output; and ucp's output of an ep_size 2 source (no
    ds_to_universal reference: it joins different experts), whose experts sit under their global ids, which an
    ep_size 1 engine's local ids are: every expert of both EP ranks arrives, equal to the state saved."""
    saved = reference_state(build_family(MOE, ckpt_root) / "ep1-z1")
    judged(moe_engines, "moe-ep1-z1", {0: saved["ranks"][0]["params"]}, saved["global_steps"])
    ep2 = reference_state(build_family(MOE, ckpt_root) / "ep2-z2")
    every_expert = {name: states for r in ep2["ranks"] for name, states in r["params"].items()}
    assert {n.split(".deepspeed_experts.")[1][0] for n in every_expert if ".deepspeed_experts." in n} == set("0123")
    loaded = moe_engines["moe-ep2-z2:ours"]
    assert loaded["global_steps"] == ep2["global_steps"]
    for rank in loaded["ranks"]:
        assert rank["params"].keys() == every_expert.keys()
        for name, states in rank["params"].items():
            assert all(torch.equal(t, every_expert[name][s]) for s, t in states.items()), name


def test_negative_controls_fail_the_engine_comparison(tiny_engines, autotp_engines):
    """A conversion that joined one state's pieces in the wrong order loads, and the comparison names exactly
    that state, on every rank that holds it."""
    tiny = engine_differences(tiny_engines["wrong"], tiny_engines["z1-fp32:theirs"])
    assert tiny and all(d.endswith("l1.weight exp_avg") for d in tiny)
    autotp = engine_differences(autotp_engines["wrong"], autotp_engines["autotp-z3-bf16-tied:theirs"])
    assert autotp and all(d.endswith("model.layers.0.self_attn.o_proj.weight exp_avg") for d in autotp)


def test_moe_ep2_holds_every_expert_under_its_global_id(ckpt_root, tmp_path):
    """ds_to_universal 0.19.8 cannot convert MoE with ep_size 2 (it joins different experts: 'shape [6, 8] is
    invalid for input of size 96'), so there is no reference: ucp's output holds every expert's states under its
    global id, equal to ucp's own conversion (test_convert_moe checks that against the live engine). Stock
    load_universal names experts by their local ids, so only an ep_size 1 engine loads them right; resume other
    expert-parallel sizes through ucp.deepspeed."""
    source = build_family(MOE, ckpt_root) / "ep2-z2" / "ckpt"
    ours = ours_of(source, tmp_path / "universal")
    atomic = ucp.open_checkpoint(convert(source, tmp_path / "ucp", progress=False).output)
    experts = [n for n in atomic.names if ".deepspeed_experts." in n]
    assert {n.split(".deepspeed_experts.")[1].split(".")[0] for n in experts} == {"0", "1", "2", "3"}
    for name in (n for n in atomic.names if atomic.info(n).kind == "param"):
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            saved = torch.load(ours / "zero" / name / f"{state}.pt", weights_only=False)
            assert torch.equal(saved["param"], atomic.tensor(name, state)), (name, state)
    # Negative control: experts 0 and 2 (held by different EP ranks) differ, so a mix-up would show.
    w1 = {n.split(".deepspeed_experts.")[1][0]: atomic.tensor(n) for n in experts if n.endswith(".w1.weight")}
    assert not torch.equal(w1["0"], w1["2"])


def test_zero0_is_refused_in_one_line(tiny_checkpoint, tmp_path, capsys):
    """Stock DeepSpeed has no universal layout for ZeRO-0 (ds_to_universal fails on it): one line, exit 2."""
    code = main(["convert", "--input", str(tiny_checkpoint(TinySpec(stage=0))), "--output", str(tmp_path / "out"),
                 "--format", "deepspeed", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "needs a ZeRO 1-3 source" in err, err


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


@pytest.mark.parametrize("source", [TINY["z1-fp32"], TINY["z3-bf16"]], ids=lambda s: s.name)
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
