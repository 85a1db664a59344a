"""Whether DeepSpeed can train fp16 on this CPU, and the skip mark for tests that need it.

DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels (some Intel Xeons, not
AMD EPYC); `deepspeed.initialize` with fp16 then raises "Type fp16 is not supported on your device".
tests/integration/test_fp16_paths.py covers the same fp16 code of ucp without a DeepSpeed fp16 run.
"""
from __future__ import annotations

import functools
import os

import pytest

from .checkpoints import TinySpec

NO_CPU_FP16 = ("DeepSpeed's CPU accelerator has no fp16 on this CPU (oneDNN lacks fp16 kernels); "
               "tests/integration/test_fp16_paths.py covers the fp16 code paths without a DeepSpeed fp16 run")


@functools.cache
def cpu_fp16_supported() -> bool:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    return bool(get_accelerator().is_fp16_supported())


def needs_cpu_fp16(*values):
    """`pytest.param(*values)`, skipped with the reason where any TinySpec among them trains fp16 and
    this CPU cannot."""
    fp16 = any(isinstance(v, TinySpec) and v.dtype == "fp16" for v in values)
    marks = [pytest.mark.skipif(fp16 and not cpu_fp16_supported(), reason=NO_CPU_FP16)]
    return pytest.param(*values, marks=marks)
