"""Heterogeneous model parallelism (Elastor): parallel layouts and what each rank owns, model shapes,
the strategy search over {DP, TP_max}, and loading one rank's slices (docs/PLAN.md).

The layout, shapes and search are pure and import no torch (`ucp plan` must start fast);
`ucp.hmp.load_slices` is imported on first use.
"""
from __future__ import annotations

__all__ = ["load_slices"]


def __getattr__(name: str):
    if name == "load_slices":
        from ucp.hmp.slice_load import load_slices

        return load_slices
    raise AttributeError(f"module 'ucp.hmp' has no attribute {name!r}")
