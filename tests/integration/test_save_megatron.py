"""Asynchronous saves (`ucp.deepspeed.save`) from a Megatron-style mpu (TP=2) inside a PipelineModule (PP=2).

train_megatron.py's GPT (4 ranks, DP=1) declares its layout with Megatron-DeepSpeed's pattern lists: a
vocabulary-parallel word embedding padded from 37 to 40 rows and tied to the output head on the last stage, a
fused QKV under GQA and a fused SwiGLU gate/up (each TP shard a block of rows of every sub-parameter),
row-parallel linears, replicated layernorms and biases, `mlp.input_scale` "to average" (its TP copies drift
apart; the checkpoint holds their mean) and a buffer. Each run trains 4 steps in one launch, saves with ucp
and, at the same step, with DeepSpeed's `save_checkpoint` after 2, and with ucp again after 4: fp32 through
`ucp.deepspeed.save`, bf16 through the config's `"save": {"every": 2}`.

The ucp save must equal `ucp convert` of DeepSpeed's checkpoint: names, shapes, patterns, metadata, and every
state of every tensor `torch.equal` (`support.atomic.assert_same_checkpoint`), `verify` clean; negative control:
the last step's save fails the same comparison. Every byte is written once: the ranks' writes add up to the
checkpoint's bytes, fewer than what they hold (the tied embedding on both stages, replicated tensors on
both TP ranks). The bf16 run also keeps the host-memory tier on 2 simulated nodes: each node's copy of the
last step is the disk save of that step. ZeRO-0 is refused in one line: `ucp convert` does not read those
checkpoints, so nothing could show what a save should write. Loading into this layout is refused in one line too
(not served yet).
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

import ucp
from support.atomic import assert_same_checkpoint
from support.checkpoints import SUPPORT_DIR
from support.launch import run_torchrun
from support.memory_runs import memory_equals_saved
from ucp.convert import convert

SAVED_AT, STEPS = 2, 4
SAVING = {"steps": STEPS, "save_after": SAVED_AT, "save_dir": "ckpt", "ucp_save": "ucp",
          "losses_out": "losses.json", "save_bytes_out": "bytes.json"}
RUNS = {"z1-fp32": {"stage": 1, **SAVING},
        # through the config's "save": {"every": 2} (train_batch wrapped), with client state
        "z1-bf16-every": {"stage": 1, "dtype": "bf16", **SAVING, "ucp_every": SAVED_AT, "save_bytes_out": None,
                          "ucp_memory": "memory"}}
REFUSED = {"z0-fp32": {"stage": 0, "refusal_out": "refusal.json"},
           # loading into this layout (TP 2 under an mpu): the z1-fp32 run's save of SAVED_AT
           "z1-load": {"stage": 1, "refusal_out": "refusal.json", "load_from": f"z1-fp32/ucp/global_step{SAVED_AT}"}}
OUTPUTS = ("save_dir", "ucp_save", "losses_out", "save_bytes_out", "refusal_out", "ucp_memory")


@pytest.fixture(scope="module")
def megatron(ckpt_root) -> Path:
    """The runs' folders (one launch; the ucp code under test runs in it, so it is never cached)."""
    (Path(ckpt_root) / "runs").mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="save-megatron-", dir=Path(ckpt_root) / "runs"))
    resolved = []
    for name, options in {**RUNS, **REFUSED}.items():
        (folder / name).mkdir()
        resolved.append({**options, **{k: str(folder / name / options[k]) for k in OUTPUTS if options.get(k)},
                         **({"load_from": str(folder / options["load_from"])} if "load_from" in options else {})})
    run_torchrun(SUPPORT_DIR / "train_megatron.py", ["--runs", json.dumps(resolved)], 4, folder / "train.log",
                 timeout=900)
    return folder


@pytest.mark.parametrize("run", list(RUNS))
def test_megatron_saves_equal_converted_deepspeed_checkpoints(megatron, run, tmp_path):
    saved = ucp.open_checkpoint(megatron / run / "ucp" / f"global_step{SAVED_AT}")
    assert saved.verify() == []
    converted = ucp.open_checkpoint(convert(megatron / run / "ckpt", tmp_path / "converted", workers=1,
                                            progress=False).output)
    assert_same_checkpoint(saved, converted)
    assert (saved.source["tp"], saved.source["pp"], saved.source["dp"]) == (2, 2, 1)
    patterns = {name: p.pattern["pattern"] for name, p in saved.index.params.items()}
    assert patterns["tied_modules.embed.word_embeddings.weight"] == "shard_hy"  # vocabulary rows, padding cut
    assert saved.index.params["tied_modules.embed.word_embeddings.weight"].shape == (37, 8)
    assert patterns["1.self_attention.query_key_value.weight"] == "shard_nc"
    assert patterns["2.mlp.dense_h_to_4h.weight"] == "shard_nc"
    assert patterns["1.mlp.input_scale"] == "partial"
    assert saved.index.params["1.causal_mask"].kind == "buffer"
    later = ucp.open_checkpoint(megatron / run / "ucp" / f"global_step{STEPS}")
    assert later.verify() == []
    with pytest.raises(AssertionError):  # negative control: another step's save
        assert_same_checkpoint(later, converted)


@pytest.mark.parametrize("run", [name for name, options in RUNS.items() if options.get("ucp_memory")])
def test_megatron_memory_saves_equal_the_disk_saves(megatron, run):
    memory_equals_saved(megatron / run, STEPS, SAVED_AT)


@pytest.mark.parametrize("run", [name for name, options in RUNS.items() if options.get("save_bytes_out")])
def test_each_byte_is_written_once(megatron, run):
    saved = ucp.open_checkpoint(megatron / run / "ucp" / f"global_step{SAVED_AT}")
    ranks = json.loads((megatron / run / "bytes.json").read_text())
    total = sum(p.nbytes for p in saved.index.params.values())
    assert sum(r["written"] for r in ranks) == total
    # Negative control: every rank writing what it holds would write the tied and replicated tensors again.
    assert sum(r["held"] for r in ranks) > total
    assert all(r["written"] > 0 for r in ranks)  # each stage writes its own layers, each TP rank its shards


def test_loading_into_an_mpu_pipeline_at_tp2_is_refused_in_one_line(megatron):
    message = json.loads((megatron / "z1-load" / "refusal.json").read_text())
    assert message is not None and "\n" not in message
    assert f"z1-fp32/ucp/global_step{SAVED_AT}" in message and "mpu at TP 2" in message and "TP 1" in message


def test_zero0_is_refused_in_one_line(megatron):
    message = json.loads((megatron / "z0-fp32" / "refusal.json").read_text())
    assert message is not None and "\n" not in message
    assert "ZeRO stage 1" in message and "mpu" in message
