"""Read the ZeRO-1/2 optimizer state of one model-parallel slice of a DeepSpeed checkpoint.

DeepSpeed writes one `mp_rank_{MM}_model_states.pt` per model-parallel slice (a pipeline stage, a
tensor-parallel rank, or both: MM = stage × tp_degree + tp_rank), and ZeRO partitions each slice's
parameters over that slice's data-parallel ranks, in `[bf16_]zero_pp_rank_{D}_mp_rank_{MM}_optim_states.pt`.
Every rank file holds, per param group, its flat fp32 partition, the optimizer moments over the
same partition and `param_slice_mappings` (name -> numel, start within the partition).

`read_slice` turns one slice into fragments per (parameter, state), in rank order, each with its
offset in the parameter's flattened (slice-local) tensor. A `rename` hook lets a caller give a
rank's parameters their global names (MoE ranks keep their experts under local names).
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ucp.converters.rank_identity import (
    GroupPartition,
    check_distinct,
    check_masters_match_module,
    check_partition_layout,
)
from ucp.converters.torch_zip import LazyTensor, Opaque, load_lazy, read_values
from ucp.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedLayoutError
from ucp.patterns import Pattern
from ucp.patterns.recognize import FragmentInfo, Hints, outer_kind, recognize_outer
from ucp.plan.plan import TRAINABLE, WEIGHT_STATE, Fragment, ParamPlan, Piece, StateSource

# (rank, param group, name as the rank's optimizer stores it) -> the parameter's global name
Rename = Callable[[int, int, str], str]


@dataclass
class SliceState:
    """What the optimizer files of one model-parallel slice hold."""

    mp: int
    model_path: Path
    model: dict
    dp: int
    optim_paths: list[Path]
    shapes: dict[str, tuple[int, ...]]  # as the slice's model file lists them (this slice's shard shapes)
    group_of: dict[str, int] = field(default_factory=dict)  # global name -> param group
    fragments: dict[tuple[str, str], list[Fragment]] = field(default_factory=dict)
    steps: dict[int, float | None] = field(default_factory=dict)
    moment_names: list[str] = field(default_factory=list)
    hyper: list = field(default_factory=list)
    stage: int | None = None
    loss_scaler: object = None  # rank 0's, as pickled (fp16 training keeps its dynamic scale here)
    model_paths: list[Path] = field(default_factory=list)  # ZeRO-3: every DP rank's model file, else empty
    # ZeRO-3: frozen parameters partitioned like trainable ones (name -> slice shape, fragments in rank order)
    frozen: dict[str, tuple[tuple[int, ...], list[Fragment]]] = field(default_factory=dict)

    def states(self) -> list[str]:
        return [WEIGHT_STATE, *self.moment_names]

    def files(self) -> list[Path]:
        """Every file this slice was read from."""
        return [*self.optim_paths, *(self.model_paths or [self.model_path])]


def expect(value: object, kind: type | tuple[type, ...], path: Path, what: str) -> Any:
    """`value`, which DeepSpeed writes as a `kind`; otherwise one error naming the file, rather than a
    traceback from the first use of it."""
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise CorruptCheckpointError(f"{path}: {what} is a {type(value).__name__} where DeepSpeed writes a {names}; "
                                     "the file is damaged, copy it again from the training job")
    return value


def param_groups(value: object, path: Path) -> list[dict]:
    """An optimizer's `param_groups`: a list of dicts (hyper-parameters), checked as `expect` does."""
    groups = expect(value, list, path, "its optimizer 'param_groups'")
    for g, group in enumerate(groups):
        expect(group, dict, path, f"its optimizer param group {g}")
    return groups


def load_dict(path: Path) -> dict:
    """The dict a rank file holds, tensors lazy (see `torch_zip`)."""
    obj = load_lazy(path)
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{path}: expected a dict of checkpoint state, found {type(obj).__name__}")
    return obj


def read_slice(folder: Path, mp: int, model_path: Path, model: dict, files: dict[tuple[int, int], Path],
               rename: Rename | None = None, param_shapes: list[dict] | None = None) -> SliceState:
    """Fragments of every parameter that slice `mp` trains, over its data-parallel ranks.

    `param_shapes` (per param group, name -> shape in flat order) stands in for the model file's
    when it records none (the bf16 optimizer without ZeRO, as pipeline engines use it).
    """
    dp = int(model.get("dp_world_size") or sum(1 for (_, m) in files if m == mp))
    paths = dp_paths(folder, files, dp, mp)
    param_shapes = param_shapes or model.get("param_shapes")
    if not param_shapes:
        raise CorruptCheckpointError(f"{model_path}: records no param_shapes; was it written by "
                                     "engine.save_checkpoint?")
    out = SliceState(mp, model_path, model, dp, paths,
                     {name: shape_of(s) for group in param_shapes for name, s in group.items()},
                     {name: g for g, group in enumerate(param_shapes) for name in group})
    check_distinct(paths)
    covered: dict[str, int] = {}
    partitions: list[list[GroupPartition]] = []  # per rank, per param group: where its partition lies
    masters: list[list[LazyTensor]] = []
    for rank, path in enumerate(paths):
        osd = load_dict(path).get("optimizer_state_dict")
        if not isinstance(osd, dict) or "single_partition_of_fp32_groups" not in osd:
            raise CorruptCheckpointError(f"{path}: not a ZeRO-1/2 optimizer file (no single_partition_of_fp32_groups)")
        # The bf16 optimizer without ZeRO (pipeline engines at stage 0) records no stage of its own.
        stage = zero_stage(osd, path) if "zero_stage" in osd else config_stage(model)
        if rank and stage != out.stage:
            raise CorruptCheckpointError(f"{path}: records ZeRO stage {stage}, {paths[0].name} stage {out.stage}; "
                                         "files from different runs are mixed")
        out.stage = stage
        if rank == 0:
            out.loss_scaler = osd.get("loss_scaler")
        base = expect(osd.get("base_optimizer_state"), dict, path, "its base_optimizer_state")
        state = expect(base.get("state", {}), dict, path, "its optimizer 'state'")
        if not out.hyper:
            out.hyper = param_groups(base.get("param_groups", []), path)
        check_partitions(osd.get("partition_count"), dp, out.hyper, path)
        flat_fp32 = expect(osd["single_partition_of_fp32_groups"], (list, tuple), path,
                           "its single_partition_of_fp32_groups")
        mappings = osd.get("param_slice_mappings")
        if mappings is None:
            raise UnsupportedLayoutError(f"{path}: records no param_slice_mappings (DeepSpeed older than 0.10); "
                                         "re-save the checkpoint with a newer DeepSpeed")
        expect(mappings, (list, tuple), path, "its param_slice_mappings")
        if len(mappings) != len(param_shapes):
            raise CorruptCheckpointError(f"{path}: has {len(mappings)} param groups, {model_path.name} has "
                                         f"{len(param_shapes)}; files from different runs are mixed")
        if len(flat_fp32) != len(mappings):
            raise CorruptCheckpointError(f"{path}: holds {len(flat_fp32)} fp32 partitions for {len(mappings)} param "
                                         "groups; the file is damaged, copy it again from the training job")
        partitions.append([])
        masters.append(list(flat_fp32))
        for g, mapping in enumerate(mappings):
            if not isinstance(flat_fp32[g], LazyTensor):
                raise CorruptCheckpointError(f"{path}: its fp32 partition of param group {g} is no tensor; the file is "
                                             "damaged, copy it again")
            flats, step = group_states(out, state.get(g, {}), flat_fp32[g], path, g)
            agree_step(out.steps, g, step, path, paths[0])
            partitions[rank].append(GroupPartition(flat_fp32[g].numel, _count_at(osd.get("group_paddings"), g, path),
                                                   "zero_stage" in osd,
                                                   sum(_counts_at(osd.get("param_alignment_paddings"), g, path))))
            for local, address in expect(mapping, dict, path, f"its param_slice_mappings of param group {g}").items():
                if local not in out.shapes:
                    raise CorruptCheckpointError(f"{path}: partition holds '{local}', which {model_path.name} "
                                                 "does not list; files from different runs are mixed")
                name = rename(rank, g, local) if rename else local
                numel, start = int(address.numel), int(address.start)
                partitions[rank][g].pieces[local] = (start, numel)
                offset = covered.get(name, 0)
                for state_name, flat in flats.items():
                    out.fragments.setdefault((name, state_name), []).append(
                        Fragment(FragmentInfo(rank, (numel,), offset), piece(flat, start, numel)))
                covered[name] = offset + numel
                out.group_of[name] = g
    agree_with_model(out.steps, model, model_path)
    experts = {g for g, hp in enumerate(out.hyper) if isinstance(hp, dict) and hp.get("moe")}
    check_partition_layout(paths, partitions, param_shapes, experts)
    check_masters_match_module(paths, masters, partitions, model.get("module") or {}, model_path, experts)
    return out


def _count_at(values, g: int, path: Path) -> int | None:
    """`values[g]` of a per-group list of counts a rank file records, or None where it records none."""
    if not isinstance(values, (list, tuple)) or g >= len(values):
        return None
    if not isinstance(values[g], int) or values[g] < 0:
        raise CorruptCheckpointError(f"{path}: records {values[g]!r} for param group {g} where a count belongs")
    return values[g]


def _counts_at(values, g: int, path: Path) -> list[int]:
    """The counts of `values[g]`, a per-group list of per-parameter counts (none where unrecorded)."""
    if not isinstance(values, (list, tuple)) or g >= len(values):
        return []
    if not isinstance(values[g], (list, tuple)) or not all(isinstance(v, int) and v >= 0 for v in values[g]):
        raise CorruptCheckpointError(f"{path}: records {values[g]!r} for param group {g} where counts belong")
    return list(values[g])


def dp_paths(folder: Path, files: dict[tuple[int, int], Path], dp: int, mp: int,
             what: str = "optim_states") -> list[Path]:
    """The `dp` rank files of slice `mp`, in rank order; a named error for a missing or stray one."""
    missing = [d for d in range(dp) if (d, mp) not in files]
    if missing:
        example = next(iter(files.values())).name if files else f"zero_pp_rank_0_mp_rank_00_{what}.pt"
        wanted = re.sub(r"zero_pp_rank_\d+", f"zero_pp_rank_{missing[0]}", example)
        wanted = re.sub(r"mp_rank_\d+", f"mp_rank_{mp:02d}", wanted)
        raise CheckpointNotFoundError(f"{folder / wanted}: missing (the checkpoint was saved by {dp} data-parallel "
                                      f"ranks, {len(missing)} {what} file(s) absent); copy every rank's file")
    extra = sorted(d for (d, m) in files if m == mp and d >= dp)
    if extra:
        raise CorruptCheckpointError(f"{folder}: has {what} files for rank {extra[0]} but dp_world_size is {dp}; "
                                     "files from different runs are mixed in this folder")
    return [files[(d, mp)] for d in range(dp)]


def check_partitions(count, dp: int, hyper: list, path: Path) -> None:
    """Each param group is partitioned over all `dp` ranks, except MoE expert groups (hyper-parameter
    `moe`), which ZeRO partitions over the expert-data-parallel group, a divisor of `dp`."""
    counts = count if isinstance(count, list) else [count] * max(1, len(hyper))
    for g, c in enumerate(counts):
        if c is None:
            continue
        expert = g < len(hyper) and bool(hyper[g].get("moe"))
        if (int(c) != dp and not expert) or dp % int(c):
            raise CorruptCheckpointError(f"{path}: param group {g} is partitioned over {int(c)} ranks but the model "
                                         f"file says dp_world_size={dp}; files from different runs are mixed")


def tied_aliases(model: dict) -> dict[str, str]:
    """alias -> source: the names under which a model-states file holds a tied weight a second time.

    DeepSpeed lists them in `shared_params` (`{'lm_head.weight': 'model.embed_tokens.weight'}`;
    written on rank 0 only, and not at all by ZeRO-0), and `torch.save` keeps the sharing, so the
    module state dict holds the alias over the same stored bytes as its source. An alias is one
    parameter under two names: it holds no optimizer state and is recorded once, as an alias.
    """
    found = {str(alias): str(source) for alias, source in (model.get("shared_params") or {}).items()}
    first: dict[tuple, str] = {}
    for name, t in (model.get("module") or {}).items():
        if isinstance(t, LazyTensor) and t.numel:  # ZeRO-3 placeholders hold nothing
            where = (t.path, t.storage.key, t.storage_offset, t.shape, t.stride)  # keys are per file
            if where in first and name not in found:
                found[name] = first[where]
            first.setdefault(where, name)
    return found


def shape_of(value) -> tuple[int, ...]:
    return tuple(int(s) for s in value)


def dtype_name(t: LazyTensor) -> str:
    return str(t.dtype)


def piece(t: LazyTensor, start: int, numel: int) -> Piece:
    if not t.is_contiguous() or start + numel > t.numel:
        raise CorruptCheckpointError(f"{t.path}: a fragment [{start}, {start + numel}) lies outside its "
                                     f"flat partition of {t.numel} elements")
    return Piece(t.path, t.byte_offset(start), numel, dtype_name(t))


def whole(t: LazyTensor, rank: int = 0) -> Fragment:
    return Fragment(FragmentInfo(rank, t.shape), piece(t, 0, t.numel))


def group_states(out: SliceState, state: object, fp32: LazyTensor, path: Path,
                 group: int) -> tuple[dict[str, LazyTensor], float | None]:
    """One flat param group's tensors by state name (fp32 master, then the moments of its optimizer `state`)
    and its step; the moment names are recorded in `out` the first time."""
    checked: dict = expect(state, dict, path, f"the optimizer state of param group {group}")
    out.moment_names = out.moment_names or moment_keys(checked)
    return {WEIGHT_STATE: fp32, **{k: checked[k] for k in moment_keys(checked)}}, step_value(checked, path)


def moment_keys(state: dict) -> list[str]:
    return [k for k, v in state.items() if k != "step" and isinstance(v, LazyTensor)]


def agree_step(steps: dict[int, float | None], group: int, step: float | None, path: Path, first: Path) -> None:
    """Record `group`'s optimizer step, which every rank file of one save records alike."""
    if group in steps and step != steps[group]:
        raise CorruptCheckpointError(f"{path}: records optimizer step {step} for param group {group}, {first.name} "
                                     f"records {steps[group]}; files from different saves are mixed, copy the whole "
                                     "tag folder again from the training job")
    steps[group] = step


def agree_with_model(steps: dict[int, float | None], model: dict, model_path: Path) -> None:
    """Without fp16 (whose overflowing steps the optimizer skips) every optimizer step is a global step:
    the model-states file must record as many as the optimizer files. A count of 0 is a loop that steps DeepSpeed's
    optimizer itself, never through `engine.step` (Lightning Fabric's), which leaves the engine's count unused."""
    config = model.get("ds_config") or {}
    global_steps = model.get("global_steps")
    if (config.get("fp16") or {}).get("enabled") or not isinstance(global_steps, int) or global_steps == 0:
        return
    for group, step in steps.items():
        if step is not None and step != global_steps:
            raise CorruptCheckpointError(f"{model_path}: records {global_steps} global steps, the optimizer files "
                                         f"{step} for param group {group}; files from different saves are mixed, "
                                         "copy the whole tag folder again from the training job")


def step_value(state: dict, path: Path) -> float | None:
    step = state.get("step")
    if step is None:
        return None
    if isinstance(step, LazyTensor):
        return float(read_values(step).reshape(-1)[0])
    if isinstance(step, (int, float)):
        return float(step)
    raise CorruptCheckpointError(f"{path}: unreadable optimizer step {step!r}")


def config_stage(model: dict) -> int:
    """The ZeRO stage the training job's DeepSpeed config asked for."""
    return int((((model.get("ds_config") or {}).get("zero_optimization")) or {}).get("stage", 0))


def slice_names(paths: list[Path]) -> list[dict[str, int]]:
    """Per param group, every parameter name a slice's optimizer files list (in flat order) -> its numel."""
    groups: list[dict[str, int]] = []
    for path in paths:
        osd = expect(load_dict(path).get("optimizer_state_dict") or {}, dict, path, "its optimizer_state_dict")
        mappings = expect(osd.get("param_slice_mappings") or [], (list, tuple), path, "its param_slice_mappings")
        for g, mapping in enumerate(mappings):
            expect(mapping, dict, path, f"its param_slice_mappings of param group {g}")
            if g == len(groups):
                groups.append({})
            for name, address in mapping.items():
                groups[g][name] = groups[g].get(name, 0) + int(address.numel)
    return groups


def zero_stage(osd: dict, path: Path) -> int:
    stage = osd.get("zero_stage")
    value = stage.value if isinstance(stage, Opaque) else stage
    if not isinstance(value, int):
        raise CorruptCheckpointError(f"{path}: records no ZeRO stage")
    return value


def combined_source(name: str, shape: tuple[int, ...], outer: list[tuple[int, tuple[int, ...], list[Fragment]]],
                    hints: Hints | None = None) -> StateSource:
    """One state held as outer pieces (TP shards, pipeline stages' copies), each as its own ZeRO
    fragments: `outer` lists (outer rank, piece shape, fragments in rank order), in outer-rank order
    (how they join: `ucp.patterns.recognize.recognize_outer`)."""
    infos = [(rank, piece_shape, [f.info for f in frags]) for rank, piece_shape, frags in outer]
    spec = recognize_outer(name, shape, infos, hints)
    kind = outer_kind(shape, infos, hints)
    if kind == "single":
        return StateSource(spec, tuple(outer[0][2]))
    if kind == "whole":
        return StateSource(spec, tuple(Fragment(FragmentInfo(rank, piece_shape), frags[0].piece)
                                       for rank, piece_shape, frags in outer))
    return StateSource(spec, tuple(f for _, _, frags in outer for f in frags),
                       groups=tuple(len(frags) for *_, frags in outer))


def outer_states(name: str, shape: tuple[int, ...], holders: list[SliceState], ids: list[int],
                 piece_shapes: list[tuple[int, ...]], hints: Hints | None, what: str) -> dict[str, StateSource]:
    """Every state of `name`, held by `holders` as outer pieces (TP shards, or copies on pipeline stages
    or EP ranks) with outer ranks `ids` and shapes `piece_shapes`, each piece its own ZeRO fragments.

    A state that only some holders have means files of different runs are mixed; a parameter with no
    fp32 fragment (it never received a gradient) has no fp32 copy to convert.
    """
    states = {}
    for state in holders[0].states():
        outer = [(i, piece, h.fragments[(name, state)]) for i, piece, h in zip(ids, piece_shapes, holders)
                 if (name, state) in h.fragments]
        if outer and len(outer) != len(holders):
            raise CorruptCheckpointError(f"{name}: held by {what} {ids} but only {len(outer)} of them hold its "
                                         f"'{state}'; files from different runs are mixed")
        if outer:
            states[state] = combined_source(name, shape, outer, hints)
    if WEIGHT_STATE not in states:
        raise CorruptCheckpointError(f"{(holders[0].optim_paths or [holders[0].model_path])[0]}: parameter '{name}' "
                                     "has no optimizer fragment (it never received a gradient), and no other fp32 "
                                     "copy of it is kept; convert a checkpoint saved after a full step")
    return states


def held_params(slices: list[SliceState], tensors: dict[str, LazyTensor], holder: str) -> list[ParamPlan]:
    """The trainable parameters of several slices (each a `holder`: a pipeline stage, an expert-parallel
    rank), in first-seen order. A parameter one slice holds is Unique to it; one that several hold is
    a copy kept identical on each (a tied weight on every stage that uses it, a dense weight on every
    EP rank): Replicate, checked equal under --strict. `tensors` gives each parameter's model dtype."""
    holders: dict[str, list[SliceState]] = {}
    for sl in slices:
        for name in sl.shapes:
            holders.setdefault(name, []).append(sl)
    params = []
    for name, held in holders.items():
        shape = held[0].shapes[name]
        for sl in held[1:]:
            if sl.shapes[name] != shape:
                raise CorruptCheckpointError(f"{name}: {holder} {held[0].mp} holds shape {shape}, {holder} {sl.mp} "
                                             f"{sl.shapes[name]}; a shared parameter must have one shape")
        hints = Hints(pattern=Pattern.REPLICATE) if len(held) > 1 else None
        states = outer_states(name, shape, held, [sl.mp for sl in held], [shape] * len(held), hints, f"{holder}s")
        group = held[0].group_of[name]
        t = tensors.get(name)
        params.append(ParamPlan(name, shape, TRAINABLE, states, group, held[0].steps.get(group),
                                dtype_name(t) if t is not None else "float32"))
    return params
