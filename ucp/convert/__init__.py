"""Conversion of a sharded checkpoint into the atomic format: the plan types converters produce, the
primitives (Extract, Union, StripPad), the MapReduce driver, its executors and manifests, and the
`--format deepspeed` writer (docs/ARCHITECTURE.md).

`ucp.convert.convert(input_dir, output_dir, ...)` is the entry point; it is imported on first use so
that converters, which import only the plan types, never pull in the driver.
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
