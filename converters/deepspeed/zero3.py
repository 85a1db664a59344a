"""Read the ZeRO-3 partitions of one model-parallel slice of a DeepSpeed checkpoint.

ZeRO-3 writes two files per data-parallel rank D of slice MM (MM = the tensor-parallel rank under
AutoTP, 00 without model parallelism): `zero_pp_rank_{D}_mp_rank_{MM}_model_states.pt` (the slice's
`param_shapes` per sub-group, placeholders in `module`, its partition of every frozen parameter in
`frozen_param_fragments`) and `[bf16_]zero_pp_rank_{D}_mp_rank_{MM}_optim_states.pt`
(`fp32_flat_groups` and the moments, one flat tensor per sub-group).

Every parameter is partitioned on its own: rank D holds `ceil(numel / dp)` elements starting at
`D * ceil(numel / dp)` of the flattened parameter (the last rank zero-padded), and a sub-group's
flat tensor concatenates those pieces in `param_shapes` order. ZeRO-3 splits each param group into
sub-groups of `sub_group_size` elements, each its own torch param group; consecutive sub-groups
with equal hyper-parameters are joined back into one group here.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

from ucp.converters.deepspeed.slices import (
    SliceState,
    agree_step,
    agree_with_model,
    check_partitions,
    dp_paths,
    expect,
    group_states,
    load_dict,
    param_groups,
    piece,
    shape_of,
    zero_stage,
)
from ucp.converters.rank_identity import check_distinct
from ucp.converters.torch_zip import LazyTensor
from ucp.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedLayoutError
from ucp.patterns.recognize import FragmentInfo
from ucp.plan.plan import Fragment

ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def zero3_model_files(folder: Path, names: list[str]) -> dict[tuple[int, int], Path]:
    """(dp rank, mp rank) -> its ZeRO-3 model-states file."""
    return {(int(m.group(1)), int(m.group(2))): folder / n for n in names if (m := ZERO3_MODEL_FILE.match(n))}


def read_zero3_slice(folder: Path, mp: int, model_files: dict[tuple[int, int], Path],
                     optim_files: dict[tuple[int, int], Path]) -> SliceState:
    """Fragments of every parameter (trainable and frozen) of slice `mp`, over its data-parallel ranks."""
    mine = sorted(k for k in model_files if k[1] == mp)
    if not mine:
        raise CheckpointNotFoundError(f"{folder / f'zero_pp_rank_0_mp_rank_{mp:02d}_model_states.pt'}: missing; "
                                      "copy every rank's model-states file")
    first_model = load_dict(model_files[mine[0]])
    dp = int(first_model.get("dp_world_size") or len(mine))
    model_paths = dp_paths(folder, model_files, dp, mp, "model_states")
    if not any(m == mp for (_, m) in optim_files):
        raise CheckpointNotFoundError(f"{folder}: ZeRO-3 model files but no *_optim_states.pt files for "
                                      f"mp_rank_{mp:02d}; copy them too")
    optim_paths = dp_paths(folder, optim_files, dp, mp, "optim_states")  # rank 0's model file exists from here on
    check_distinct(model_paths, compare_bytes=False)  # ranks without frozen parameters write equal model files
    check_distinct(optim_paths)
    param_shapes = first_model.get("param_shapes")
    if not param_shapes:
        raise CorruptCheckpointError(f"{model_paths[0]}: records no param_shapes")
    out = SliceState(mp, model_paths[0], first_model, dp, optim_paths,
                     {name: shape_of(s) for group in param_shapes for name, s in group.items()},
                     model_paths=model_paths)
    sub_of = {name: g for g, group in enumerate(param_shapes) for name in group}
    sub_steps: dict[int, float | None] = {}
    sub_hyper = None
    for rank, path in enumerate(optim_paths):
        osd = load_dict(path).get("optimizer_state_dict")
        if not isinstance(osd, dict) or "fp32_flat_groups" not in osd:
            raise CorruptCheckpointError(f"{path}: not a ZeRO-3 optimizer file (no fp32_flat_groups)")
        out.stage = zero_stage(osd, path)
        if osd.get("ds_zero_partition_groups"):
            raise UnsupportedLayoutError(f"{path}: hierarchical ZeRO-3 partitions (hpZ/MiCS) are not supported yet")
        check_partitions(osd.get("partition_count"), dp, [], path)
        if rank == 0:
            out.loss_scaler = osd.get("loss_scaler")
        inner = expect(osd.get("optimizer_state_dict"), dict, path, "its inner optimizer_state_dict")
        state = expect(inner.get("state", {}), dict, path, "its optimizer 'state'")
        if sub_hyper is None:
            sub_hyper = param_groups(inner.get("param_groups", []), path)
        flat_fp32 = expect(osd["fp32_flat_groups"], (list, tuple), path, "its fp32_flat_groups")
        if len(flat_fp32) != len(param_shapes):
            raise CorruptCheckpointError(f"{path}: has {len(flat_fp32)} sub-groups, the model files "
                                         f"{len(param_shapes)}; files from different runs are mixed")
        for i, group in enumerate(param_shapes):
            flats, step = group_states(out, state.get(i, {}), flat_fp32[i], path, i)
            agree_step(sub_steps, i, step, path, optim_paths[0])
            offset = 0
            for name, shape in group.items():
                per_rank = math.ceil(math.prod(shape_of(shape)) / dp)
                for state_name, flat in flats.items():
                    out.fragments.setdefault((name, state_name), []).append(_partition(rank, per_rank, flat, offset))
                offset += per_rank
    out.hyper, group_of_sub = _merge_sub_groups(sub_hyper or [])
    out.group_of = {name: group_of_sub.get(sub, sub) for name, sub in sub_of.items()}
    for sub, step in sub_steps.items():
        group = group_of_sub.get(sub, sub)
        if out.steps.get(group) is not None and step is not None and out.steps[group] != step:
            raise CorruptCheckpointError(f"{optim_paths[0]}: the sub-groups of param group {group} record steps "
                                         f"{out.steps[group]} and {step}; the optimizer file is damaged")
        if out.steps.get(group) is None:
            out.steps[group] = step
    agree_with_model(out.steps, first_model, model_paths[0])
    out.frozen = _frozen(first_model, model_paths, dp)
    return out


def _partition(rank: int, per_rank: int, flat: LazyTensor, offset: int) -> Fragment:
    return Fragment(FragmentInfo(rank, (per_rank,), rank * per_rank), piece(flat, offset, per_rank))


def _frozen(first_model: dict, model_paths: list[Path], dp: int) -> dict[str, tuple[tuple[int, ...], list[Fragment]]]:
    """Frozen parameters, partitioned like trainable ones, each rank's piece in its model file."""
    shapes = {name: shape_of(s) for name, s in (first_model.get("frozen_param_shapes") or {}).items()}
    out: dict[str, tuple[tuple[int, ...], list[Fragment]]] = {name: (shape, []) for name, shape in shapes.items()}
    for rank, path in enumerate(model_paths):
        model = first_model if rank == 0 else load_dict(path)
        for name, shape in shapes.items():
            t = (model.get("frozen_param_fragments") or {}).get(name)
            if not isinstance(t, LazyTensor):
                raise CorruptCheckpointError(f"{path}: frozen parameter '{name}' has no fragment")
            out[name][1].append(_partition(rank, math.ceil(math.prod(shape) / dp), t, 0))
    return out


def _merge_sub_groups(sub_hyper: list[dict]) -> tuple[list[dict], dict[int, int]]:
    """Param groups and sub-group -> group: consecutive sub-groups with equal hyper-parameters are one group."""
    groups: list[dict] = []
    group_of_sub = {}
    for i, g in enumerate(sub_hyper):
        hp = {k: v for k, v in g.items() if k != "params"}
        if not groups or groups[-1] != hp:
            groups.append(hp)
        group_of_sub[i] = len(groups) - 1
    return groups, group_of_sub
