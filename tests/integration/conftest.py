"""Integration-tier set-up: DeepSpeed's CPU ops are built before the first job; `s3`, an S3 server for the
tests that read and write object storage; the Hugging Face Trainer and Accelerate runs that test_trainer.py and
test_s3.py share; the uninterrupted runs of the elastic examples that the elastic torchrun, AutoTP, memory-tier
and Ray tests compare with (each built once per session)."""
from pathlib import Path

import pytest

from support.elastic_agents import by_step, first_losses, read_losses
from support.hf_runs import SAVE_STEP, accelerate_resume, accelerate_source, trainer_resume, trainer_source
from support.launch import build_deepspeed_ops, run_torchrun
from support.s3_proxy import s3_server

TRAINER_CHECKPOINT = f"checkpoint-{SAVE_STEP}"
ELASTIC_EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "elastic" / "torchrun"
# The uninterrupted runs train this many steps: at least as many as any elastic test that compares with them
# (test_elastic_torchrun 16, test_elastic_ray 12, test_memory_tier 10; the AutoTP ones 8).
ELASTIC_STEPS, ELASTIC_3D_STEPS = 16, 8


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops(tmp_path_factory) -> None:
    """Build DeepSpeed's CPU ops once, in one process (see build_deepspeed_ops for why)."""
    build_deepspeed_ops(tmp_path_factory.mktemp("ops") / "build.log")


@pytest.fixture(scope="module")
def s3():
    """moto's S3 server and the proxy in front of it, both on 127.0.0.1 (support/s3_proxy.py, `s3_server`)."""
    with s3_server() as server:
        yield server


@pytest.fixture(scope="session")
def trainer_run(ckpt_root):
    """Factory: ``trainer_run(model)``, the folder of the 2-process ZeRO-2 Trainer run that saved checkpoint-3."""
    return lambda model: trainer_source(model, ckpt_root)


@pytest.fixture(scope="session")
def converted_trainer_checkpoint(trainer_run, tmp_path_factory):
    """Factory: ``converted_trainer_checkpoint(model)``, the ucp conversion of the Trainer's checkpoint-3."""
    from ucp.convert import convert

    memo: dict[str, Path] = {}

    def make(model: str) -> Path:
        if model not in memo:
            memo[model] = tmp_path_factory.mktemp("hf-ucp") / model
            convert(trainer_run(model) / "out" / TRAINER_CHECKPOINT, memo[model], workers=2, progress=False)
        return memo[model]

    return make


@pytest.fixture(scope="session")
def trainer_resumed_from_conversion(converted_trainer_checkpoint, ckpt_root):
    """Factory: ``(model, world, stage) -> run folder`` of ucp.transformers.train from the local ucp conversion."""
    memo: dict[tuple[str, int, int], Path] = {}

    def make(model: str, world: int, stage: int) -> Path:
        if (model, world, stage) not in memo:
            memo[model, world, stage] = trainer_resume(model, converted_trainer_checkpoint(model), world, stage,
                                                       ckpt_root)
        return memo[model, world, stage]

    return make


@pytest.fixture(scope="session")
def accelerate_conversion(ckpt_root, tmp_path_factory) -> Path:
    """The ucp conversion of the DeepSpeed checkpoint in the 2-process Accelerate run's save_state folder."""
    from ucp.convert import convert

    converted = tmp_path_factory.mktemp("accelerate-ucp") / "ucp"
    convert(accelerate_source(ckpt_root) / "state", converted, workers=2, progress=False)
    return converted


@pytest.fixture(scope="session")
def accelerate_from_conversion(accelerate_conversion, ckpt_root) -> Path:
    """The run folder of ucp.accelerate.load_state on 1 process at ZeRO-3: Accelerate's files from the save_state
    folder, the engine from its local ucp conversion."""
    return accelerate_resume(accelerate_source(ckpt_root) / "state", 1, 3, ckpt_root, accelerate_conversion)


@pytest.fixture(scope="session")
def elastic_reference(tmp_path_factory):
    """Factory: ``elastic_reference(stage, global_batch)``, the loss of each step of the uninterrupted 4-rank run of
    examples/elastic/torchrun/train.py (ELASTIC_STEPS steps, no saves), once per (stage, global batch) per session.
    Its losses depend neither on the world size (the same global batch and sample order at every size, to rounding)
    nor on the steps planned or the saves, so the torchrun, memory-tier and Ray tests all compare with it."""
    memo: dict[tuple[int, int], dict[int, float]] = {}

    def make(stage: int, global_batch: int) -> dict[int, float]:
        if (stage, global_batch) not in memo:
            tmp = tmp_path_factory.mktemp(f"elastic-reference{stage}-{global_batch}")
            losses = tmp / "losses.jsonl"
            run_torchrun(ELASTIC_EXAMPLES / "train.py", [
                "--save-dir", tmp / "ckpt", "--steps", ELASTIC_STEPS, "--stage", stage, "--global-batch", global_batch,
                "--every", 10 * ELASTIC_STEPS, "--losses-out", losses], 4, tmp / "log")
            memo[stage, global_batch] = first_losses(losses)
        return memo[stage, global_batch]

    return make


@pytest.fixture(scope="session")
def elastic_3d_reference(tmp_path_factory) -> tuple[dict[int, float], Path]:
    """The uninterrupted 4-rank run (T=2 x D=2) of examples/elastic/torchrun/train_3d.py, ELASTIC_3D_STEPS steps:
    the loss of each step, and its DeepSpeed checkpoints of every step (for the negative controls). ucp chooses the
    layout and shares the batch, DeepSpeed saves (the loss does not depend on who saves, or on the layout: the
    same global batch of 8 and sample order at every layout). test_elastic_3d and test_elastic_ray share it."""
    tmp = tmp_path_factory.mktemp("elastic-reference3d")
    losses = tmp / "losses.jsonl"
    run_torchrun(ELASTIC_EXAMPLES / "train_3d.py", ["--save-dir", tmp / "ds", "--steps", ELASTIC_3D_STEPS, "--stock",
                                                    "--losses-out", losses], 4, tmp / "log")
    records = read_losses(losses)
    assert {(r["tp"], r["dp"]) for r in records} == {(2, 2)}
    return {s: v[0]["loss"] for s, v in by_step(records).items()}, tmp / "ds"
