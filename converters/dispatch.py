"""Family detection and dispatch: which planner reads a DeepSpeed checkpoint, in one place.

Tensor x pipeline (Megatron-DeepSpeed), pipeline, MoE and tensor-parallel (AutoTP) layouts have
planners of their own; anything else is plain ZeRO (stages 0-3).
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

from ucp.converters.deepspeed.megatron import is_tensor_pipeline, plan_megatron
from ucp.converters.deepspeed.moe import is_moe, plan_moe
from ucp.converters.deepspeed.pipe import is_pipeline, plan_pipe
from ucp.converters.deepspeed.slices import load_dict
from ucp.converters.deepspeed.tp import is_tensor_parallel, plan_tp
from ucp.converters.deepspeed.zero import plan_zero0, plan_zero3, plan_zero12
from ucp.converters.deepspeed.zero3 import zero3_model_files
from ucp.converters.tag_folder import MODEL_FILE, optim_files, resolve_tag
from ucp.errors import CheckpointNotFoundError, UnsupportedLayoutError
from ucp.plan.plan import ConversionPlan


def plan_deepspeed(input_dir: str | os.PathLike, tag: str | None = None,
                   param_names: list[str] | None = None, patterns: dict[str, str] | None = None) -> ConversionPlan:
    """A conversion plan for the ZeRO checkpoint at `input_dir` (tag from `latest` unless given).

    `param_names` (ZeRO-0 only) names the optimizer's parameters in param-group order, for the
    rare model whose names cannot be recovered from shapes. `patterns` (tensor-parallel only) maps
    a parameter name, or a regex of whole names, to the pattern of its TP shards, for checkpoints
    that do not declare it.
    """
    where = resolve_tag(input_dir, tag)
    folder = where.path
    names = sorted(os.listdir(folder))
    optim = optim_files(folder, names)
    zero3_models = zero3_model_files(folder, names)
    models = sorted(n for n in names if MODEL_FILE.match(n))
    if not optim and not models and not zero3_models:
        raise CheckpointNotFoundError(f"{folder}: no DeepSpeed model-states files; is this a checkpoint tag folder?")
    family = _parallel_family(folder, names, patterns or {}, param_names)
    if family is not None:
        return family(where, names)
    if any(m != 0 for (_, m) in list(optim) + list(zero3_models)) or len(models) > 1:
        raise UnsupportedLayoutError(f"{folder}: tensor/pipeline-parallel checkpoints (several mp_rank files) "
                                     "are not supported by this converter yet")
    if zero3_models:
        return plan_zero3(where, zero3_models, optim)
    if not models:
        raise CheckpointNotFoundError(f"{folder}: mp_rank_00_model_states.pt is missing; copy it from the "
                                      "training job's checkpoint directory")
    model_path = folder / models[0]
    model = load_dict(model_path)
    if not optim:
        return plan_zero0(where, model_path, model, param_names)
    return plan_zero12(where, model_path, model, optim)


def _parallel_family(folder: Path, names: list[str], patterns: dict[str, str], param_names: list[str] | None):
    """The planner of a tensor x pipeline, pipeline, tensor-parallel or MoE layout, or None for plain ZeRO."""
    if is_tensor_pipeline(names):
        return functools.partial(plan_megatron, patterns=patterns, param_names=param_names)
    planner: Callable[..., ConversionPlan] | None
    if is_pipeline(names):
        planner = functools.partial(plan_pipe, param_names=param_names)
    else:
        planner = plan_moe if is_moe(names) else None
    if planner is None and is_tensor_parallel(names):
        return functools.partial(plan_tp, patterns=patterns)
    if patterns:
        raise UnsupportedLayoutError(f"{folder}: --pattern applies to tensor-parallel checkpoints (one mp_rank "
                                     "model file per TP rank); drop it for this checkpoint")
    return planner
