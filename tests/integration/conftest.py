"""Integration-tier session set-up: DeepSpeed's CPU ops are built before the first job."""

import pytest

from support.launch import build_deepspeed_ops


@pytest.fixture(scope="session", autouse=True)
def deepspeed_ops(tmp_path_factory) -> None:
    """Build DeepSpeed's CPU ops once, in one process (see build_deepspeed_ops for why)."""
    build_deepspeed_ops(tmp_path_factory.mktemp("ops") / "build.log")
