"""Write in-memory tensors as a ucp checkpoint, without DeepSpeed: `write_tensors(out, {name: {state: tensor}})`.

For a training loop of one's own (or a test, or a benchmark) that wants its state in the atomic
format: each parameter is stored whole (pattern Unique), through the conversion's own writer and
index builder, so the files are those `ucp convert` would write for the same tensors.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ucp.convert.driver import WriteBin, stream_bin
from ucp.convert.manifest import remove_manifests
from ucp.convert.split_policy import SplitPolicy, apply_split_policy
from ucp.errors import OutputExistsError, UcpError
from ucp.format.crc import CHUNK_BYTES
from ucp.format.dtypes import from_torch
from ucp.format.folder import commit_index, data_file_name, fsync_dir
from ucp.patterns.types import Pattern, PatternSpec
from ucp.plan.index_builder import build_index, records_of
from ucp.plan.plan import TRAINABLE, ConversionPlan, ParamPlan, StateSource
from ucp.storage.fileio import writing_alone

if TYPE_CHECKING:
    import torch

WEIGHT = "fp32"


def write_tensors(output: str | os.PathLike, tensors: dict[str, dict[str, np.ndarray | torch.Tensor]], *,
                  optimizer: dict | None = None, step: float | None = None, splits: SplitPolicy | None = None,
                  chunk_bytes: int = CHUNK_BYTES) -> Path:
    """Write `tensors[name][state]` (numpy arrays or CPU torch tensors) as a ucp checkpoint at `output`.

    Every parameter has the weight state `"fp32"` and any optimizer states (e.g. `exp_avg`); all of one
    parameter's states have its shape. `optimizer` is the index's optimizer record (`{"type", "states",
    "param_groups": [{"hyperparams", "params"}]}`, docs/FORMAT.md); every parameter is in group 0 at
    `step`. `splits` stores tensors split-major (docs/FORMAT.md, "Splits"). `output` must be new or empty.
    """
    output = Path(output)
    arrays: dict[tuple[str, str], np.ndarray] = {}
    params = []
    for name, states in tensors.items():
        if WEIGHT not in states:
            raise UcpError(f"{name}: no '{WEIGHT}' state; every parameter needs its weight")
        shape = tuple(states[WEIGHT].shape)
        sources = {}
        for state, value in states.items():
            array, dtype = _as_array(value)
            if tuple(array.shape) != shape:
                raise UcpError(f"{name}: state '{state}' has shape {list(array.shape)}, its weight {list(shape)}")
            arrays[(name, state)] = array
            sources[state] = StateSource(PatternSpec(Pattern.UNIQUE, shape), (), dtype)
        params.append(ParamPlan(name, shape, TRAINABLE, sources, group=0, step=step))
    plan = ConversionPlan(params, {"framework": "tensors"}, optimizer)
    if splits is not None:
        plan = apply_split_policy(plan, splits)
    fingerprint = hashlib.sha256(repr(sorted((k, a.shape, a.dtype.str) for k, a in arrays.items())).encode()
                                 ).hexdigest()[:32]
    with writing_alone(output):
        if any(output.iterdir()):
            raise OutputExistsError(f"{output}: is not empty; write the tensors into a new or empty folder")
        task = WriteBin(str(output), data_file_name(0, 1), tuple(plan.params), False, fingerprint, chunk_bytes)
        written = stream_bin(task, lambda nbytes: None, lambda p, source: arrays[(p.name, _state_of(p, source))])
        fsync_dir(output)
        commit_index(output, build_index(*records_of(plan), fingerprint, [written]))
        remove_manifests(output)
    return output


def _as_array(value: np.ndarray | torch.Tensor) -> tuple[np.ndarray, str]:
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value), value.dtype.name
    return from_torch(value.detach().cpu().contiguous())


def _state_of(p: ParamPlan, source: StateSource) -> str:
    return next(state for state, s in p.states.items() if s is source)
