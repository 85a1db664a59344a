"""Plan the conversion of a DeepSpeed ZeRO-0 checkpoint (no optimizer partitioning).

ZeRO-0 writes no `*_optim_states.pt`: the optimizer's state dict sits in the model-states file,
keyed by the position of each parameter in the optimizer's param groups, not by name, and
`param_shapes` is None. fp32 training stores torch's optimizer state dict directly (masters are
the module's own weights); bf16/fp16 training wraps it with per-parameter fp32 masters
(`fp32_groups`). Names are recovered by matching each group's shapes, in order, against the
module's parameters in definition order (how `named_parameters()` filters build groups), using
the masters' values too when there are any. When more than one assignment fits, conversion stops
and asks for the names instead of guessing.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ucp.converters.torch_zip import LazyTensor, read_tensor
from ucp.errors import AmbiguousPatternError, CorruptCheckpointError
from ucp.patterns.recognize import FragmentInfo, recognize
from ucp.plan import BUFFER_STATE, WEIGHT_STATE, ParamPlan, StateSource, TRAINABLE, Fragment, Piece


def zero0_trainable(model: dict, path: Path, param_names: list[str] | None) -> tuple[list[ParamPlan], list, list[str]]:
    """Trainable parameters, the optimizer's param groups, and its moment names."""
    opt = model.get("optimizer")
    if not isinstance(opt, dict):
        raise CorruptCheckpointError(f"{path}: a ZeRO-0 checkpoint without optimizer state; was it saved with "
                                     "an optimizer?")
    inner = opt.get("optimizer_state_dict", opt)
    masters = opt.get("fp32_groups")
    groups = inner.get("param_groups") or []
    state = inner.get("state") or {}
    slots = [(g, i, idx) for g, group in enumerate(groups) for i, idx in enumerate(group["params"])]
    module = model.get("module") or {}
    buffers = set(model.get("buffer_names") or [])
    candidates = [n for n, t in module.items() if n not in buffers and isinstance(t, LazyTensor)]

    def master(g: int, i: int) -> LazyTensor | None:
        return masters[g][i] if masters else None

    def slot_shape(g: int, i: int, idx: int) -> tuple[int, ...]:
        m = master(g, i)
        if m is not None:
            return m.shape
        moments = [v for k, v in state.get(idx, {}).items() if k != "step" and isinstance(v, LazyTensor)]
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
    moment_names = []
    params = []
    for (g, i, idx), name, shape in zip(slots, names, shapes):
        t = module.get(name)
        if not isinstance(t, LazyTensor) or t.shape != shape:
            raise AmbiguousPatternError(f"{name}: optimizer slot {idx} holds shape {shape}, the module "
                                        f"{getattr(t, 'shape', None)}; check --param-names")
        s = state.get(idx, {})
        moments = {k: v for k, v in s.items() if k != "step" and isinstance(v, LazyTensor)}
        moment_names = moment_names or list(moments)
        weight = master(g, i) if masters else t
        states = {WEIGHT_STATE: _whole_state(name, weight)}
        states.update({k: _whole_state(name, v) for k, v in moments.items()})
        step = s.get("step")
        step = float(read_tensor(step).item()) if isinstance(step, LazyTensor) else step
        params.append(ParamPlan(name, shape, TRAINABLE, states, g, step, str(t.dtype).removeprefix("torch.")))
    return params, groups, moment_names


def _whole_state(name: str, t: LazyTensor) -> StateSource:
    fragment = Fragment(FragmentInfo(0, t.shape), Piece(t.path, t.byte_offset(0), t.numel,
                                                        str(t.dtype).removeprefix("torch.")))
    return StateSource(recognize(name, t.shape, [fragment.info]), (fragment,))


def _match_names(slots, shapes, candidates: list[str], module: dict,
                 master: Callable[[int, int], LazyTensor | None], path: Path) -> list[str]:
    """Assign module names to optimizer slots group by group; each group must embed uniquely."""
    names: list[str] = []
    taken: set[str] = set()
    by_group: dict[int, list[int]] = {}
    for k, (g, _, _) in enumerate(slots):
        by_group.setdefault(g, []).append(k)
    for g, members in by_group.items():
        free = [n for n in candidates if n not in taken]

        def fits(k: int, name: str) -> bool:
            t = module[name]
            if t.shape != shapes[k]:
                return False
            m = master(slots[k][0], slots[k][1])
            return m is None or torch.equal(read_tensor(m).to(t.dtype), read_tensor(t))

        left = _embed(members, free, fits)
        right = _embed(members[::-1], free[::-1], fits)
        if left is None:
            raise AmbiguousPatternError(f"{path}: cannot match optimizer param group {g} to the module's "
                                        "parameters by shape; pass --param-names with the names in optimizer order")
        if right is None or left != right[::-1]:
            clash = next(a for a, b in zip(left, right[::-1]) if a != b)
            raise AmbiguousPatternError(
                f"{path}: ZeRO-0 records no parameter names and '{clash}' could be one of several same-shaped "
                f"parameters in param group {g}; pass --param-names FILE (the optimizer's parameter names, one "
                "per line, in param-group order)")
        names += left
        taken.update(left)
    return names


def _embed(members: list[int], free: list[str], fits) -> list[str] | None:
    """Greedy earliest embedding of the slots `members` into `free` (a subsequence match)."""
    out, j = [], 0
    for k in members:
        while j < len(free) and not fits(k, free[j]):
            j += 1
        if j == len(free):
            return None
        out.append(free[j])
        j += 1
    return out
