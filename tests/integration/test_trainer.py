"""Resume the Hugging Face Trainer and Accelerate at another world size and ZeRO stage, through ucp.

The real programs run: transformers' `Trainer` (a subclass, as users and TRL write them) and
Accelerate's `Accelerator` with DeepSpeed on CPU ranks (torchrun, gloo), on tiny tied Llama and
GPT-2 models. A source run trains 5 steps on 2 processes with ZeRO-2 and saves `checkpoint-3`;
each resume trains steps 4 and 5 from it at another layout, and its losses must be those of the
source run's own steps 4 and 5.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import ucp
from support.hf_runs import (
    SAVE_STEP,
    SOURCE_WORLD,
    TOTAL_STEPS,
    accelerate_resume,
    accelerate_source,
    losses,
    trainer_resume,
)

# fp32 throughout: another world size or ZeRO stage reduces gradients in another order, ~1e-7 apart.
REL = 1e-6
CHECKPOINT = f"checkpoint-{SAVE_STEP}"
CASES = [  # model, what resume_from_checkpoint names, processes, ZeRO stage at resume
    ("llama", "last", 1, 2),      # True: the last checkpoint-N of output_dir, read directly
    ("llama", "raw", 1, 3),       # the checkpoint-N folder, read directly
    ("llama", "raw", 2, 3),
    ("llama", "ucp", 2, 3),       # its ucp conversion
    ("gpt2", "raw", 1, 3),
    ("gpt2", "ucp", 1, 2),
]


def uninterrupted(source) -> list[float]:
    return losses(source / "losses.json")["losses"][SAVE_STEP:]


@pytest.mark.parametrize("model,kind,world,stage", CASES)
def test_trainer_resume_continues_the_uninterrupted_run(model, kind, world, stage, trainer_run,
                                                        trainer_resumed_from_conversion, ckpt_root, tmp_path):
    source = trainer_run(model)
    if kind == "ucp":
        run = trainer_resumed_from_conversion(model, world, stage)  # shared with test_s3.py's resume from s3://
    elif kind == "last":
        output_dir = tmp_path / "out"
        output_dir.mkdir()
        (output_dir / CHECKPOINT).symlink_to(source / "out" / CHECKPOINT)
        (output_dir / "checkpoint-1-unfinished").mkdir()  # not a checkpoint-N name: ignored, as by transformers
        run = trainer_resume(model, "last", world, stage, ckpt_root, output_dir=output_dir)
    else:
        run = trainer_resume(model, source / "out" / CHECKPOINT, world, stage, ckpt_root)
    resumed = losses(run / "losses.json")
    assert resumed["first_step"] == SAVE_STEP + 1 and resumed["global_step"] == TOTAL_STEPS
    assert resumed["losses"] == pytest.approx(uninterrupted(source), rel=REL)
    log = (run / "train.log").read_text()
    if world != SOURCE_WORLD:
        assert log.count("RNG states were saved by 2 processes and cannot be mapped") == 1


def test_ucp_conversion_carries_the_trainer_files(trainer_run, converted_trainer_checkpoint):
    converted = converted_trainer_checkpoint("llama")
    for name in ("trainer_state.json", "config.json"):
        assert (converted / name).read_bytes() == (trainer_run("llama") / "out" / CHECKPOINT / name).read_bytes()
    assert not list(converted.glob("rng_state*")) and not (converted / "training_args.bin").exists()


def test_negative_control_without_optimizer_states_differs(trainer_run, ckpt_root):
    source = trainer_run("llama")
    run = trainer_resume("llama", source / "out" / CHECKPOINT, 1, 2, ckpt_root,
                         ucp_options={"load_optimizer_states": False})
    resumed = losses(run / "losses.json")["losses"]
    expected = uninterrupted(source)
    assert resumed[0] == pytest.approx(expected[0], rel=REL)      # the weights are the checkpoint's
    assert resumed[1] != pytest.approx(expected[1], rel=1e-4)     # fresh Adam moments take another step


def test_checkpoint_with_a_missing_rank_file_is_refused_on_every_rank(trainer_run, ckpt_root, tmp_path):
    broken = tmp_path / CHECKPOINT
    shutil.copytree(trainer_run("llama") / "out" / CHECKPOINT, broken)
    missing = broken / f"global_step{SAVE_STEP}" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    missing.unlink()
    assert_refused_on_every_rank(trainer_resume("llama", broken, 2, 2, ckpt_root, check=False),
                                 "zero_pp_rank_1_mp_rank_00_optim_states.pt")


@pytest.fixture(scope="session")
def accelerate_on_one_process(ckpt_root, tmp_path_factory) -> tuple[Path, Path]:
    """The Accelerate source resumed on 1 process (its folder), which saves its own state after its last step
    (that folder)."""
    saved = tmp_path_factory.mktemp("accelerate-one") / "state"
    return accelerate_resume(accelerate_source(ckpt_root) / "state", 1, 2, ckpt_root, save_dir=saved), saved


@pytest.mark.parametrize("engine_from", ["raw", "ucp"])
def test_accelerate_load_state_at_one_process(engine_from, request, ckpt_root):
    """Saved on 2 processes, resumed on 1: the steps after the checkpoint train on the uninterrupted run's samples,
    in its order (a plain shuffled DataLoader, whose order Accelerate keeps in no file), to its losses."""
    source = accelerate_source(ckpt_root)
    if engine_from == "raw":
        run, _ = request.getfixturevalue("accelerate_on_one_process")
    else:
        run = request.getfixturevalue("accelerate_from_conversion")  # shared with test_s3.py's resume from s3://
    resumed, expected = losses(run / "losses.json"), losses(source / "losses.json")
    assert resumed["first_step"] == SAVE_STEP + 1
    assert resumed["samples"] == expected["samples"][SAVE_STEP:]
    assert resumed["losses"] == pytest.approx(expected["losses"][SAVE_STEP:], rel=REL)


def test_accelerate_refuses_a_shuffled_order_it_cannot_carry(accelerate_on_one_process, ckpt_root):
    """The 1-process run drew its order from an RNG state no file keeps: 2 processes cannot have it back, and are
    refused before anything is loaded, on every rank."""
    refused = accelerate_resume(accelerate_on_one_process[1], 2, 2, ckpt_root, check=False)
    assert not (refused / "losses.json").exists()
    log = (refused / "train.log").read_text()
    for rank in range(2):
        error = [line for line in log.splitlines() if line.startswith(f"[rank{rank}]:") and "ConfigError: " in line]
        assert error and "DataLoader 0 (RandomSampler)" in error[-1] and "use_seedable_sampler=True" in error[-1]


def with_a_file_of_checkpoint_5(out: Path, broken: Path, name: str) -> Path:
    """checkpoint-3 of `out` copied to `broken`, its rank file `name` taken from checkpoint-5 of the same run."""
    shutil.copytree(out / CHECKPOINT, broken)
    shutil.copy(out / f"checkpoint-{TOTAL_STEPS}" / f"global_step{TOTAL_STEPS}" / name,
                broken / f"global_step{SAVE_STEP}" / name)
    return broken


def assert_refused_on_every_rank(run: Path, needle: str) -> None:
    """The 2-process resume in `run` trained nothing, and each rank's last error names `needle`."""
    log = (run / "train.log").read_text()
    assert not (run / "losses.json").exists()
    for rank in range(2):
        errors = [line for line in log.splitlines() if line.startswith(f"[rank{rank}]:") and "Error: " in line]
        assert errors and needle in errors[-1], (rank, errors)


@pytest.mark.parametrize("mixed", ["zero_pp_rank_1_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"])
def test_files_of_another_save_are_refused_naming_the_file(mixed, trainer_run, tmp_path, capsys):
    """checkpoint-3 with one file taken from checkpoint-5 of the same run (same world size, same model)."""
    from ucp.cli.main import main as cli

    broken = with_a_file_of_checkpoint_5(trainer_run("llama") / "out", tmp_path / CHECKPOINT, mixed)
    assert cli(["convert", "--input", str(broken), "--output", str(tmp_path / "ucp"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "files from different saves are mixed" in err and mixed in err, err


def test_a_mixed_checkpoint_is_refused_on_every_rank_before_training(trainer_run, ckpt_root, tmp_path):
    broken = with_a_file_of_checkpoint_5(trainer_run("llama") / "out", tmp_path / CHECKPOINT,
                                         "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert_refused_on_every_rank(trainer_resume("llama", broken, 2, 3, ckpt_root, check=False),
                                 "files from different saves are mixed")


def test_a_ucp_section_that_plain_trainer_train_ignores_is_a_warning(ckpt_root, tmp_path):
    """DeepSpeed ignores the "ucp" section; trainer.train() (not ucp.transformers.train) says so, once."""
    from support.checkpoints import SUPPORT_DIR
    from support.launch import run_torchrun

    run_torchrun(SUPPORT_DIR / "train_hf.py",
                 ["--model", "llama", "--stage", "2", "--output-dir", str(tmp_path / "out"), "--max-steps", "1",
                  "--ucp-options", '{"load": "/nowhere"}', "--losses-out", str(tmp_path / "losses.json")],
                 1, tmp_path / "train.log")
    log = (tmp_path / "train.log").read_text()
    assert log.count('the DeepSpeed config has a "ucp" section, which trainer.train() does not read') == 1


# ---- PEFT: the Trainer saves DeepSpeed's checkpoint without the frozen base weights -------------------------

LORA = "llama-lora"
TIED_BASE = ("base_model.model.model.embed_tokens.weight", "base_model.model.lm_head.weight")


def test_peft_checkpoint_says_what_it_leaves_out_and_resumes_at_another_layout(trainer_run, ckpt_root, tmp_path,
                                                                               capsys):
    """A LoRA Llama (tied) saved on 2 processes under ZeRO-2 resumes on 1 process under ZeRO-3, from its ucp
    conversion, with the uninterrupted run's losses; its frozen base weights are the model's own."""
    from ucp.cli.main import main as cli

    checkpoint = trainer_run(LORA) / "out" / CHECKPOINT
    converted = tmp_path / "ucp"
    assert cli(["convert", "--input", str(checkpoint), "--output", str(converted), "--quiet"]) == 0
    for folder in (checkpoint, converted):
        assert cli(["inspect", str(folder)]) == 0
        shown = capsys.readouterr().out
        assert "not held: every frozen parameter (frozen, not saved: exclude_frozen_parameters)" in shown
        assert f"the checkpoint names 2 of them: {', '.join(TIED_BASE)}" in shown
        ckpt = ucp.open_checkpoint(folder)
        assert ckpt.not_saved.names == TIED_BASE and ckpt.aliases == {}
        assert all(".lora_" in name and ckpt.info(name).kind == "param" for name in ckpt.names)
    run = trainer_resume(LORA, converted, 1, 3, ckpt_root)
    resumed = losses(run / "losses.json")
    assert resumed["first_step"] == SAVE_STEP + 1 and resumed["global_step"] == TOTAL_STEPS
    assert resumed["losses"] == pytest.approx(uninterrupted(trainer_run(LORA)), rel=REL)
    # Negative control: the adapters the load restores move the loss far more than REL, so a resume that left them
    # as initialised (or took base weights from elsewhere) would fail the comparison above.
    assert _loss_moved_by_the_adapters(ucp.open_checkpoint(converted)) > 100 * REL


def _loss_moved_by_the_adapters(ckpt) -> float:
    """The relative change of the freshly built LoRA model's loss on a batch once the checkpoint's adapters are set."""
    import torch

    from support.train_hf import TokenData, tiny_model

    model = tiny_model(LORA)
    ids = TokenData().ids[:4]
    with torch.no_grad():
        fresh = model(input_ids=ids, labels=ids).loss.item()
        params = dict(model.named_parameters())
        for name in ckpt.names:
            params[name].copy_(ckpt.tensor(name))
        trained = model(input_ids=ids, labels=ids).loss.item()
    return abs(trained - fresh) / fresh


def test_peft_checkpoint_missing_a_trainable_parameter_is_refused(trainer_run, ckpt_root):
    """Adapters on k_proj too: the checkpoint leaves out frozen parameters only, so their absence is refused."""
    run = trainer_resume(LORA, trainer_run(LORA) / "out" / CHECKPOINT, 1, 2, ckpt_root, check=False,
                         extra=("--lora-targets", "q_proj,k_proj,v_proj"))
    log = (run / "train.log").read_text()
    assert not (run / "losses.json").exists()
    error = [line for line in log.splitlines() if "CheckpointMismatchError: " in line][-1]
    assert "has no parameter 'base_model.model.model.layers.0.self_attn.k_proj.lora_A.default.weight', which the " \
           "model trains" in error and "frozen, not saved: exclude_frozen_parameters" in error, error


# ---- what the Trainer and Accelerate paths say ----------------------------------------------------------------


def test_an_output_dir_resumes_from_its_last_complete_checkpoint(trainer_run, tmp_path):
    """resume_from_checkpoint=OUTPUT_DIR takes its last checkpoint-N, as True and `ucp convert --input` do; a last
    one whose save did not finish is refused, naming the last complete one."""
    from ucp.errors import CheckpointNotFoundError
    from ucp.transformers import trainer_folder

    out = tmp_path / "out"
    out.mkdir()
    for step in (SAVE_STEP, TOTAL_STEPS):
        (out / f"checkpoint-{step}").symlink_to(trainer_run("llama") / "out" / f"checkpoint-{step}")
    last = out / f"checkpoint-{TOTAL_STEPS}"
    assert trainer_folder(out, "/elsewhere") == last == trainer_folder(True, out)
    unfinished = out / "checkpoint-7"
    unfinished.mkdir()
    (unfinished / "global_step7").mkdir()
    for missing, make in [("it has no trainer_state.json", None),
                          ("it has no 'latest' file", "trainer_state.json"),
                          ("its 'latest' names 'global_step8', which it does not hold", "latest")]:
        if make is not None:
            (unfinished / make).write_text("global_step8" if make == "latest" else "{}")
        for path in (out, True):
            with pytest.raises(CheckpointNotFoundError) as refused:
                trainer_folder(path, out)
            assert str(refused.value) == (f"{unfinished}: {missing}, so the save that wrote it did not finish; the "
                                          f"last complete one is {last.name}: pass resume_from_checkpoint='{last}'")


def test_accelerate_state_and_its_conversion_say_what_they_hold(ckpt_root, tmp_path, capsys):
    """inspect names the client torch AdamW; convert says the index lacks scheduler.bin's state; and a conversion
    given alone to ucp.accelerate.load_state is refused, naming what the run needs from save_state's folder."""
    from ucp.cli.main import main as cli

    state = accelerate_source(ckpt_root) / "state"
    assert cli(["inspect", str(state)]) == 0
    assert "optimizer AdamW (exp_avg, exp_avg_sq)" in capsys.readouterr().out
    converted = tmp_path / "ucp"
    assert cli(["convert", "--input", str(state), "--output", str(converted), "--quiet"]) == 0
    (left,) = [line for line in capsys.readouterr().err.splitlines() if "left out" in line]
    assert "scheduler.bin (pickles, which run code when loaded; they hold an LR scheduler's state, which the " \
           "index does not (the engine ran no scheduler): resume from this folder to restore it)" in left, left
    assert "already in the index" not in left
    run = accelerate_resume(converted, 1, 2, ckpt_root, check=False)
    assert not (run / "losses.json").exists()
    error = [line for line in (run / "train.log").read_text().splitlines() if "ConfigError: " in line][-1]
    assert "scheduler.bin (the LambdaLR outside the engine)" in error and "checkpoint=" in error, error


def test_a_forgotten_cpu_recipe_is_named(tmp_path):
    """Without Accelerate's state set up first, the Trainer on CPU sees 1 of torchrun's 2 processes, and DeepSpeed
    would stop on its batch-size arithmetic: the error names the recipe instead."""
    from support.checkpoints import SUPPORT_DIR
    from support.launch import run_torchrun

    with pytest.raises(RuntimeError):
        run_torchrun(SUPPORT_DIR / "train_hf.py",
                     ["--model", "llama", "--stage", "2", "--output-dir", str(tmp_path / "out"), "--max-steps", "1",
                      "--no-cpu-recipe", "--losses-out", str(tmp_path / "losses.json")], 2, tmp_path / "train.log")
    log = (tmp_path / "train.log").read_text()
    for rank in range(2):
        error = [line for line in log.splitlines() if line.startswith(f"[rank{rank}]:") and "ConfigError: " in line]
        assert error and "torchrun started 2 processes, but the Trainer sees 1" in error[-1]
        assert 'accelerate.PartialState(backend="gloo")' in error[-1] and "use_configured_state" in error[-1]
    assert "train_batch_size is not equal to" not in log
