"""Asynchronous saves (`ucp.deepspeed.save`) from engines with model parallelism, against `ucp convert`.

AutoTP: a tiny Llama (vocabulary 37, split 19 + 18 when tied) trains on AutoTP=2 x DP=2 (4 ranks) under
several ZeRO stages in one launch. After 2 steps each run saves asynchronously with ucp and, at the same
step, with DeepSpeed's `save_checkpoint`; it saves with ucp once more after its last step. The ucp save
must equal `ucp convert` of DeepSpeed's checkpoint: names, shapes, patterns, metadata, and every state of
every tensor `torch.equal` (`support.atomic.assert_same_checkpoint`), and `verify` clean. Negative
control: the save of the last step fails the same comparison. One checkpoint then resumes at another
layout (plain DP=2, ZeRO-2) and continues the run's losses.

PipelineModule: train_pipe.py's model (a tied embedding on the first and the last stage) on 2 stages,
ZeRO-1 x DP=2 (4 ranks) and bf16 without ZeRO (BF16_Optimizer, 2 ranks), saves every 2 steps through the
`"ucp": {"save": ...}` config (which wraps `train_batch` there); the tied
weight is written by the first stage's ranks only, each stage writes its own layers. The same
comparisons and negative control; the ZeRO-1 save resumes on 1 stage x DP=2 and continues the losses.

MoE: train_moe.py's model (4 experts) at ep_size 2 on 2 ranks, ZeRO-1 and ZeRO-2: each rank writes its own
experts under their global ids, the dense tensors each rank its ZeRO run; and without ZeRO (ZeRO-0), where the
dense tensors are copies on both EP ranks (Replicate, as `ucp convert` reads each EP rank's optimizer file), each
written whole by one rank. The same comparisons and negative control; the ZeRO-1 save resumes at ep_size 1
and continues the losses.

The pipeline and MoE runs also keep the host-memory tier (`"memory": {"every": 2, "replicas": 1}`, 2 simulated
nodes: the first and second half of the ranks, each a memory folder of its own): each node's copy of the
last step is the disk save of that step, its own ranks' pieces and its peer's.
"""
from __future__ import annotations

import pytest

import ucp
from support.atomic import assert_same_checkpoint
from support.llama_tp_runs import losses, resume
from support.memory_runs import memory_equals_saved
from support.resume_3d import Layout, resume_run
from ucp.convert import convert

SAVED_AT, STEPS = 2, 4
TRAIN = {"global_batch": 4, "steps": STEPS, "save_after": SAVED_AT, "save_dir": True, "ucp_save": True,
         "losses_out": True}
AUTOTP_RUNS = {
    "z1-fp32-tied": {**TRAIN, "stage": 1, "tied": True},   # TP shards partitioned again by ZeRO; vocab-split head
    "z0-fp32": {**TRAIN, "stage": 0},                       # TP shards whole, each written by one rank of its DP group
    "z2-bf16-frozen": {**TRAIN, "stage": 2, "dtype": "bf16",
                       "frozen": ["model.norm.weight", "model.layers.1.self_attn.o_proj.weight"]},
    "z3-fp32-tied": {**TRAIN, "stage": 3, "tied": True},   # each TP shard partitioned on its own
}


def saved_equals_converted(run, tmp_path):
    """The ucp save of `run` at SAVED_AT, checked: `verify` clean and equal to `ucp convert` of DeepSpeed's
    checkpoint of the same step; negative control: the save of the last step fails the same comparison."""
    saved = ucp.open_checkpoint(run / "ucp" / f"global_step{SAVED_AT}")
    assert saved.verify() == []
    converted = ucp.open_checkpoint(convert(run / "ckpt", tmp_path / "converted", workers=1, progress=False).output)
    assert_same_checkpoint(saved, converted)
    later = ucp.open_checkpoint(run / "ucp" / f"global_step{STEPS}")
    assert later.verify() == []
    with pytest.raises(AssertionError):
        assert_same_checkpoint(later, converted)
    return saved


def saving_runs(layouts: dict, ckpt_root) -> dict:
    """One run of each layout that saves with DeepSpeed at SAVED_AT and with ucp every SAVED_AT steps."""
    return {name: resume_run(layout, ["--steps", STEPS, "--save-at", SAVED_AT, "--save-dir", "{run}/ckpt",
                                      "--ucp-save", "{run}/ucp", "--ucp-memory", "{run}/memory",
                                      "--losses-out", "{run}/losses.json"], ckpt_root)
            for name, layout in layouts.items()}


def resumes_the_losses(source, layout: Layout, ckpt_root) -> None:
    """`source`'s ucp save at SAVED_AT, resumed under `layout`, continues `source`'s losses."""
    run = resume_run(layout, ["--steps", STEPS - SAVED_AT, "--start-step", SAVED_AT, "--ucp-load",
                              source / "ucp" / f"global_step{SAVED_AT}", "--losses-out", "{run}/losses.json"],
                     ckpt_root)
    assert losses(run) == pytest.approx(losses(source)[SAVED_AT:], rel=1e-6)


@pytest.fixture(scope="module")
def autotp(ckpt_root):
    """The runs' folders (one launch; the ucp code under test runs in it, so it is never cached)."""
    return resume("save-autotp", 2, 4, AUTOTP_RUNS, ckpt_root)


@pytest.mark.parametrize("run", list(AUTOTP_RUNS))
def test_autotp_saves_equal_converted_deepspeed_checkpoints(autotp, run, tmp_path):
    saved = saved_equals_converted(autotp / run, tmp_path)
    assert (saved.source["tp"], saved.source["dp"]) == (2, 2)


def test_an_autotp_save_resumes_without_tensor_parallelism(autotp, ckpt_root):
    path = autotp / "z1-fp32-tied" / "ucp" / f"global_step{SAVED_AT}"
    run = resume("save-autotp-to-dp2", 1, 2, {"z2": {"global_batch": 4, "steps": STEPS - SAVED_AT,
                                                     "start_step": SAVED_AT, "losses_out": True, "stage": 2,
                                                     "tied": True, "ucp_load": str(path)}}, ckpt_root)
    # TP sums row-parallel products and the vocabulary-parallel loss in another order (~1e-7 apart in fp32).
    assert losses(run / "z2") == pytest.approx(losses(autotp / "z1-fp32-tied")[SAVED_AT:], rel=1e-6)


PIPE_LAYOUTS = {"z1-pp2-dp2": Layout("resume_pipe.py", 4, ("--stages", "2", "--zero-stage", "1")),
                "bf16-z0-pp2": Layout("resume_pipe.py", 2, ("--stages", "2", "--zero-stage", "0", "--dtype", "bf16"))}


@pytest.fixture(scope="module")
def pipe_runs(ckpt_root):
    return saving_runs(PIPE_LAYOUTS, ckpt_root)


@pytest.mark.parametrize("name", list(PIPE_LAYOUTS))
def test_pipeline_saves_equal_converted_deepspeed_checkpoints(pipe_runs, name, tmp_path):
    saved = saved_equals_converted(pipe_runs[name], tmp_path)
    assert saved.source["pp"] == 2
    assert saved.index.params["tied_modules.embed.weight"].pattern["pattern"] == "replicate"


def test_a_pipeline_save_resumes_on_one_stage(pipe_runs, ckpt_root):
    source = pipe_runs["z1-pp2-dp2"]
    resumes_the_losses(source, Layout("resume_pipe.py", 2, ("--stages", "1", "--zero-stage", "1")), ckpt_root)


MOE_LAYOUTS = {"ep2-z1": Layout("resume_moe.py", 2, ("--ep-size", "2", "--zero-stage", "1")),
               "ep2-z2": Layout("resume_moe.py", 2, ("--ep-size", "2", "--zero-stage", "2")),
               "ep2-z0": Layout("resume_moe.py", 2, ("--ep-size", "2", "--zero-stage", "0"))}


@pytest.fixture(scope="module")
def moe_runs(ckpt_root):
    return saving_runs(MOE_LAYOUTS, ckpt_root)


@pytest.mark.parametrize("name", list(PIPE_LAYOUTS))
def test_pipeline_memory_saves_equal_the_disk_saves(pipe_runs, name):
    memory_equals_saved(pipe_runs[name], STEPS, SAVED_AT)


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_saves_equal_converted_deepspeed_checkpoints(moe_runs, name, tmp_path):
    saved = saved_equals_converted(moe_runs[name], tmp_path)
    assert sum(".deepspeed_experts." in n for n in saved.names) == 4 * 3  # 4 experts of 3 tensors, global ids


@pytest.mark.parametrize("name", list(MOE_LAYOUTS))
def test_moe_memory_saves_equal_the_disk_saves(moe_runs, name):
    memory_equals_saved(moe_runs[name], STEPS, SAVED_AT)


def test_an_moe_save_resumes_at_another_ep_size(moe_runs, ckpt_root):
    source = moe_runs["ep2-z1"]
    resumes_the_losses(source, Layout("resume_moe.py", 2, ("--ep-size", "1", "--zero-stage", "1")), ckpt_root)
