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

from support.atomic import write_checkpoint
from support.launch import run_torchrun
from ucp.layout import Layout, Replica, Stage, choose_global_split
from ucp.reference_tp import RefConfig, full_forward, init_weights, param_table
from ucp.splits import SplitPolicy

SCRIPT = Path(__file__).resolve().parent / "support" / "hmp_forward.py"
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
    blind = ckpt.parent / "blind"
    blind.mkdir()
    index = json.loads((ckpt / "ucp_index.json").read_text())
    for entry in index["params"].values():
        for state in entry["states"].values():
            state.pop("splits", None)
    for f in index["files"]:
        (blind / f).symlink_to(ckpt / f)
    (blind / "ucp_index.json").write_text(json.dumps(index))
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
        assert stats["bytes_read"] == stats["share_bytes"], (name, rank, stats)
        assert stats["read_calls"] <= stats["tensors"], (name, rank, stats)
