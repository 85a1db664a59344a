"""The Hugging Face Trainer under torchrun's elastic agents, restarted unattended by one command (issue #29).

`train_hf_elastic.py` is the user's script: `ucp.transformers.train(trainer)` with `"ucp": {"load": "auto",
"elastic": {"global_batch": 5, "micro_batch": 2}}` (ZeRO-2, tiny tied Llama, `save_total_limit=2`). Three agents
run it; rank 1 is SIGKILLed inside the save of checkpoint-4 (the agents restart it at 3 ranks, from checkpoint-2);
then a node is lost after checkpoint-6 (2 ranks go on) and a node joins again (3 ranks finish). Every logged loss
and learning rate must be the uninterrupted 3-rank run's, step by step. 5 samples do not divide by 2 or 3 ranks:
the shares are uneven (2/2/1 on 3 ranks, 3/2 in two micro-batches on 2). The same script with ZeRO-3 and PEFT
LoRA adapters loses a node and grows back, against its own uninterrupted run. Those models divide by the global
batch's tokens (`num_items_in_batch`); a model that does not gets each micro-batch's loss weighted, checked with
the real Trainer in this process.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from support.elastic_agents import ElasticJob, by_step, reached, read_losses
from support.hf_runs import SAVE_STEP, accelerate_resume, accelerate_source, losses
from support.launch import run_torchrun
from support.processes import wait_for
from ucp.elastic.trainer_folders import newest_complete

pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "train_hf_elastic.py"
STEPS, SAVE_STEPS, DIE_IN_SAVE = 10, 2, 4
ARGS = ["--max-steps", STEPS, "--save-steps", SAVE_STEPS, "--save-total-limit", 2, "--global-batch", 5]
# fp32, no dropout: other world sizes sum the same gradients in another order, ~1e-7 apart per step.
RTOL = 1e-6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Factory: `uninterrupted(*flags)`, the uninterrupted 3-rank run of the script with `flags` added to ARGS
    (built once per flags): its record of each step, and its output_dir."""
    runs: dict[tuple, tuple[dict[int, dict], Path]] = {}

    def run(*flags) -> tuple[dict[int, dict], Path]:
        if flags not in runs:
            tmp = tmp_path_factory.mktemp("trainer-reference")
            log = tmp / "log.jsonl"
            run_torchrun(SCRIPT, [*ARGS, *flags, "--output-dir", tmp / "out", "--log-out", log], 3, tmp / "train.log")
            runs[flags] = {s: rs[0] for s, rs in by_step(read_losses(log)).items()}, tmp / "out"
        return runs[flags]
    return run


@pytest.fixture(scope="module")
def reference(uninterrupted) -> tuple[dict[int, dict], Path]:
    """The uninterrupted 3-rank ZeRO-2 run: its record of each step, and its output_dir."""
    return uninterrupted()


def assert_continues(records: list[dict], expected: dict[int, dict]) -> None:
    """Every step logged (redone ones included) has the uninterrupted run's loss within RTOL, and its very
    learning rate and epoch; every step of the run was logged."""
    got = by_step(records)
    assert sorted(got) == sorted(expected) == list(range(1, STEPS + 1))
    for step, redone in got.items():
        for r in redone:  # a step redone after a restart is the same step again
            assert r["loss"] == pytest.approx(expected[step]["loss"], rel=RTOL), (step, r, expected[step])
            assert r["lr"] == expected[step]["lr"] and r["epoch"] == expected[step]["epoch"], (step, r)


def test_trainer_killed_in_save_shrinks_and_grows_unattended(tmp_path, reference):
    expected, _ = reference
    log, out = tmp_path / "log.jsonl", tmp_path / "out"
    with ElasticJob(SCRIPT, [*ARGS, "--output-dir", out, "--log-out", log, "--step-sleep", 0.5,
                             "--die-in-save", DIE_IN_SAVE, "--die-marker", tmp_path / "died"],
                    tmp_path / "agents", nodes="1:3") as job:
        for _ in range(3):
            job.start_agent()
        wait_for(reached(log, 7, world=3), 600, "step 7 on 3 ranks, after the restart from checkpoint-2")
        job.lose_node(2)                                      # a node is gone after checkpoint-6: 2 ranks go on
        wait_for(reached(log, 8, world=2), 600, "step 8 on 2 ranks")
        job.join_while_paused()                               # a node is back: 3 ranks at the next restart
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    logs = job.logs(tail=None)
    assert (tmp_path / "died").is_file()
    assert (f"{out}/checkpoint-{DIE_IN_SAVE} is incomplete (it has no trainer_state.json): resuming from "
            f"checkpoint-{DIE_IN_SAVE - SAVE_STEPS} instead; set aside as damaged-checkpoint-{DIE_IN_SAVE}") in logs
    assert f"resuming from {out}/checkpoint-6 on 2 ranks" in logs
    records = read_losses(log)
    assert {r["world"] for r in records if r["step"] > 7} >= {2, 3}
    assert_continues(records, expected)
    # save_total_limit=2 kept the newest two; damaged folders are left for a person, outside the rotation (a
    # restart for the node that joins may cut another save short: it is set aside the same way)
    kept = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))  # not ucp's readers' lock files
    assert [n for n in kept if not n.startswith("damaged-")] == ["checkpoint-10", "checkpoint-8"]
    assert f"damaged-checkpoint-{DIE_IN_SAVE}" in kept


ZERO3_LORA = ("--model", "llama-lora", "--stage", "3")


def test_zero3_lora_trainer_loses_a_node_and_grows_back_unattended(tmp_path, uninterrupted):
    """ZeRO-3 with PEFT LoRA adapters (base weights frozen, left out of DeepSpeed's checkpoint): a node is lost
    after checkpoint-4, 2 ranks finish from there, a node joins and 3 ranks go on; the run is the uninterrupted
    3-rank one, step by step (its own reference: the adapters are another model)."""
    expected, _ = uninterrupted(*ZERO3_LORA)
    log, out = tmp_path / "log.jsonl", tmp_path / "out"
    with ElasticJob(SCRIPT, [*ARGS, *ZERO3_LORA, "--output-dir", out, "--log-out", log, "--step-sleep", 0.5],
                    tmp_path / "agents", nodes="1:3") as job:
        for _ in range(3):
            job.start_agent()
        wait_for(reached(log, 5, world=3), 600, "step 5 on 3 ranks, after checkpoint-4")
        job.lose_node(2)
        wait_for(reached(log, 6, world=2), 600, "step 6 on 2 ranks")
        job.join_while_paused()
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    logs = job.logs(tail=None)
    assert f"resuming from {out}/checkpoint-" in logs and " on 2 ranks" in logs
    records = read_losses(log)
    assert [r["world"] for r in records][-1] == 3 and 2 in {r["world"] for r in records}
    assert_continues(records, expected)
    # control: the ZeRO-2 run of the full model is another run, which the same check tells apart
    with pytest.raises(AssertionError):
        assert_continues(records, uninterrupted()[0])


def test_negative_control_the_trainers_own_batches_do_not_continue_the_run(tmp_path, reference):
    """Without "elastic", a resume on 2 ranks with the Trainer's own batches (2 per device: 4 per step) and its
    sampler loads the same state but trains on other samples: step 9 is another step. (On 1 rank with 5 per
    device the Trainer's epoch-0 order happens to be the global order's, seeded alike: no control there.)"""
    expected, reference_out = reference
    log = tmp_path / "log.jsonl"
    run_torchrun(SCRIPT, ["--max-steps", STEPS, "--save-steps", SAVE_STEPS, "--per-device", 2,
                          "--resume", reference_out / "checkpoint-8", "--output-dir", tmp_path / "out",
                          "--log-out", log], 2, tmp_path / "train.log")
    got = by_step(read_losses(log))
    assert sorted(got) == [9, 10]
    assert got[9][0]["lr"] == expected[9]["lr"]  # the schedule continues: only the data differ
    assert got[9][0]["loss"] != pytest.approx(expected[9]["loss"], rel=1e-3)


@pytest.fixture(scope="module")
def accelerate_save_dir(ckpt_root, tmp_path_factory):
    """A save folder as Accelerate's automatic naming fills it: checkpoint_3 (the 2-process ZeRO-2 state saved
    at step 3) and checkpoint_4, a save cut short (rank 1's RNG file, written last, missing); and the source."""
    source = accelerate_source(ckpt_root)
    save_dir = tmp_path_factory.mktemp("accelerate") / "checkpoints"
    shutil.copytree(source / "state", save_dir / "checkpoint_3")
    shutil.copytree(source / "state", save_dir / "checkpoint_4")
    (save_dir / "checkpoint_4" / "random_states_1.pkl").unlink()
    return save_dir, source


def test_accelerate_auto_resumes_the_newest_complete_state_at_another_size(accelerate_save_dir, ckpt_root):
    save_dir, source = accelerate_save_dir
    run = accelerate_resume(save_dir, 1, 2, ckpt_root, checkpoint="auto")
    log = (run / "train.log").read_text()
    assert (f"ucp: {save_dir}/checkpoint_4 is incomplete (it has no random_states_1.pkl, which save_state writes "
            f"last): resuming from checkpoint_3 instead; moved to {save_dir}.damaged/checkpoint_4") in log
    resumed = losses(run / "losses.json")
    assert resumed["first_step"] == SAVE_STEP + 1
    assert resumed["losses"] == pytest.approx(losses(source / "losses.json")["losses"][SAVE_STEP:], rel=RTOL)
    assert sorted(p.name for p in save_dir.iterdir()) == ["checkpoint_3"]


def test_negative_control_accelerate_auto_with_no_complete_state_starts_fresh(ckpt_root, tmp_path):
    save_dir = tmp_path / "checkpoints"
    shutil.copytree(accelerate_source(ckpt_root) / "state", save_dir / "checkpoint_4")
    (save_dir / "checkpoint_4" / "random_states_0.pkl").unlink()
    run = accelerate_resume(save_dir, 1, 2, ckpt_root, checkpoint="auto")
    assert f"ucp: no complete save_state folder in {save_dir}: starting fresh" in (run / "train.log").read_text()
    fresh = losses(run / "losses.json")
    expected = losses(accelerate_source(ckpt_root) / "losses.json")["losses"]
    assert fresh["first_step"] == 1  # the check the resume passes fails: a fresh start is not the run continued
    assert fresh["losses"][:2] != pytest.approx(expected[SAVE_STEP:], rel=1e-3)


ACCELERATE_SCRIPT = SCRIPT.with_name("train_accelerate_elastic.py")
ACCELERATE_ARGS = ["--steps", 8, "--save-every", 2]


@pytest.fixture(scope="module")
def accelerate_reference(tmp_path_factory) -> dict[int, dict]:
    """The uninterrupted 2-process run of the Accelerate loop: its record of each step."""
    tmp = tmp_path_factory.mktemp("accelerate-reference")
    run_torchrun(ACCELERATE_SCRIPT, [*ACCELERATE_ARGS, "--project-dir", tmp / "project", "--log-out",
                                     tmp / "log.jsonl"], 2, tmp / "train.log")
    return {s: rs[0] for s, rs in by_step(read_losses(tmp / "log.jsonl")).items()}


def test_accelerate_loop_loses_a_node_and_grows_back_unattended(tmp_path, accelerate_reference):
    """Two agents run the loop; one is lost after checkpoint_1 (step 4) and 1 process goes on from the newest
    complete save, then an agent joins and 2 processes finish: every step trains the samples, loss and learning
    rate of the uninterrupted 2-process run (the seedable sampler's order, continued at each size)."""
    log = tmp_path / "log.jsonl"
    with ElasticJob(ACCELERATE_SCRIPT, [*ACCELERATE_ARGS, "--project-dir", tmp_path / "project", "--log-out", log,
                                        "--step-sleep", 0.5], tmp_path / "agents", nodes="1:2") as job:
        for _ in range(2):
            job.start_agent()
        wait_for(reached(log, 5, world=2), 600, "step 5 on 2 processes, after checkpoint_1")
        job.lose_node(1)
        wait_for(reached(log, 6, world=1), 600, "step 6 on 1 process")
        job.join_while_paused()
        codes = job.wait(timeout=600)
    assert set(codes.values()) == {0}, job.logs()
    logs = job.logs(tail=None)
    assert f"ucp: resuming from {tmp_path}/project/checkpoints/checkpoint_" in logs and " on 1 processes" in logs
    records = read_losses(log)
    assert [r["world"] for r in records][-1] == 2 and 1 in {r["world"] for r in records}
    got = by_step(records)
    assert sorted(got) == sorted(accelerate_reference) == list(range(1, 9))
    for step, redone in got.items():
        for r in redone:  # a step redone after a restart is the same step again
            want = accelerate_reference[step]
            assert r["samples"] == want["samples"] and r["lr"] == want["lr"], (step, r, want)
            assert r["loss"] == pytest.approx(want["loss"], rel=RTOL), (step, r, want)
    # "auto" numbered the saves after the folder resumed from: checkpoint_2 and _3 (steps 6 and 8), the newest two
    # that total_limit keeps; Accelerate's own count restarts at 0 on each restart, so that its saves reuse
    # numbers older than the folder resumed from and one of them later refuses a folder that exists
    kept = sorted(p.name for p in (tmp_path / "project" / "checkpoints").iterdir())
    assert kept == ["checkpoint_2", "checkpoint_3"], kept
    # control: the check tells another step's samples and loss apart
    assert got[6][0]["samples"] != accelerate_reference[5]["samples"]
    assert got[6][0]["loss"] != pytest.approx(accelerate_reference[5]["loss"], rel=RTOL)


def test_auto_checks_each_checkpoint_it_would_take(trainer_run, tmp_path):
    """The Trainer's real checkpoint-3, copied as checkpoint-3..6, each newer one damaged another way: "auto"
    takes checkpoint-3 and names why each newer one is passed over (the undamaged copy is the control)."""
    source = trainer_run("llama") / "out" / "checkpoint-3"
    out = tmp_path / "out"
    for n in (3, 4, 5, 6):
        shutil.copytree(source, out / f"checkpoint-{n}")
    (out / "checkpoint-4" / "trainer_state.json").write_text(
        (source / "trainer_state.json").read_text().replace('"global_step": 3', '"global_step": 4'))
    optim = sorted((out / "checkpoint-4" / "global_step3").glob("*optim_states.pt"))[-1]
    optim.write_bytes(optim.read_bytes()[:100])                      # a rank file cut short
    (out / "checkpoint-5" / "trainer_state.json").write_text("{")      # cut mid-write
    (out / "checkpoint-6" / "latest").unlink()                         # DeepSpeed's save not finished
    folder, passed = newest_complete(out)
    assert folder == out / "checkpoint-3"
    assert [(p.name, why.split(" (")[0]) for p, why in passed] == [
        ("checkpoint-6", "it has no 'latest' file"),
        ("checkpoint-5", "its trainer_state.json does not read as JSON"),
        ("checkpoint-4", "its DeepSpeed state does not open")]
    assert newest_complete(tmp_path / "absent") == (None, [])


def _train_one_process(tmp_path: Path, micro_batch: int, monkeypatch) -> tuple[dict, list[float]]:
    """Two SGD steps of 5 samples each with the real Trainer in this process (no DeepSpeed: one rank), through
    `ucp.transformers.train` with `elastic={"global_batch": 5, "micro_batch": micro_batch}`, on the tiny Llama
    told not to take `num_items_in_batch` (as models whose forward has no `**kwargs`); its weights and losses."""
    import transformers

    import ucp.transformers
    from support.train_hf import TokenData, tiny_model

    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # train_hf's import sets it for its own runs
    model = tiny_model("llama")
    model.accepts_loss_kwargs = False  # the Trainer then averages each micro-batch on its own
    args = transformers.TrainingArguments(output_dir=str(tmp_path / f"m{micro_batch}"), max_steps=2, optim="sgd",
                                          learning_rate=0.5, lr_scheduler_type="constant", seed=0, use_cpu=True,
                                          save_strategy="no", logging_steps=1, report_to=[], disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=TokenData())
    ucp.transformers.train(trainer, elastic={"global_batch": 5, "micro_batch": micro_batch})
    assert trainer.model_accepts_loss_kwargs is False
    return ({k: v.detach().clone() for k, v in model.state_dict().items()},
            [e["loss"] for e in trainer.state.log_history if "loss" in e])


def test_uneven_micro_batches_of_a_model_without_loss_kwargs_are_weighted(tmp_path, monkeypatch):
    """5 samples in micro-batches of 2, 2 and 1 (`loss_weight` 1.2, 1.2, 0.6) train what one micro-batch of all 5
    trains: same weights after two steps, same losses. The Trainer alone (weights 1: each micro-batch's mean
    counts alike) trains something else."""
    whole, whole_losses = _train_one_process(tmp_path, 5, monkeypatch)
    cut, cut_losses = _train_one_process(tmp_path, 2, monkeypatch)
    # fp32 sums over 3 micro-batches instead of 1: equal to rounding, ~1e-7 relative
    assert all(torch.allclose(cut[k], whole[k], rtol=1e-5, atol=1e-7) for k in whole)
    assert cut_losses == pytest.approx(whole_losses, rel=RTOL)
    from ucp.elastic.shares import ElasticBatch

    monkeypatch.setattr(ElasticBatch, "loss_weight", lambda self, samples: 1.0)  # control: no weighting
    unweighted, _ = _train_one_process(tmp_path, 2, monkeypatch)
    assert not all(torch.allclose(unweighted[k], whole[k], rtol=1e-5, atol=1e-7) for k in whole)
