"""Integration-tier set-up: DeepSpeed's CPU ops are built before the first job; `s3`, an S3 server for the
tests that read and write object storage; the Hugging Face Trainer and Accelerate runs that test_trainer.py and
test_s3.py share (each built once per session)."""
from pathlib import Path

import pytest

from support.hf_runs import SAVE_STEP, accelerate_resume, accelerate_source, trainer_resume, trainer_source
from support.launch import build_deepspeed_ops
from support.s3_proxy import s3_server

TRAINER_CHECKPOINT = f"checkpoint-{SAVE_STEP}"


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
