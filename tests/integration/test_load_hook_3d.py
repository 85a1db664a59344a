"""Resume pipeline-parallel and MoE training at another layout through ucp.deepspeed.

As in test_load_hook.py: train at layout A, save with DeepSpeed after SAVE_AT steps, `ucp convert`,
resume at layout B through the hook and train RESUME_STEPS more steps; the losses must match those
of the uninterrupted run at A over the same global batches (the source run itself, which keeps
training after it saved).
"""
from __future__ import annotations

import json

import pytest
import torch

import ucp
from support.atomic import stored_bytes, with_added_param, with_edited_index
from support.resume_3d import Layout, resume_run, source_run
from ucp.convert import convert

SAVE_AT, RESUME_STEPS = 2, 2
TIED = "tied_modules.embed.weight"


def pipe(stages: int, nproc: int, *more: str) -> Layout:
    return Layout("resume_pipe.py", nproc, ("--stages", str(stages), *more))


def moe(ep_size: int, zero_stage: int = 1) -> Layout:
    return Layout("resume_moe.py", 2, ("--ep-size", str(ep_size), "--zero-stage", str(zero_stage)))


def degree(layout: Layout) -> int:
    """The layout's pipeline stages (resume_pipe.py) or ep_size (resume_moe.py): its first flag."""
    return int(layout.flags[1])


@pytest.fixture(scope="module")
def converted(ckpt_root, tmp_path_factory):
    """layout -> (ucp checkpoint of its source run after SAVE_AT steps, the source run's losses)."""
    memo = {}

    def make(layout: Layout):
        if layout not in memo:
            source = source_run(layout, SAVE_AT + RESUME_STEPS, SAVE_AT, ckpt_root)
            out = tmp_path_factory.mktemp("atomic") / layout.name
            convert(source.save_dir, out, workers=2, progress=False, strict=True)
            memo[layout] = (out, source.losses)
        return memo[layout]

    return make


def resume(path, layout: Layout, root, *extra: str) -> tuple[list[float], object]:
    run = resume_run(layout, ["--steps", RESUME_STEPS, "--start-step", SAVE_AT, "--ucp-load", path,
                              "--losses-out", "{run}/losses.json", "--ucp-stats-out", "{run}/stats.json", *extra],
                     root)
    return json.loads((run / "losses.json").read_text()), run


def bytes_read(run) -> int:
    """What all ranks of the resumed run read from storage together."""
    ranks = json.loads((run / "stats.json").read_text())
    return sum(rank["bytes_read"] - rank["bytes_checked_extra"] for rank in ranks)


# -- pipeline parallelism ------------------------------------------------------------------------------

# A PP=2 checkpoint resumes into the same PipelineModule built with one stage, not into a plain
# module: that is what a user who loses a node does (keep the model definition, change num_stages),
# and the names (`<layer>.<param>`, `tied_modules.embed.weight`) are the PipelineModule's own.
PIPE_CASES = [
    (pipe(2, 2), pipe(1, 1)),   # PP 2 -> 1
    (pipe(1, 1), pipe(2, 2)),   # PP 1 -> 2
    (pipe(2, 2), pipe(1, 2)),   # PP 2 -> PP 1 x DP 2
]
# PP 2 x DP 2 (4 ranks) is left out: each DeepSpeed rank peaks near 4 GB on CPU, and 4 of them
# next to other jobs got OOM-killed on the 2-core, 23 GB test machine.


BF16_NO_ZERO = ("--zero-stage", "0", "--dtype", "bf16")  # DeepSpeed's BF16_Optimizer


@pytest.mark.parametrize("source,target", PIPE_CASES + [(pipe(2, 2, *BF16_NO_ZERO), pipe(1, 1, *BF16_NO_ZERO))],
                         ids=lambda layout: layout.name)
def test_pipeline_resume_continues_the_uninterrupted_run(source, target, converted, ckpt_root):
    path, straight = converted(source)
    losses, run = resume(path, target, ckpt_root)
    # fp32: another stage count or DP degree only changes the order in which the tied embedding's two
    # gradients and the DP gradients are summed (~1e-7). bf16 (equal here): that order may change the
    # rounding of those bf16 gradients, so allow bf16's resolution.
    assert losses == pytest.approx(straight[SAVE_AT:], rel=1e-3 if "bf16" in source.flags else 1e-6)
    # Each stage's data-parallel group reads its layers once; the tied embedding once per stage.
    assert bytes_read(run) == stored_bytes(path) + (degree(target) - 1) * stored_bytes(path, [TIED])


def test_pipeline_negative_control_tied_copy_left_unloaded(converted, ckpt_root):
    """The check can fail: a last stage whose tied embedding keeps its initial value diverges."""
    path, straight = converted(pipe(1, 1))
    losses, _ = resume(path, pipe(2, 2), ckpt_root, "--reset-tied-on-last-stage")
    assert losses != pytest.approx(straight[SAVE_AT:], rel=1e-3)


def test_pipeline_bad_checkpoints_are_refused_on_every_stage(converted, ckpt_root, tmp_path):
    """Stage 1's missing layer is an error on stage 0 too (which has all of its own), before any collective."""
    path, _ = converted(pipe(2, 2))

    def drop(index):
        del index["params"]["3.weight"]

    ckpt = ucp.open_checkpoint(path)
    copy_of_3 = {s: ckpt.tensor("3.weight", s) for s in ckpt.states("3.weight") if s != "step"}
    cases = {"missing": "'3.weight'", "extra": "'5.weight'"}
    dirs = [with_edited_index(path, tmp_path / "missing", drop),
            with_added_param(path, tmp_path / "extra", "5.weight", "3.weight", copy_of_3)]
    run = resume_run(pipe(2, 2), ["--steps", 0, "--losses-out", "{run}/losses.json", "--ucp-load",
                                  ",".join(map(str, dirs)), "--ucp-expect-error", "{run}/errors.json"], ckpt_root)
    ranks = json.loads((run / "errors.json").read_text())
    assert len(ranks) == 2
    for results in ranks:
        for (label, needle), result in zip(cases.items(), results):
            assert result["error"] is not None and needle in result["error"], (label, result)
            assert result["untouched"], label


# -- MoE -----------------------------------------------------------------------------------------------

MOE_CASES = [
    (moe(1), moe(2)),                   # ep 1 -> 2
    (moe(2), moe(1)),                   # ep 2 -> 1
    (moe(1), moe(2, zero_stage=2)),     # ep 1 -> 2 and ZeRO 1 -> 2
]
MOE_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def misplaced_experts(path, dump, ep_size: int) -> list[str]:
    """Expert tensors a rank holds that differ from the checkpoint's expert of the global id it owns.

    Rank r is expert-parallel rank r % ep_size (resume_moe.py checks DeepSpeed agrees), so its
    local expert i is global expert (r % ep_size) * num_local + i.
    """
    ckpt = ucp.open_checkpoint(path)
    wrong = []
    for entry in dump:
        assert entry["ep_rank"] == entry["rank"] % ep_size
        first = entry["ep_rank"] * entry["num_local"]
        for name, states in entry["params"].items():
            prefix, rest = name.split(".deepspeed_experts.")
            local, param = rest.split(".", 1)
            global_name = f"{prefix}.deepspeed_experts.{first + int(local)}.{param}"
            for state in MOE_STATES:
                if not torch.equal(states[state], ckpt.tensor(global_name, state)):
                    wrong.append(f"rank {entry['rank']} {name} {state}")
            if not torch.equal(states["module"], ckpt.tensor(global_name, "fp32")):
                wrong.append(f"rank {entry['rank']} {name} module")
    return wrong


@pytest.mark.parametrize("source,target", MOE_CASES, ids=lambda layout: layout.name)
def test_moe_resume_places_experts_by_global_id(source, target, converted, ckpt_root):
    path, straight = converted(source)
    losses, run = resume(path, target, ckpt_root, "--experts-out", "{run}/experts.pt")
    dump = torch.load(run / "experts.pt", weights_only=False)
    # 4 experts of 3 tensors, each held by 2 / ep_size ranks
    assert sum(len(entry["params"]) for entry in dump) == 4 * 3 * (2 // degree(target))
    assert misplaced_experts(path, dump, degree(target)) == []
    # Every expert is read once, by (the expert-data-parallel group of) the rank that owns it.
    assert bytes_read(run) == stored_bytes(path)
    # fp32; another ep_size routes the same tokens through the same experts, only over all-to-all and
    # with expert gradients summed in another order (~1e-7).
    assert losses == pytest.approx(straight[SAVE_AT:], rel=1e-6)


def test_moe_negative_control_experts_by_local_id(converted, ckpt_root):
    """Loading local expert i as global expert i (stock DeepSpeed at a new ep_size) fails every check:
    the strict one (no rank claims experts 2-3), and without it expert placement and loss continuity."""
    path, straight = converted(moe(1))
    losses, run = resume(path, moe(2), ckpt_root, "--experts-out", "{run}/experts.pt", "--experts-by-local-id",
                         "--strict-error-out", "{run}/strict_error.txt")
    strict_error = (run / "strict_error.txt").read_text()
    assert "'moe.deepspeed_moe.experts.deepspeed_experts.2." in strict_error and "(6 in all)" in strict_error
    wrong = misplaced_experts(path, torch.load(run / "experts.pt", weights_only=False), 2)
    assert wrong and all(w.startswith("rank 1 ") for w in wrong)
    assert losses != pytest.approx(straight[SAVE_AT:], rel=1e-3)
