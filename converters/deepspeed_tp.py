"""Plan the conversion of a tensor-parallel DeepSpeed checkpoint (AutoTP), ZeRO-1/2.

Layout written by DeepSpeed 0.19 with `"tensor_parallel": {"autotp_size": T}` (no pipeline):

* `mp_rank_{TT}_model_states.pt` per TP rank TT: `param_shapes` with that rank's shard shapes,
  the module's shards, `shared_params` (tied aliases, e.g. `lm_head.weight` -> `embed_tokens`)
  and `universal_checkpoint_info` with an `affine_map` (see `deepspeed_declared`).
* `[bf16_]zero_pp_rank_{D}_mp_rank_{TT}_optim_states.pt`: ZeRO partitions of each TP shard over
  the data-parallel ranks of that TP rank.

Every parameter is an outer layout over TP ranks (Shard-V for column-parallel weights and a
vocabulary-split embedding, Shard-H for row-parallel ones, Replicate for norms), each shard
partitioned again by ZeRO: Shard-Hy, or a Replicate of partitioned copies. The affine map gives
the full shape and the outer pattern. Tied aliases are not parameters of their own and are skipped.
"""
from __future__ import annotations

from ucp.converters.deepspeed_declared import affine_params, declared_layout
from ucp.converters.deepspeed_slices import (MODEL_FILE, SliceState, combined_source, dtype_name, load_dict,
                                             model_files, optim_files, read_slice, whole)
from ucp.converters.deepspeed_zero import TagDir, finish_plan
from ucp.converters.torch_zip import LazyTensor
from ucp.errors import AmbiguousPatternError, CheckpointNotFoundError, CorruptCheckpointError, UnsupportedLayoutError
from ucp.patterns import Hints, recognize
from ucp.plan import BUFFER, BUFFER_STATE, FROZEN, TRAINABLE, WEIGHT_STATE, ConversionPlan, ParamPlan, StateSource


def is_tensor_parallel(names: list[str]) -> bool:
    return sum(1 for n in names if MODEL_FILE.match(n)) > 1


def plan_tp(where: TagDir, names: list[str]) -> ConversionPlan:
    """The plan of the tensor-parallel checkpoint in tag folder `where.path`, whose files are `names`."""
    folder = where.path
    models = model_files(folder, names)
    first = load_dict(models[min(models)])
    dims = first.get("checkpoint_parallel_dimensions") or {}
    tp, pp = int(dims.get("tp_degree") or len(models)), int(dims.get("pp_degree") or 1)
    if pp != 1:
        raise UnsupportedLayoutError(f"{folder}: {pp} pipeline stages without PipelineModule layer files; "
                                     "tensor x pipeline parallel checkpoints are not supported yet")
    missing = [t for t in range(tp) if t not in models]
    if missing:
        raise CheckpointNotFoundError(f"{folder / f'mp_rank_{missing[0]:02d}_model_states.pt'}: missing (the "
                                      f"checkpoint has {tp} tensor-parallel ranks); copy every rank's file")
    optims = optim_files(folder, names)
    if not optims:
        raise UnsupportedLayoutError(f"{folder}: a tensor-parallel checkpoint without ZeRO optimizer files is not "
                                     "supported yet; save it with ZeRO stage 1 or 2")
    ranks = [read_slice(folder, t, models[t], first if t == 0 else load_dict(models[t]), optims) for t in range(tp)]
    entries = affine_params(first.get("universal_checkpoint_info"), str(models[0]))
    aliases = {str(k) for r in ranks for k in (r.model.get("shared_params") or {})}
    params = [_trainable(name, ranks, entries) for name in ranks[0].shapes]
    trainable = set(ranks[0].shapes)
    params += _module_only(ranks, entries, trainable | aliases)
    files = [p for r in ranks for p in [*r.optim_paths, r.model_path]]
    return finish_plan(where, first, params, ranks[0].hyper, ranks[0].moment_names, ranks[0].stage, ranks[0].dp,
                       files, ranks[0].loss_scaler, {"tp": tp, "pp": 1})


def _layout(name: str, shard_shapes: list[tuple[int, ...]], entries: dict) -> tuple[tuple[int, ...], Hints]:
    declared = declared_layout(name, entries)
    if declared is None:
        raise AmbiguousPatternError(f"{name}: the checkpoint declares no tensor-parallel layout for it (no "
                                    "universal_checkpoint_info affine_map entry), so its full shape and pattern "
                                    f"are unknown; shards have shapes {shard_shapes}")
    return declared


def _trainable(name: str, ranks: list[SliceState], entries: dict) -> ParamPlan:
    shard_shapes = []
    for r in ranks:
        if name not in r.shapes:
            raise CorruptCheckpointError(f"{r.model_path}: lists no '{name}', which TP rank 0 trains; files from "
                                         "different runs are mixed")
        shard_shapes.append(r.shapes[name])
    shape, hints = _layout(name, shard_shapes, entries)
    states = {}
    for state in ranks[0].states():
        outer = [(r.mp, r.shapes[name], r.fragments[(name, state)]) for r in ranks if (name, state) in r.fragments]
        if len(outer) == len(ranks):
            states[state] = combined_source(name, shape, outer, hints)
        elif outer:
            raise CorruptCheckpointError(f"{name}: only {len(outer)} of {len(ranks)} TP ranks hold its '{state}'; "
                                         "files from different runs are mixed")
    if WEIGHT_STATE not in states:
        raise CorruptCheckpointError(f"{ranks[0].optim_paths[0]}: parameter '{name}' has no optimizer fragment (it "
                                     "never received a gradient); convert a checkpoint saved after a full step")
    group = ranks[0].group_of[name]
    t = (ranks[0].model.get("module") or {}).get(name)
    return ParamPlan(name, shape, TRAINABLE, states, group, ranks[0].steps.get(group),
                     dtype_name(t) if isinstance(t, LazyTensor) else "float32")


def _module_only(ranks: list[SliceState], entries: dict, skip: set[str]) -> list[ParamPlan]:
    """Frozen parameters and buffers: whole TP shards in every rank's module state."""
    modules = [r.model.get("module") or {} for r in ranks]
    buffers = set(ranks[0].model.get("buffer_names") or [])
    out = []
    for name, t in modules[0].items():
        if name in skip or not isinstance(t, LazyTensor):
            continue
        tensors = [m.get(name) for m in modules]
        if not all(isinstance(x, LazyTensor) for x in tensors):
            raise CorruptCheckpointError(f"{name}: some TP ranks' module state lacks it; files from different "
                                         "runs are mixed")
        shape, hints = _layout(name, [x.shape for x in tensors], entries)
        frags = [whole(x, rank) for rank, x in enumerate(tensors)]
        spec = recognize(name, shape, [f.info for f in frags], hints)
        kind, state, dtype = (BUFFER, BUFFER_STATE, dtype_name(t)) if name in buffers else (FROZEN, WEIGHT_STATE,
                                                                                          "float32")
        out.append(ParamPlan(name, shape, kind, {state: StateSource(spec, tuple(frags), dtype)},
                             model_dtype=dtype_name(t)))
    return out
