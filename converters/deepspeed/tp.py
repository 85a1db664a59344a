"""Plan the conversion of a tensor-parallel DeepSpeed checkpoint (AutoTP), ZeRO-0/1/2/3.

Layout written by DeepSpeed 0.19 with `"tensor_parallel": {"autotp_size": T}` (no pipeline):

* `mp_rank_{TT}_model_states.pt` per TP rank TT: `param_shapes` with that rank's shard shapes,
  the module's shards, `shared_params` (tied aliases, e.g. `lm_head.weight` -> `embed_tokens`)
  and `universal_checkpoint_info` with an `affine_map` (see `deepspeed.declared`).
* `[bf16_]zero_pp_rank_{D}_mp_rank_{TT}_optim_states.pt`: ZeRO partitions of each TP shard over
  the data-parallel ranks of that TP rank. ZeRO-0 writes none: each TP rank's optimizer state sits
  whole in its model file (see `deepspeed.zero0`).
* ZeRO-3 writes `zero_pp_rank_{D}_mp_rank_{TT}_{model,optim}_states.pt` instead: every TP shard is
  partitioned on its own over the DP ranks of its TP rank (see `deepspeed.zero3`), frozen ones too.

Every parameter is an outer layout over TP ranks (Shard-V for column-parallel weights and a
vocabulary-split embedding, Shard-H for row-parallel ones, Replicate for norms), each shard
partitioned again by ZeRO: Shard-Hy, or a Replicate of partitioned copies. The affine map gives
the full shape and the outer pattern. Tied aliases (`shared_params`, or module entries that share
another's storage) are not parameters of their own and are skipped.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from ucp.converters.deepspeed.lists import checkpoint_layouts
from ucp.converters.deepspeed.slices import (
    SliceState,
    combined_source,
    dtype_name,
    load_dict,
    outer_states,
    read_slice,
    tied_aliases,
    whole,
)
from ucp.converters.deepspeed.zero0 import zero0_slice
from ucp.converters.deepspeed.zero3 import ZERO3_MODEL_FILE, read_zero3_slice, zero3_model_files
from ucp.converters.plan_common import finish_plan
from ucp.converters.tag_folder import MODEL_FILE, TagDir, model_files, optim_files
from ucp.converters.torch_zip import LazyTensor, read_values
from ucp.errors import AmbiguousPatternError, CheckpointNotFoundError, CorruptCheckpointError, UnsupportedLayoutError
from ucp.patterns import Hints, Pattern, recognize
from ucp.plan.assemble import materialize
from ucp.plan.plan import (
    BUFFER,
    BUFFER_STATE,
    FROZEN,
    TRAINABLE,
    WEIGHT_STATE,
    ConversionPlan,
    ParamPlan,
    StateSource,
)


def is_tensor_parallel(names: list[str]) -> bool:
    zero3_slices = {m.group(2) for n in names if (m := ZERO3_MODEL_FILE.match(n))}
    return sum(1 for n in names if MODEL_FILE.match(n)) > 1 or len(zero3_slices) > 1


def plan_tp(where: TagDir, names: list[str], patterns: dict[str, str] | None = None) -> ConversionPlan:
    """The plan of the tensor-parallel checkpoint in tag folder `where.path`, whose files are `names`.

    `patterns` maps a parameter name (or a regex of whole names) to the pattern of its TP shards
    (`replicate`, `partial`, `shard_v`, `shard_h`), for checkpoints that do not declare it.
    """
    folder = where.path
    optims = optim_files(folder, names)
    zero3 = zero3_model_files(folder, names)
    models = {mp: path for (dp, mp), path in zero3.items() if dp == 0} if zero3 else model_files(folder, names)
    first = load_dict(models[min(models)])
    dims = first.get("checkpoint_parallel_dimensions") or {}
    tp, pp = int(dims.get("tp_degree") or len(models)), int(dims.get("pp_degree") or 1)
    if pp != 1:
        raise UnsupportedLayoutError(f"{folder}: {pp} pipeline stages without PipelineModule layer files; "
                                     "tensor x pipeline parallel checkpoints are not supported yet")
    missing = [t for t in range(tp) if t not in models]
    if missing:
        wanted = f"zero_pp_rank_0_mp_rank_{missing[0]:02d}" if zero3 else f"mp_rank_{missing[0]:02d}"
        raise CheckpointNotFoundError(f"{folder / f'{wanted}_model_states.pt'}: missing (the checkpoint has {tp} "
                                      "tensor-parallel ranks); copy every rank's file")
    if zero3:
        ranks = [read_zero3_slice(folder, t, zero3, optims) for t in range(tp)]
    else:
        contents = [first] + [load_dict(models[t]) for t in range(1, tp)]
        # ZeRO-0 keeps each TP rank's optimizer state, whole, in its model file.
        ranks = [read_slice(folder, t, models[t], contents[t], optims) if optims
                 else zero0_slice(t, models[t], contents[t]) for t in range(tp)]
    uc_info = first.get("universal_checkpoint_info")
    trainable = set(ranks[0].shapes)
    layouts = Layouts(checkpoint_layouts(uc_info, str(models[0]), trainable), patterns or {}, uc_info is not None)
    tied = {alias for r in ranks for alias in tied_aliases(r.model)}
    params = [_trainable(name, ranks, layouts) for name in ranks[0].shapes]
    params += [_frozen_zero3(name, ranks, layouts) for name in ranks[0].frozen]
    params += untrained_shards([r.model.get("module") or {} for r in ranks], layouts,
                               set(ranks[0].shapes) | set(ranks[0].frozen) | tied,
                               set(ranks[0].model.get("buffer_names") or []), "files from different runs are mixed")
    layouts.check_used(folder)
    files = [p for r in ranks for p in r.files()]
    return finish_plan(where, first, params, ranks[0].hyper, ranks[0].moment_names, ranks[0].stage, ranks[0].dp,
                       files, ranks[0].loss_scaler, {"tp": tp, "pp": 1})


class Layouts:
    """Where each parameter's TP layout comes from, first to last: a `--pattern NAME=PATTERN` the user
    gave (NAME a parameter name or a regex matching whole names), what the checkpoint declares
    (`declared(name, shard shapes)`: the full shape and hints, or None), or what the shards themselves
    show. Shards of different shapes are split along the one dim where they differ; shards of one
    shape are Replicate when their fp32 copies are equal (read here to check) and otherwise
    ambiguous: split along dim 0 or 1, which only the user can say."""

    def __init__(self, declared: Callable[[str, list[tuple[int, ...]]], tuple[tuple[int, ...], Hints] | None],
                 patterns: dict[str, str], has_info: bool):
        self.declared = declared
        self.has_info = has_info  # whether the checkpoint records universal_checkpoint_info at all
        self.patterns = {key: _pattern_of(key, value) for key, value in patterns.items()}
        self.used: set[str] = set()

    def of(self, name: str, shapes: list[tuple[int, ...]], copies: Callable[[], list[np.ndarray]]
           ) -> tuple[tuple[int, ...], Hints]:
        given = [key for key in self.patterns if key == name or re.fullmatch(key, name)]
        if given:
            self.used.add(given[0])
            return _declared_by_user(name, shapes, self.patterns[given[0]]), Hints(pattern=self.patterns[given[0]])
        declared = self.declared(name, shapes)
        if declared is not None:
            return declared
        differ = [d for d in range(len(shapes[0])) if len({s[d] for s in shapes}) > 1]
        if len(differ) == 1 and differ[0] < 2 and len({len(s) for s in shapes}) == 1:
            pattern = Pattern.SHARD_V if differ[0] == 0 else Pattern.SHARD_H
            return _declared_by_user(name, shapes, pattern), Hints(pattern=pattern)
        if not differ:
            tensors = copies()
            if all(np.array_equal(tensors[0], t) for t in tensors[1:]):
                return shapes[0], Hints(pattern=Pattern.REPLICATE)
            seen = f"its {len(shapes)} TP shards have one shape {shapes[0]} but different values"
        else:
            seen = f"its TP shards have shapes {shapes}"
        declares = ("the checkpoint's universal_checkpoint_info declares no tensor-parallel layout for it" if
                    self.has_info else "the checkpoint declares no tensor-parallel layout for it (no "
                    "universal_checkpoint_info)")
        raise AmbiguousPatternError(
            f"{name}: {declares} and {seen}, so the way they join is unknown; pass --pattern '{name}=shard_v' "
            f"(split along dim 0, column-parallel) or --pattern '{name}=shard_h' (dim 1, row-parallel); a fused "
            "parameter (QKV, gate/up) needs its sub-parameters declared in universal_checkpoint_info "
            "(parameter_with_sub_params)")

    def check_used(self, folder) -> None:
        unused = sorted(set(self.patterns) - self.used)
        if unused:
            raise AmbiguousPatternError(f"--pattern '{unused[0]}' matches no tensor-parallel parameter of {folder}; "
                                        "check the name (a parameter name, or a regex of whole names)")


def _pattern_of(key: str, value: str) -> Pattern:
    allowed = (Pattern.REPLICATE, Pattern.PARTIAL, Pattern.SHARD_V, Pattern.SHARD_H)
    try:
        pattern = Pattern(value)
    except ValueError:
        pattern = None
    if pattern not in allowed:
        raise AmbiguousPatternError(f"--pattern '{key}={value}': the pattern must be one of "
                                    f"{', '.join(p.value for p in allowed)}")
    return pattern


def _declared_by_user(name: str, shapes: list[tuple[int, ...]], pattern: Pattern) -> tuple[int, ...]:
    """The full shape that TP shards of `shapes` form under `pattern`."""
    if pattern in (Pattern.REPLICATE, Pattern.PARTIAL):
        if len(set(shapes)) > 1:
            raise AmbiguousPatternError(f"{name}: declared {pattern.value} but its TP shards have shapes {shapes}")
        return shapes[0]
    dim = 0 if pattern is Pattern.SHARD_V else 1
    if any(len(s) <= dim or len(s) != len(shapes[0]) or s[:dim] + s[dim + 1:] != shapes[0][:dim] + shapes[0][dim + 1:]
           for s in shapes):
        raise AmbiguousPatternError(f"{name}: declared {pattern.value} but its TP shards of shapes {shapes} do not "
                                    f"join along dim {dim}")
    full = list(shapes[0])
    full[dim] = sum(s[dim] for s in shapes)
    return tuple(full)


def fp32_shard(name: str, rank: SliceState) -> np.ndarray:
    """TP rank `rank`'s fp32 shard of `name`, read from its fragments."""
    frags = rank.fragments[(name, WEIGHT_STATE)]
    return materialize(StateSource(recognize(name, rank.shapes[name], [f.info for f in frags]), tuple(frags)),
                       name=name)


def _on_every_rank(name: str, ranks: list[SliceState], tables: list[dict], what: str) -> list:
    """`name`'s entry in every TP rank's table (its `what`); a named error where a rank lacks it."""
    for r, table in zip(ranks, tables):
        if name not in table:
            raise CorruptCheckpointError(f"{r.model_path}: lists no {what} '{name}', which TP rank 0 holds; files "
                                         "from different runs are mixed")
    return [table[name] for table in tables]


def _trainable(name: str, ranks: list[SliceState], layouts: Layouts) -> ParamPlan:
    shard_shapes = _on_every_rank(name, ranks, [r.shapes for r in ranks], "trainable parameter")
    shape, hints = layouts.of(name, shard_shapes, lambda: [fp32_shard(name, r) for r in ranks])
    states = outer_states(name, shape, ranks, [r.mp for r in ranks], shard_shapes, hints, "TP ranks")
    group = ranks[0].group_of[name]
    t = (ranks[0].model.get("module") or {}).get(name)
    return ParamPlan(name, shape, TRAINABLE, states, group, ranks[0].steps.get(group),
                     dtype_name(t) if isinstance(t, LazyTensor) else "float32")


def _frozen_zero3(name: str, ranks: list[SliceState], layouts: Layouts) -> ParamPlan:
    """A frozen parameter under ZeRO-3: every TP rank's shard partitioned over its DP ranks."""
    held = [(r.mp, *frozen) for r, frozen in zip(ranks, _on_every_rank(name, ranks, [r.frozen for r in ranks],
                                                                       "frozen parameter"))]

    def copies() -> list[np.ndarray]:
        return [materialize(StateSource(recognize(name, shard, [f.info for f in frags]), tuple(frags)), name=name)
                for _, shard, frags in held]

    shape, hints = layouts.of(name, [shard for _, shard, _ in held], copies)
    t = (ranks[0].model.get("module") or {}).get(name)
    return ParamPlan(name, shape, FROZEN, {WEIGHT_STATE: combined_source(name, shape, held, hints)},
                     model_dtype=dtype_name(t) if isinstance(t, LazyTensor) else "float32")


def untrained_shards(tables: list[dict], layouts: Layouts, skip: set[str], buffers: set[str],
                     missing: str) -> list[ParamPlan]:
    """Frozen parameters and buffers: whole TP shards, one table (name -> tensor) per TP rank.

    `missing` ends the error for a tensor some rank's table lacks (which files to copy).
    """
    out = []
    for name, t in tables[0].items():
        if name in skip or not isinstance(t, LazyTensor):
            continue
        tensors = [x for x in (table.get(name) for table in tables) if isinstance(x, LazyTensor)]
        if len(tensors) < len(tables):
            raise CorruptCheckpointError(f"{name}: some TP ranks lack it; {missing}")
        shape, hints = layouts.of(name, [x.shape for x in tensors], lambda: [read_values(x) for x in tensors])
        frags = [whole(x, rank) for rank, x in enumerate(tensors)]
        spec = recognize(name, shape, [f.info for f in frags], hints)
        kind, state, dtype = (BUFFER, BUFFER_STATE, dtype_name(t)) if name in buffers else (FROZEN, WEIGHT_STATE,
                                                                                          "float32")
        out.append(ParamPlan(name, shape, kind, {state: StateSource(spec, tuple(frags), dtype)},
                             model_dtype=dtype_name(t)))
    return out
