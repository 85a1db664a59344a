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
last step is the disk save of that step. fp32 without ZeRO (ZeRO-0) saves each TP shard whole; its DeepSpeed
checkpoint names no optimizer slot, so `ucp convert` takes the stages' parameter names (`--param-names`, written
by the run); that save is synchronous (`async_=False`), the others asynchronous; negative control: two slots of
one shape named the other way round convert to another checkpoint. bf16 without ZeRO is refused in one line
(`ucp convert` does not read those checkpoints either).

An mpu without a PipelineModule (`GPTModel`: the same layers in a plain module, the mpu passed to
`deepspeed.initialize`), TP=2 x DP=2, ZeRO-1 (`PLAIN_RUNS`): its save, through `ucp.deepspeed.save` and through
the config's `"save": {"every": 2}`, equals `ucp convert` of its checkpoint, each byte written once, and the
memory tier's copies (2 simulated nodes) equal the disk save; a run through the config's "load" at the same
layout continues the losses exactly, and at TP=1 x DP=4 every rank holds every state of the save. Negative
controls: each TP rank given the other's boxes, another step's save; ZeRO-2 is refused in one line.

Resumes, in the same launch (`RESUMES`): a run whose `mlp.input_scale` copies stay equal (its gradient all-reduced
over TP) saves with ucp after 2 steps, and `ucp.deepspeed.load` puts that save into other layouts, each TP rank
taking the boxes of its shards (`ucp.deepspeed.loading.mpu`): the losses continue the uninterrupted run's at TP=2 x
PP=1 x DP=2 (ZeRO-1 and ZeRO-0) within 1e-6, and exactly at the same layout (through the config's `"load"`); at
TP=1 x PP=2 x DP=2 every rank holds every state of the checkpoint. Negative controls: each TP rank given the other's
boxes does not continue the losses; DeepSpeed's own `load_checkpoint` at TP=2 x PP=1 x DP=2 fails.
"""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch

import ucp
from support.atomic import assert_same_checkpoint
from support.checkpoints import SUPPORT_DIR
from support.launch import run_torchrun
from support.memory_runs import memory_equals_saved
from ucp.convert import convert
from ucp.errors import AmbiguousPatternError

SAVED_AT, STEPS = 2, 4
SAVING = {"steps": STEPS, "save_after": SAVED_AT, "save_dir": "ckpt", "ucp_save": "ucp",
          "losses_out": "losses.json", "save_bytes_out": "bytes.json"}
RUNS = {"z1-fp32": {"stage": 1, **SAVING},
        # through the config's "save": {"every": 2} (train_batch wrapped), with client state
        "z1-bf16-every": {"stage": 1, "dtype": "bf16", **SAVING, "ucp_every": SAVED_AT, "save_bytes_out": None,
                          "ucp_memory": "memory"},
        # without ZeRO: each TP shard whole; `ucp convert` names the optimizer slots from --param-names; the save
        # compared is synchronous (async_=False)
        "z0-fp32": {"stage": 0, **SAVING, "param_names_out": "names.txt", "ucp_sync": True},
        # the same at TP=2 x PP=1 x DP=2: each TP shard whole on both DP ranks, written by one of them
        "z0-fp32-dp2": {"stage": 0, "tp": 2, "pp": 1, **SAVING, "param_names_out": "names.txt"}}
# bf16 without ZeRO: DeepSpeed's bf16 optimizer files record no param_shapes, and `ucp convert` does not read them
REFUSED = {"z0-bf16": {"stage": 0, "dtype": "bf16", "refusal_out": "refusal.json"}}
# Resumes: the uninterrupted "z1-sync" run (input_scale's TP copies kept equal) saves at SAVED_AT; each resume loads
# that save at its layout and trains to STEPS. TP=2 x PP=1 x DP=2 also under ZeRO-0, where each shared box is read
# once and broadcast over DP. At TP 1 this model does not train as at TP 2 even from scratch (the third step's
# loss differs by 5e-5: TP's split sums round otherwise, and Adam's first steps turn such differences into full
# updates), so the TP=1 x PP=2 x DP=2 load (which cuts the vocabulary padding) is checked state by state instead.
SYNCED = f"z1-sync/ucp/global_step{SAVED_AT}"
RESUMES = {"z1-sync": {"stage": 1, "sync_scale": True, **SAVING, "save_bytes_out": None},
           "resume-tp2-pp1-dp2": {"stage": 1, "sync_scale": True, "tp": 2, "pp": 1, "steps": STEPS,
                                  "load_from": SYNCED, "losses_out": "losses.json"},
           "resume-same": {"stage": 1, "sync_scale": True, "steps": STEPS, "ucp_load": SYNCED,
                           "losses_out": "losses.json"},  # through the config's "ucp": {"load": ...}
           "resume-tp2-pp1-dp2-z0": {"stage": 0, "sync_scale": True, "tp": 2, "pp": 1, "steps": STEPS,
                                     "load_from": SYNCED, "losses_out": "losses.json"},
           "load-tp1-pp2-dp2": {"stage": 1, "sync_scale": True, "tp": 1, "pp": 2, "steps": SAVED_AT,
                                "load_from": SYNCED, "dump_state": "state.pt"},
           # negative controls: each TP rank given the other's boxes; DeepSpeed's own load at another layout
           "swapped": {"stage": 1, "sync_scale": True, "steps": STEPS, "load_from": SYNCED, "swap_tp_boxes": True,
                       "losses_out": "losses.json"},
           # a DeepSpeed checkpoint into the fused shards at TP 2: refused in one line (convert it first)
           "ds-source": {"stage": 1, "sync_scale": True, "load_from": "z1-sync/ckpt", "error_out": "error.json"},
           "stock-tp2-pp1-dp2": {"stage": 1, "sync_scale": True, "tp": 2, "pp": 1, "steps": STEPS,
                                 "stock_load": "z1-sync/ckpt", "error_out": "error.json", "losses_out": "losses.json"}}
# An mpu without a PipelineModule: the same layers in a plain module at TP=2 x DP=2 (ZeRO-1, input_scale's copies
# kept equal). It saves as z1-fp32 does; a run through the config's "load" at the same layout continues its losses
# exactly; at TP=1 x DP=4 every rank holds every state of the save (the TP=1 losses are not the TP=2 run's, see
# above). Negative controls: each TP rank given the other's boxes; ZeRO-2 refused in one line.
PLAIN = {"plain": True, "stage": 1, "sync_scale": True, "tp": 2}
PLAIN_SAVED = f"plain-z1/ucp/global_step{SAVED_AT}"
PLAIN_RUNS = {"plain-z1": {**PLAIN, **SAVING},
              # through the config's "save": {"every": 2} (engine.step wrapped), with the memory tier
              "plain-every": {**PLAIN, **SAVING, "ucp_every": SAVED_AT, "save_bytes_out": None, "ucp_memory": "memory"},
              "plain-resume-same": {**PLAIN, "steps": STEPS, "ucp_load": PLAIN_SAVED, "losses_out": "losses.json"},
              "plain-load-tp1": {**PLAIN, "tp": 1, "steps": SAVED_AT, "load_from": PLAIN_SAVED,
                                 "dump_state": "state.pt"},
              "plain-swapped": {**PLAIN, "steps": STEPS, "load_from": PLAIN_SAVED, "swap_tp_boxes": True,
                                "losses_out": "losses.json"},
              "plain-z2": {**PLAIN, "stage": 2, "refusal_out": "refusal.json"}}
OUTPUTS = ("save_dir", "ucp_save", "losses_out", "save_bytes_out", "refusal_out", "ucp_memory", "error_out",
           "dump_state", "param_names_out")
FROM_RUNS = ("load_from", "ucp_load", "stock_load")  # paths under another run's folder


@pytest.fixture(scope="module")
def megatron(ckpt_root) -> Path:
    """The runs' folders (one launch; the ucp code under test runs in it, so it is never cached)."""
    (Path(ckpt_root) / "runs").mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix="save-megatron-", dir=Path(ckpt_root) / "runs"))
    resolved = []
    for name, options in {**RUNS, **REFUSED, **RESUMES, **PLAIN_RUNS}.items():
        (folder / name).mkdir()
        resolved.append({**options, **{k: str(folder / name / options[k]) for k in OUTPUTS if options.get(k)},
                         **{k: str(folder / options[k]) for k in FROM_RUNS if k in options}})
    run_torchrun(SUPPORT_DIR / "train_megatron.py", ["--runs", json.dumps(resolved)], 4, folder / "train.log",
                 timeout=900)
    return folder


@pytest.mark.parametrize("run", list(RUNS))
def test_megatron_saves_equal_converted_deepspeed_checkpoints(megatron, run, tmp_path):
    saved = ucp.open_checkpoint(megatron / run / "ucp" / f"global_step{SAVED_AT}")
    assert saved.verify() == []
    names = RUNS[run].get("param_names_out") and (megatron / run / "names.txt").read_text().split()
    converted = ucp.open_checkpoint(convert(megatron / run / "ckpt", tmp_path / "converted", workers=1,
                                            progress=False, param_names=names or None).output)
    assert_same_checkpoint(saved, converted)
    tp, pp = RUNS[run].get("tp", 2), RUNS[run].get("pp", 2)
    assert (saved.source["tp"], saved.source["pp"], saved.source["dp"]) == (tp, pp, 4 // (tp * pp))
    patterns = {name: p.pattern["pattern"] for name, p in saved.index.params.items()}
    # vocabulary rows, padding cut; each TP shard partitioned again by ZeRO-1 (Shard-Hy), or whole (Shard-V)
    assert patterns["tied_modules.embed.word_embeddings.weight"] == ("shard_hy" if RUNS[run]["stage"] else "shard_v")
    assert saved.index.params["tied_modules.embed.word_embeddings.weight"].shape == (37, 8)
    assert patterns["1.self_attention.query_key_value.weight"] == "shard_nc"
    assert patterns["2.mlp.dense_h_to_4h.weight"] == "shard_nc"
    assert patterns["1.mlp.input_scale"] == "partial"
    assert saved.index.params["1.causal_mask"].kind == "buffer"
    later = ucp.open_checkpoint(megatron / run / "ucp" / f"global_step{STEPS}")
    assert later.verify() == []
    with pytest.raises(AssertionError):  # negative control: another step's save
        assert_same_checkpoint(later, converted)


def test_zero0_slots_named_the_other_way_round_convert_to_another_checkpoint(megatron, tmp_path):
    """Negative control for the ZeRO-0 comparison: two optimizer slots of one shape on one stage named the other
    way round (a layer's two layernorm weights: each keeps its weight from the layer files, takes the other's
    Adam moments) convert into a checkpoint the save does not equal."""
    names = (megatron / "z0-fp32" / "names.txt").read_text().split()
    first, second = names.index("1.input_layernorm.weight"), names.index("1.post_attention_layernorm.weight")
    names[first], names[second] = names[second], names[first]
    saved = ucp.open_checkpoint(megatron / "z0-fp32" / "ucp" / f"global_step{SAVED_AT}")
    swapped = convert(megatron / "z0-fp32" / "ckpt", tmp_path / "swapped", workers=1, progress=False,
                      param_names=names)
    with pytest.raises(AssertionError):
        assert_same_checkpoint(saved, ucp.open_checkpoint(swapped.output))
    # without the names, one line that says which flag settles it
    with pytest.raises(AmbiguousPatternError, match=r"^[^\n]*--param-names FILE[^\n]*$"):
        convert(megatron / "z0-fp32" / "ckpt", tmp_path / "unnamed", workers=1, progress=False)


def test_bf16_without_zero_is_refused_in_one_line(megatron):
    message = json.loads((megatron / "z0-bf16" / "refusal.json").read_text())
    assert message and "\n" not in message and "mpu" in message and "stage 1" in message


@pytest.mark.parametrize("run", [name for name, options in {**RUNS, **PLAIN_RUNS}.items()
                                 if options.get("ucp_memory")])
def test_megatron_memory_saves_equal_the_disk_saves(megatron, run):
    memory_equals_saved(megatron / run, STEPS, SAVED_AT)


@pytest.mark.parametrize("run", [name for name, options in {**RUNS, **PLAIN_RUNS}.items()
                                 if options.get("save_bytes_out")])
def test_each_byte_is_written_once(megatron, run):
    saved = ucp.open_checkpoint(megatron / run / "ucp" / f"global_step{SAVED_AT}")
    ranks = json.loads((megatron / run / "bytes.json").read_text())
    total = sum(p.nbytes for p in saved.index.params.values())
    assert sum(r["written"] for r in ranks) == total
    # Negative control: every rank writing what it holds would write the tied and replicated tensors again.
    assert sum(r["held"] for r in ranks) > total
    assert all(r["written"] > 0 for r in ranks)  # each stage writes its own layers, each TP rank its shards


def _losses(megatron: Path, run: str) -> list[float]:
    return json.loads((megatron / run / "losses.json").read_text())


def _continues(resumed: list[float], uninterrupted: list[float]) -> bool:
    # 1e-6 relative: another TP x DP layout sums the same fp32 terms in another order (all-reduces, the
    # vocabulary-parallel logits); the same layout continues them exactly.
    return len(resumed) == len(uninterrupted) and all(abs(a - b) <= 1e-6 * abs(b)
                                                      for a, b in zip(resumed, uninterrupted))


@pytest.mark.parametrize("run", ["resume-tp2-pp1-dp2", "resume-same", "resume-tp2-pp1-dp2-z0"])
def test_a_resume_at_another_layout_continues_the_losses(megatron, run):
    uninterrupted = _losses(megatron, "z1-sync")
    assert len(uninterrupted) == STEPS
    assert _continues(_losses(megatron, run), uninterrupted[SAVED_AT:])
    if run == "resume-same":
        assert _losses(megatron, run) == uninterrupted[SAVED_AT:]


@pytest.mark.parametrize("run,source", [("load-tp1-pp2-dp2", SYNCED), ("plain-load-tp1", PLAIN_SAVED)])
def test_a_load_at_tp1_gives_every_rank_every_state_of_the_checkpoint(megatron, run, source):
    """TP=1 x PP=2 x DP=2 (TP=1 x DP=4 without a pipeline): each rank's fp32 masters and Adam moments (gathered
    over DP) are the checkpoint's full tensors, the word embedding's padding rows as initialised (zero), the step
    the saved one."""
    saved = ucp.open_checkpoint(megatron / source)
    dumped = torch.load(megatron / run / "state.pt", weights_only=False)
    assert dumped["global_steps"] == SAVED_AT
    seen = set()
    for rank in dumped["ranks"]:
        for name, states in rank["params"].items():
            for state, value in states.items():
                expected = saved.tensor(name, state)
                assert torch.equal(value[:expected.shape[0]], expected), (name, state)
                assert not value[expected.shape[0]:].any()
                seen.add(name)
    assert seen == {name for name in saved.names if saved.info(name).kind == "param"}


def test_a_wrong_box_does_not_continue_the_losses(megatron):
    """Negative control for the boxes: each TP rank given the other TP rank's (same shapes, so it loads)."""
    assert not _continues(_losses(megatron, "swapped"), _losses(megatron, "z1-sync")[SAVED_AT:])


def test_deepspeeds_own_load_at_another_layout_does_not_continue(megatron):
    """Negative control for the resume: DeepSpeed's load_checkpoint of the same step at TP=2 x PP=1 x DP=2."""
    error = megatron / "stock-tp2-pp1-dp2" / "error.json"
    if error.exists():
        assert json.loads(error.read_text())
    else:
        assert not _continues(_losses(megatron, "stock-tp2-pp1-dp2"), _losses(megatron, "z1-sync")[SAVED_AT:])


def test_a_deepspeed_checkpoint_into_fused_tp_shards_is_refused_in_one_line(megatron):
    message = json.loads((megatron / "ds-source" / "error.json").read_text())
    assert "\n" not in message and "z1-sync/ckpt" in message and "ucp convert" in message
    assert "query_key_value" in message or "dense_h_to_4h" in message


@pytest.mark.parametrize("run", ["plain-z1", "plain-every"])
def test_an_mpu_without_a_pipeline_saves_what_ucp_convert_writes(megatron, run, tmp_path):
    saved = ucp.open_checkpoint(megatron / run / "ucp" / f"global_step{SAVED_AT}")
    assert saved.verify() == []
    converted = ucp.open_checkpoint(convert(megatron / run / "ckpt", tmp_path / "converted", workers=1,
                                            progress=False).output)
    assert_same_checkpoint(saved, converted)
    assert (saved.source["tp"], saved.source.get("pp", 1), saved.source["dp"]) == (2, 1, 2)
    patterns = {name: p.pattern["pattern"] for name, p in saved.index.params.items()}
    assert patterns["embed.word_embeddings.weight"] == "shard_hy"
    assert saved.index.params["embed.word_embeddings.weight"].shape == (37, 8)
    assert patterns["1.self_attention.query_key_value.weight"] == "shard_nc"
    assert patterns["2.self_attention.dense.weight"] == "shard_hy"  # row-parallel, each shard split by ZeRO
    later = ucp.open_checkpoint(megatron / run / "ucp" / f"global_step{STEPS}")
    with pytest.raises(AssertionError):  # negative control: another step's save
        assert_same_checkpoint(later, converted)


def test_an_mpu_without_a_pipeline_resumes_the_run(megatron):
    uninterrupted = _losses(megatron, "plain-z1")
    assert len(uninterrupted) == STEPS
    assert _losses(megatron, "plain-resume-same") == uninterrupted[SAVED_AT:]
    # negative control: each TP rank given the other's boxes
    assert not _continues(_losses(megatron, "plain-swapped"), uninterrupted[SAVED_AT:])


def test_an_mpu_without_a_pipeline_under_zero2_is_refused_in_one_line(megatron):
    message = json.loads((megatron / "plain-z2" / "refusal.json").read_text())
    assert message and "\n" not in message and "mpu" in message and "stage 1" in message
