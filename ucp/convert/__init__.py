"""Conversion of a sharded checkpoint into the atomic format: the MapReduce driver over the plan model
(`ucp.plan`), its executors and manifests, and the `--format deepspeed` writer (docs/ARCHITECTURE.md).

`ucp.convert.convert(input_dir, output_dir, ...)` is the entry point; it is imported on first use so that
importing an executor (the DeepSpeed hook's, export's) never pulls in the driver and every converter.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ucp.convert.driver import convert

__all__ = ["convert"]


def __getattr__(name: str) -> object:
    if name == "convert":
        from ucp.convert.driver import convert

        return convert
    raise AttributeError(f"module 'ucp.convert' has no attribute {name!r}")
