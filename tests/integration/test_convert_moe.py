"""Native DeepSpeed MoE sources (4 experts, ep_size 1 and 2, ZeRO-0/1/2) on 2 ranks.

Optimizer files keep each EP rank's experts under local ids; ucp names every expert by its global
id. The reference is every rank's gathered fp32 state at save time, its local expert ids mapped to
global ones by the training script from DeepSpeed's own expert-parallel rank. Every comparison is
`torch.equal`.

ZeRO-0 writes no ZeRO optimizer files but `expp_rank_{E}_mp_rank_00_optim_states.pt`: EP rank E's
whole torch optimizer state (with fp32 masters under bf16), by slot position. DeepSpeed 0.19.8's
ds_to_universal stops on them (it reads expp_rank_0 as a ZeRO optimizer file: KeyError
'optimizer_state_dict'), so it is not compared.
"""
from __future__ import annotations

import pytest
import torch

import ucp
from support.checkpoints import load_ds_universal
from support.fragments import torch_fragment
from support.parallel import (
    MOE,
    build_family,
    compare_with_ds_universal,
    ds_universal_of,
    reference_state,
    trainable_count,
)
from ucp.convert import convert
from ucp.converters.deepspeed.slices import load_dict, read_slice
from ucp.converters.deepspeed.zero0 import zero0_slice
from ucp.converters.tag_folder import model_files, optim_files
from ucp.patterns import FragmentInfo, Pattern, PatternSpec
from ucp.plan.assemble import assemble
from ucp.plan.plan import StateSource
from ucp.plan.primitives import ReplicaMismatchError

RUNS = [name for name, _ in MOE.runs]
STATES = ("fp32", "exp_avg", "exp_avg_sq")
EXPERT = "moe.deepspeed_moe.experts.deepspeed_experts.{}.w1.weight"


@pytest.fixture(scope="module")
def moe(ckpt_root):
    return build_family(MOE, ckpt_root)


@pytest.fixture(scope="module")
def converted(moe, tmp_path_factory):
    memo = {}

    def make(run: str):
        if run not in memo:
            out = tmp_path_factory.mktemp("ucp-moe") / run
            convert(moe / run / "ckpt", out, workers=2, progress=False, strict=True)
            memo[run] = ucp.open_checkpoint(out)
        return memo[run]

    return make


@pytest.mark.parametrize("run", RUNS)
def test_equals_live_engine_state(run, moe, converted):
    ckpt, live = converted(run), reference_state(moe / run)
    # Under bf16 ZeRO-0 the engine's helpers see only the bf16 module weights, which the fp32 masters round to;
    # test_zero0_equals_the_saved_slots checks the masters and moments against the files.
    rounded = run == "ep2-z0-bf16"
    seen = set()
    for rank in live["ranks"]:
        for name, states in rank["params"].items():
            for state in ("fp32",) if rounded else STATES:
                got = ckpt.tensor(name, state)
                assert torch.equal(got.bfloat16().float() if rounded else got, states[state]), (run, rank["ep_rank"],
                                                                                                name, state)
            seen.add(name)
    assert {n for n in ckpt.names if ckpt.info(n).kind == "param"} == seen
    assert all(EXPERT.format(e) in seen for e in range(4))
    if not rounded:  # DeepSpeed 0.19's bf16 ZeRO-0 optimizer counts one step more than the engine
        for e in range(4):
            assert ckpt.tensor(EXPERT.format(e), "step").item() == live["global_steps"]


# Each EP rank's optimizer slots, in order: the dense parameters, then its local experts' parameters.
DENSE = ["emb.weight", "moe.deepspeed_moe.gate.wg.weight", "head.weight", "head.bias"]
EXPERT_PARAMS = ["w1.weight", "w1.bias", "w2.weight"]


@pytest.mark.parametrize("run", ["ep1-z0", "ep2-z0", "ep2-z0-bf16"])
def test_zero0_equals_the_saved_slots(run, moe, converted):
    """Every expp_rank file, its slots named by hand (dense first, then the global experts of its EP rank),
    holds exactly what ucp wrote: moments, step, and under bf16 the fp32 masters; copies in several files agree.

    DeepSpeed numbers the files by the process's largest EP group: ep1-z0, trained after ep_size 2 runs in the
    same launch, has two files (ranks 0 and 1), each with all four experts."""
    ckpt, tag = converted(run), next(p for p in (moe / run / "ckpt").iterdir() if p.is_dir())
    ep = 1 if run.startswith("ep1") else 2
    files = sorted(tag.glob("expp_rank_*"))
    assert [p.name for p in files] == [f"expp_rank_{f}_mp_rank_00_optim_states.pt" for f in range(2)]
    for f, path in enumerate(files):
        saved = torch.load(path, weights_only=False)["optimizer"]
        inner = saved.get("optimizer_state_dict", saved)
        masters = [t for group in saved.get("fp32_groups", []) for t in group]
        experts = range(f % ep * 4 // ep, (f % ep + 1) * 4 // ep)
        names = DENSE + [EXPERT.format(x).replace("w1.weight", p) for x in experts for p in EXPERT_PARAMS]
        assert len(names) == len(inner["state"])
        for slot, name in enumerate(names):
            for state in STATES[1:] + ("step",):
                assert torch.equal(ckpt.tensor(name, state), inner["state"][slot][state].float()), (f, name, state)
            if masters:
                assert torch.equal(ckpt.tensor(name, "fp32"), masters[slot]), (f, name)
    assert ckpt.source["zero_stage"] == 0 and ckpt.source["ep"] == ep
    assert ckpt.index.params["head.weight"].pattern["pattern"] == "replicate"
    assert ckpt.index.params[EXPERT.format(3)].pattern["pattern"] == ("replicate" if ep == 1 else "unique")


@pytest.mark.parametrize("run", RUNS)
def test_experts_keep_global_ids_and_distinct_values(run, moe, converted):
    ckpt = converted(run)
    ep = 1 if run.startswith("ep1") else 2
    assert ckpt.source["ep"] == ep
    weights = [ckpt.tensor(EXPERT.format(e)) for e in range(4)]
    assert all(not torch.equal(weights[a], weights[b]) for a in range(4) for b in range(a + 1, 4))
    # Each expert file holds that global expert's module copy: the fp32 master rounded to the model dtype.
    for e in range(4):
        module = torch.load(next((moe / run / "ckpt").glob(f"*/layer_0_expert_{e}_mp_rank_00_model_states.pt")),
                            weights_only=False)[EXPERT.format(e)]
        assert torch.equal(weights[e].to(module.dtype), module), (run, e)
    # ZeRO-1/2 partitions an expert as flat runs; ZeRO-0 keeps it whole in one EP rank's file.
    assert ckpt.index.params[EXPERT.format(3)].pattern.get("flat", False) == ("-z0" not in run)


def test_equals_ds_to_universal_at_ep1(moe, converted):
    """ds_to_universal handles ep_size 1 (local ids are global); at ep_size 2 it fails (not run here)."""
    ckpt, reference = converted("ep1-z1"), load_ds_universal(ds_universal_of(moe / "ep1-z1"))
    assert compare_with_ds_universal(ckpt, reference) == 4 * trainable_count(ckpt)


def test_negative_control_local_names_taken_as_global(moe, converted):
    """Reading the EP ranks' local expert 0 as one parameter, as their shared name suggests, is wrong both ways:
    as Replicate the copies differ (they are global experts 0 and 2), as Shard-V (ds_to_universal's join) the
    pieces hold twice the expert's elements."""
    tag = next(p for p in (moe / "ep2-z2" / "ckpt").iterdir() if p.is_dir())
    names = sorted(p.name for p in tag.iterdir())
    model_path = model_files(tag, names)[0]
    local = read_slice(tag, 0, model_path, load_dict(model_path), optim_files(tag, names))  # no renaming
    frags = tuple(local.fragments[(EXPERT.format(0), "fp32")])
    assert [f.info.rank for f in frags] == [0, 1]
    pieces = [torch_fragment(f) for f in frags]
    ckpt = converted("ep2-z2")
    assert torch.equal(pieces[0].reshape(6, 8), ckpt.tensor(EXPERT.format(0)))
    assert torch.equal(pieces[1].reshape(6, 8), ckpt.tensor(EXPERT.format(2)))
    replicate = StateSource(PatternSpec(Pattern.REPLICATE, (48,)), frags)
    with pytest.raises(ReplicaMismatchError):
        assemble(replicate, pieces, name=EXPERT.format(0), strict=True)
    joined = StateSource(PatternSpec(Pattern.SHARD_V, (96,), flat=True, padded_size=96), frags)
    assert assemble(joined, pieces, name=EXPERT.format(0)).numel() == 2 * ckpt.tensor(EXPERT.format(0)).numel()
    assert [FragmentInfo(r, (48,), 48 * r) for r in range(2)] == [f.info for f in frags]


def test_negative_control_zero0_local_experts_taken_as_global(moe, converted):
    """Naming EP rank 1's ZeRO-0 slots after experts 0 and 1 (its local ids, as if they were global) fits every
    shape, so only the values can tell: they are experts 2 and 3, and fail the comparison with expert 0."""
    tag = next(p for p in (moe / "ep2-z0" / "ckpt").iterdir() if p.is_dir())
    model = load_dict(tag / "mp_rank_00_model_states.pt")
    wrong_experts = {}
    for e in (0, 1):
        path = tag / f"layer_0_expert_{e}_mp_rank_00_model_states.pt"
        wrong_experts.update({k: v for k, v in load_dict(path).items() if k.startswith("moe.")})
    path = tag / "expp_rank_1_mp_rank_00_optim_states.pt"
    wrong = zero0_slice(1, path, {**model, "optimizer": load_dict(path)["optimizer"],
                                  "module": {**model["module"], **wrong_experts}})
    ckpt, live = converted("ep2-z0"), reference_state(moe / "ep2-z0")["ranks"][0]["params"]
    moment = torch_fragment(wrong.fragments[(EXPERT.format(0), "exp_avg")][0])
    assert torch.equal(ckpt.tensor(EXPERT.format(0), "exp_avg"), live[EXPERT.format(0)]["exp_avg"])
    assert moment.shape == live[EXPERT.format(0)]["exp_avg"].shape
    assert not torch.equal(moment, live[EXPERT.format(0)]["exp_avg"])
    assert torch.equal(moment, ckpt.tensor(EXPERT.format(2), "exp_avg"))
