"""HMP loading end to end: the reference TP model under heterogeneous layouts on CPU ranks (gloo).

A ucp checkpoint of the reference model is written split-major (global_split 2) through ucp's own
writer; torchrun ranks load their slices through the layout (`ucp.hmp.load_slices`) and run the
forward pass. Every replica's logits must equal the unsharded model's, each rank must read exactly
its own slices in at most one read per tensor. Negative control: the same checkpoint with its
split metadata removed, which is what a reader blind to split-major order would load, must fail
the same comparison.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import ucp
from support.atomic import write_checkpoint
from support.checkpoints import SUPPORT_DIR
from support.launch import run_torchrun
from support.reference_tp import RefConfig, StageModule, full_forward, init_weights, param_table
from ucp.convert.split_policy import SplitPolicy
from ucp.deepspeed.engine.placement import place_by_layout
from ucp.deepspeed.engine.targets import Target, TargetTensor
from ucp.errors import UnsupportedLayoutError
from ucp.format.index import stored_shape
from ucp.format.safetensors_stream import read_stored
from ucp.hmp.layout import Layout, LayoutError, Replica, Stage, choose_global_split

SCRIPT = SUPPORT_DIR / "hmp_forward.py"
CFG = RefConfig(vocab=13, hidden=8, ffn=12, layers=4)
TOKENS_SEED = 7

pytestmark = pytest.mark.slow


def _layout(*replicas: list[tuple[tuple[int, int], tuple[int, ...]]]) -> Layout:
    return Layout(CFG.layers, tuple(Replica(tuple(Stage(layers, ranks) for layers, ranks in stages), 1)
                                    for stages in replicas))


LAYOUTS = {
    # the case: replica 0 with TP=2, replica 1 with TP=1
    "tp2+tp1": _layout([((0, 4), (0, 1))], [((0, 4), (2,))]),
    # uneven pipeline in one replica (TP2 for 3 layers, TP1 for 1), a TP1 replica beside it
    "pp[tp2:3,tp1:1]+tp1": _layout([((0, 3), (0, 1)), ((3, 4), (2,))], [((0, 4), (3,))]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    weights = init_weights(CFG, seed=3)
    rules = tuple((re.escape(s.name) + "$", s.dim) for s in param_table(CFG))
    split = choose_global_split(t for layout in LAYOUTS.values() for t in layout.tp_sizes)
    ckpt = write_checkpoint(tmp_path_factory.mktemp("hmp") / "ckpt", {n: {"fp32": w} for n, w in weights.items()},
                            SplitPolicy(split, rules))
    tokens = torch.randint(0, CFG.vocab, (2, 5), generator=torch.Generator().manual_seed(TOKENS_SEED))
    expected = full_forward({n: w.to(torch.float64) for n, w in weights.items()}, CFG, tokens)
    blind = _without_split_metadata(ckpt, ckpt.parent / "blind")
    return ckpt, blind, expected


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hmp_forward_equals_unsharded_model(name, reference, tmp_path):
    ckpt, blind, expected = reference
    layout = LAYOUTS[name]
    (tmp_path / "layout.json").write_text(json.dumps(layout.to_json()))
    run_torchrun(SCRIPT, [tmp_path / "layout.json", ckpt, tmp_path, "--config", json.dumps(CFG.__dict__),
                          "--control", blind], layout.world_size, tmp_path / "run.log", timeout=300)
    for i in range(len(layout.replicas)):
        got = torch.load(tmp_path / f"replica{i}.pt")
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12, msg=f"{name}: replica {i}")
    for i in range(len(layout.replicas)):
        control = torch.load(tmp_path / f"control_replica{i}.pt")
        assert not torch.allclose(control, expected, rtol=1e-6, atol=1e-6), f"{name}: control replica {i}"
    for rank in range(layout.world_size):
        stats = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert stats["bytes_read"] - stats["bytes_checked_extra"] == stats["share_bytes"], (name, rank, stats)
        assert stats["read_calls"] <= stats["tensors"], (name, rank, stats)


@pytest.fixture(scope="module")
def trained_reference(tmp_path_factory):
    """A split-major checkpoint of the reference model with Adam moments, and its tensors."""
    g = torch.Generator().manual_seed(11)
    tensors = {n: {"fp32": w, "exp_avg": torch.randn(w.shape, generator=g) * 0.1,
                   "exp_avg_sq": torch.rand(w.shape, generator=g) * 0.01}
               for n, w in init_weights(CFG, seed=5).items()}
    rules = tuple((re.escape(s.name) + "$", s.dim) for s in param_table(CFG))
    split = choose_global_split(t for layout in LAYOUTS.values() for t in layout.tp_sizes)
    root = tmp_path_factory.mktemp("hmp-ds")
    ckpt = write_checkpoint(root / "ckpt", tensors, SplitPolicy(split, rules))
    blind = _without_split_metadata(ckpt, root / "blind")
    return ckpt, blind, tensors


def _without_split_metadata(ckpt: Path, blind: Path) -> Path:
    """What a reader blind to split-major order would load: each state's bytes, in the order they are stored, read
    as a row-major tensor of its shape; written as a checkpoint that says so (a copy whose index merely drops the
    `splits` entries disagrees with its files' safetensors headers, and ucp refuses it)."""
    index = ucp.open_checkpoint(ckpt).index
    tensors = {name: {state: read_stored(str(ckpt / s.file), s.begin, s.end, s.dtype, stored_shape(s.shape, s.splits),
                                         s.crc32).reshape(s.shape)
                      for state, s in entry.states.items()} for name, entry in index.params.items()}
    return write_checkpoint(blind, tensors)


def _run_hook(layout: Layout, ckpt: Path, out: Path) -> None:
    out.mkdir()
    (out / "layout.json").write_text(json.dumps(layout.to_json()))
    run_torchrun(SCRIPT, [out / "layout.json", ckpt, out, "--config", json.dumps(CFG.__dict__), "--deepspeed"],
                 layout.world_size, out / "run.log", timeout=300)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hmp_layout_through_the_deepspeed_hook(name, trained_reference, tmp_path):
    """Each rank's own DeepSpeed engine gets exactly its slices of weights and moments, reading only them."""
    ckpt, blind, tensors = trained_reference
    layout = LAYOUTS[name]
    _run_hook(layout, ckpt, tmp_path / "run")
    table = param_table(CFG)
    for rank in range(layout.world_size):
        got = torch.load(tmp_path / "run" / f"rank{rank}.pt")
        owned = layout.rank_slices(rank, table)
        assert set(got) == set(owned), (name, rank)
        share = 0
        for pname, piece in owned.items():
            box = tuple(slice(a, b) for a, b in piece.box)
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                assert torch.equal(got[pname][state], tensors[pname][state][box]), (name, rank, pname, state)
                share += got[pname][state].numel() * 4
            assert float(got[pname]["step"]) == 1.0
        stats = json.loads((tmp_path / "run" / f"rank{rank}.json").read_text())
        assert stats["bytes_read"] - stats["bytes_checked_extra"] == share, (name, rank, stats)
    expected = full_forward({n: s["fp32"].to(torch.float64) for n, s in tensors.items()}, CFG,
                            torch.randint(0, CFG.vocab, (2, 5), generator=torch.Generator().manual_seed(TOKENS_SEED)))
    for i in range(len(layout.replicas)):
        # float64 forward over fp32 weights on both sides; only the order of TP partial sums differs
        torch.testing.assert_close(torch.load(tmp_path / "run" / f"replica{i}.pt"), expected, rtol=1e-12, atol=1e-12)
    # Negative control: the same bytes read as row-major tensors give other slices to TP ranks.
    _run_hook(layout, blind, tmp_path / "blind")
    control = [torch.load(tmp_path / "blind" / f"replica{i}.pt") for i in range(len(layout.replicas))]
    assert not all(torch.allclose(c, expected, rtol=1e-6, atol=1e-6) for c in control), name


def _stage_target(layout: Layout, rank: int) -> Target:
    """The tensors a ZeRO-0 engine over `StageModule(layout, rank)` lists, before placing."""
    target = Target(engine=None)
    for n, p in StageModule(layout, rank, CFG).named_parameters():
        target.tensors.append(TargetTensor(n, "param", tuple(p.shape), 0, p.numel(), True, lambda s, p=p: p.view(-1)))
    return target


def test_placing_by_layout_gives_each_tensor_its_box():
    layout = LAYOUTS["tp2+tp1"]
    target = _stage_target(layout, 1)
    names = place_by_layout(target, layout, param_table(CFG), 1)
    assert names == {s.name for s in param_table(CFG)}
    fc2 = next(t for t in target.tensors if t.name == "layers.0.fc2.weight")
    assert fc2.shape == (CFG.hidden, CFG.ffn) and fc2.box == ((0, CFG.hidden), (CFG.ffn // 2, CFG.ffn))


def test_a_module_built_for_another_layout_is_refused_by_name():
    built_for = LAYOUTS["tp2+tp1"]
    other = _layout([((0, 4), (1, 0))], [((0, 4), (2,))])  # the TP ranks of replica 0 swapped
    with pytest.raises(LayoutError, match=r"embed\.weight: rank 0's module holds shape \(6, 8\), "
                                          r"but the layout gives it box \(\(6, 13\)"):
        place_by_layout(_stage_target(built_for, 0), other, param_table(CFG), 0)
    with pytest.raises(UnsupportedLayoutError, match="layers.0.fc1.bias: the module has it but"):
        place_by_layout(_stage_target(built_for, 2), built_for,
                        [s for s in param_table(CFG) if s.name != "layers.0.fc1.bias"], 2)
