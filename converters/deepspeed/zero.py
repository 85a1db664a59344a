"""Plan the conversion of a plain DeepSpeed ZeRO checkpoint (stages 0, 1, 2, 3; fp32, fp16, bf16).

Only metadata is read here: the pickles of every rank file are parsed lazily (see `torch_zip`),
and every parameter state becomes a list of fragments with absolute byte offsets. Layouts, as
written by DeepSpeed 0.19:

* ZeRO-1/2: `mp_rank_00_model_states.pt` holds `param_shapes` (per param group, in flat order),
  buffers and frozen parameters; `[bf16_]zero_pp_rank_{d}_mp_rank_00_optim_states.pt` holds rank
  d's flat fp32 partition per group, the Adam moments over the same partition, and
  `param_slice_mappings` (name -> numel, start within the partition).
* ZeRO-3: every parameter is partitioned on its own (see `deepspeed.zero3`); frozen parameters
  are partitioned the same way in the model files.
* ZeRO-0: see `deepspeed.zero0`.
"""
from __future__ import annotations

from pathlib import Path

from ucp.converters.deepspeed.slices import read_slice
from ucp.converters.deepspeed.zero0 import zero0_trainable
from ucp.converters.deepspeed.zero3 import read_zero3_slice
from ucp.converters.plan_common import (
    buffers,
    finish_plan,
    frozen_and_buffers,
    module_dtype,
    module_state,
    state_source,
)
from ucp.converters.tag_folder import TagDir
from ucp.plan.plan import FROZEN, TRAINABLE, WEIGHT_STATE, ConversionPlan, ParamPlan


def plan_zero12(where: TagDir, model_path: Path, model: dict, optim_files: dict) -> ConversionPlan:
    part = read_slice(where.path, 0, model_path, model, optim_files)
    module = model.get("module") or {}
    params = []
    for name, shape in part.shapes.items():
        states = {}
        for state_name in part.states():
            frags = part.fragments.get((name, state_name))
            if frags:
                states[state_name] = state_source(name, shape, frags)
        if WEIGHT_STATE not in states:
            # ZeRO keeps no optimizer fragment for a parameter that never received a gradient;
            # its value is still in the module (as DeepSpeed's own converter falls back to).
            states[WEIGHT_STATE] = module_state(name, shape, module, model_path)
        group = part.group_of[name]
        params.append(ParamPlan(name, shape, TRAINABLE, states, group, part.steps.get(group),
                                module_dtype(module, name)))
    params += frozen_and_buffers(model, model_path, set(part.shapes))
    return finish_plan(where, model, params, part.hyper, part.moment_names, part.stage, part.dp,
                   list(part.optim_paths) + [model_path], part.loss_scaler)


def plan_zero3(where: TagDir, model_files: dict, optim_files: dict) -> ConversionPlan:
    part = read_zero3_slice(where.path, 0, model_files, optim_files)
    module = part.model.get("module") or {}
    params = []
    for name, shape in part.shapes.items():
        states = {s: state_source(name, shape, part.fragments[(name, s)]) for s in part.states()
                  if (name, s) in part.fragments}
        group = part.group_of[name]
        params.append(ParamPlan(name, shape, TRAINABLE, states, group, part.steps.get(group),
                                module_dtype(module, name)))
    for name, (shape, frags) in part.frozen.items():
        params.append(ParamPlan(name, shape, FROZEN, {WEIGHT_STATE: state_source(name, shape, frags)},
                                model_dtype=module_dtype(module, name)))
    params += buffers(part.model, part.model_path)
    return finish_plan(where, part.model, params, part.hyper, part.moment_names, part.stage, part.dp,
                       part.files(), part.loss_scaler)


def plan_zero0(where: TagDir, model_path: Path, model: dict, param_names: list[str] | None) -> ConversionPlan:
    params, hyper, moment_names = zero0_trainable(model, model_path, param_names)
    params += frozen_and_buffers(model, model_path, {p.name for p in params})
    dp = int(model.get("dp_world_size") or 1)
    return finish_plan(where, model, params, hyper, moment_names, 0, dp, [model_path], model.get("optimizer"))
