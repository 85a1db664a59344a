"""Plan the conversion of a DeepSpeed ZeRO-0 checkpoint (no optimizer partitioning).

ZeRO-0 writes no `*_optim_states.pt`: the optimizer's state dict sits in the model-states file,
keyed by the position of each parameter in the optimizer's param groups, not by name, and
`param_shapes` is None. fp32 training stores torch's optimizer state dict directly (masters are
the module's own weights); bf16/fp16 training wraps it with per-parameter fp32 masters
(`fp32_groups`). Names are recovered by matching the optimizer's slots to the module's parameters
by shape and, with mixed precision, by the masters' values (see `_match_names`). When the
checkpoint cannot settle an assignment, conversion stops and asks for the names
(`--param-names`) instead of guessing.
"""
from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ucp.converters.deepspeed.slices import SliceState, expect, param_groups, tied_aliases
from ucp.converters.torch_zip import LazyTensor, read_array, read_values
from ucp.errors import AmbiguousPatternError, CorruptCheckpointError
from ucp.format.dtypes import cast
from ucp.patterns.recognize import FragmentInfo, recognize
from ucp.plan.plan import TRAINABLE, WEIGHT_STATE, Fragment, ParamPlan, Piece, StateSource


def zero0_trainable(model: dict, path: Path, param_names: list[str] | None) -> tuple[list[ParamPlan], list, list[str]]:
    """Trainable parameters, the optimizer's param groups, and its moment names."""
    opt = model.get("optimizer")
    if not isinstance(opt, dict):
        raise CorruptCheckpointError(f"{path}: a ZeRO-0 checkpoint without optimizer state; was it saved with "
                                     "an optimizer?")
    inner = expect(opt.get("optimizer_state_dict", opt), dict, path, "its optimizer_state_dict")
    masters = opt.get("fp32_groups")
    groups = param_groups(inner.get("param_groups") or [], path)
    state = expect(inner.get("state") or {}, dict, path, "its optimizer 'state'")
    slots = [(g, i, idx) for g, group in enumerate(groups)
             for i, idx in enumerate(expect(group.get("params"), list, path, f"the 'params' of param group {g}"))]

    def slot_state(idx) -> dict:
        return expect(state.get(idx, {}), dict, path, f"the optimizer state of slot {idx}")
    module = model.get("module") or {}
    buffers = set(model.get("buffer_names") or [])
    tied = tied_aliases(model)  # a tied weight's second name holds no optimizer slot of its own
    candidates = [n for n, t in module.items() if n not in buffers and n not in tied and isinstance(t, LazyTensor)]

    def master(g: int, i: int) -> LazyTensor | None:
        return masters[g][i] if masters else None

    def slot_shape(g: int, i: int, idx: int) -> tuple[int, ...]:
        m = master(g, i)
        if m is not None:
            return m.shape
        moments = [v for k, v in slot_state(idx).items() if k != "step" and isinstance(v, LazyTensor)]
        if not moments:
            raise AmbiguousPatternError(f"{path}: optimizer slot {idx} has no state to tell its shape; pass "
                                        "--param-names with the optimizer's parameter names in order")
        return moments[0].shape

    shapes = [slot_shape(*s) for s in slots]
    if param_names is not None:
        if len(param_names) != len(slots):
            raise AmbiguousPatternError(f"--param-names lists {len(param_names)} names, the optimizer has "
                                        f"{len(slots)} parameters")
        names = list(param_names)
    else:
        names = _match_names(slots, shapes, candidates, module, master, path)
    moment_names: list[str] = []
    params = []
    for (g, i, idx), name, shape in zip(slots, names, shapes):
        t = module.get(name)
        if not isinstance(t, LazyTensor) or t.shape != shape:
            raise AmbiguousPatternError(f"{name}: optimizer slot {idx} holds shape {shape}, the module "
                                        f"{getattr(t, 'shape', None)}; check --param-names")
        s = slot_state(idx)
        moments = {k: v for k, v in s.items() if k != "step" and isinstance(v, LazyTensor)}
        moment_names = moment_names or list(moments)
        kept = master(g, i)
        weight = kept if kept is not None else t
        states = {WEIGHT_STATE: _whole_state(name, weight)}
        states.update({k: _whole_state(name, v) for k, v in moments.items()})
        step = s.get("step")
        step = float(read_values(step).reshape(-1)[0]) if isinstance(step, LazyTensor) else step
        params.append(ParamPlan(name, shape, TRAINABLE, states, g, step, str(t.dtype)))
    return params, groups, moment_names


def _whole_state(name: str, t: LazyTensor) -> StateSource:
    fragment = Fragment(FragmentInfo(0, t.shape), Piece(t.path, t.byte_offset(0), t.numel,
                                                        str(t.dtype)))
    return StateSource(recognize(name, t.shape, [fragment.info]), (fragment,))


def _match_names(slots, shapes, candidates: list[str], module: dict,
                 master: Callable[[int, int], LazyTensor | None], path: Path) -> list[str]:
    """Assign module names to optimizer slots.

    Slots and module parameters are grouped by shape and, when fp32 masters exist, by value (the
    module holds the masters rounded to its dtype). Within a group, slots take the module's
    parameters in definition order, which is how `named_parameters()`-built groups list them.
    A group with more module parameters than slots (a frozen parameter of the same shape and
    value) cannot be settled this way and is an error.
    """
    model_dtype = str(module[candidates[0]].dtype) if candidates else "float32"

    def slot_key(k: int):
        m = master(slots[k][0], slots[k][1])
        return shapes[k] if m is None else (shapes[k], _digest(cast(read_array(m), m.dtype, model_dtype)))

    def module_key(name: str):
        t = module[name]
        return t.shape if not has_masters else (t.shape, _digest(read_array(t)))

    has_masters = bool(slots) and master(slots[0][0], slots[0][1]) is not None
    by_key: dict = {}
    for name in candidates:
        by_key.setdefault(module_key(name), []).append(name)
    wanted: dict = {}
    for k in range(len(slots)):
        wanted.setdefault(slot_key(k), []).append(k)
    names: list[str | None] = [None] * len(slots)
    for key, members in wanted.items():
        found = by_key.get(key, [])
        if len(found) < len(members):
            raise AmbiguousPatternError(f"{path}: the optimizer holds {len(members)} parameter(s) of shape "
                                        f"{shapes[members[0]]} that match no module parameter; pass --param-names "
                                        "with the optimizer's parameter names in order")
        if len(found) > len(members):
            raise AmbiguousPatternError(
                f"{path}: ZeRO-0 records no parameter names, and {len(members)} optimizer slot(s) of shape "
                f"{shapes[members[0]]} could be any of {', '.join(found)}; pass --param-names FILE (the "
                "optimizer's parameter names, one per line, in param-group order)")
        for k, name in zip(members, found):
            names[k] = name
    return [name for name in names if name is not None]  # every slot is some key's member: all named


def _digest(values: np.ndarray) -> str:
    return hashlib.sha1(np.ascontiguousarray(values).reshape(-1).view(np.uint8).data).hexdigest()


def zero0_slice(mp: int, path: Path, model: dict, param_names: list[str] | None = None) -> SliceState:
    """One model-parallel slice of a ZeRO-0 checkpoint as a `SliceState`: every parameter whole,
    one fragment per state, so that TP/PP planners combine it like a ZeRO-1/2 slice."""
    params, hyper, moments = zero0_trainable(model, path, param_names)
    fragments = {(p.name, s): list(src.fragments) for p in params for s, src in p.states.items()}
    return SliceState(mp, path, model, int(model.get("dp_world_size") or 1), [], {p.name: p.shape for p in params},
                      {p.name: p.group for p in params if p.group is not None}, fragments,
                      {p.group: p.step for p in params if p.group is not None}, moments,
                      list(hyper), 0, model.get("optimizer"))
