"""Plan the conversion of a Megatron-DeepSpeed-style checkpoint: tensor x pipeline parallel, ZeRO-1 or fp32 ZeRO-0.

Layout written by DeepSpeed 0.19 for a `PipelineModule` with a `PipeModelDataParallelTopology`
of P stages and T tensor-parallel ranks (T > 1):

* `mp_rank_{MM}_model_states.pt`, MM = stage × T + tp rank: `param_shapes` of that slice's TP
  shards, named as the stage's PipelineModule names them, `checkpoint_parallel_dimensions`
  ({pp_degree, tp_degree}) and the model's `universal_checkpoint_info` (its pattern lists, see
  `deepspeed.lists`; an AutoTP-style `affine_map` is read too).
* `[bf16_]zero_pp_rank_{D}_mp_rank_{MM}_optim_states.pt`: ZeRO partitions of each slice's shards.
  fp32 without ZeRO (ZeRO-0) writes none: each slice's torch optimizer state sits in its model file by
  slot position, with no param_shapes, and, as for a pipeline (`deepspeed.pipe`), nothing names the
  slots: the user names them (`--param-names`, every stage's names once, the same on each TP rank).
* `layer_{LL}-model_{TT}-model_states.pt`: layer LL's state dict on TP rank TT (buffers and frozen
  parameters are read from there).

A parameter lives on one stage, or on several (a tied module: the embedding reused as the output
head), and on every TP rank. Its TP layout comes from `--pattern`, then the declaration, then the
shards (see `deepspeed.tp.Layouts`): Shard-V / Shard-H / Shard-NC / Replicate / Partial over the
TP ranks, each TP shard partitioned again by ZeRO. A tied parameter is read from the first stage
that holds it: DeepSpeed keeps the stages' copies equal (it all-reduces their gradients), and
Megatron-DeepSpeed declares them `pipeline_replicated_parameter_patterns`.
"""
from __future__ import annotations

from pathlib import Path

from ucp.converters.deepspeed.lists import checkpoint_layouts
from ucp.converters.deepspeed.pipe import LAYER_FILE, layer_tensors, optimizer_slots, stage_module, stage_param_names
from ucp.converters.deepspeed.slices import SliceState, dtype_name, load_dict, outer_states, read_slice, tied_aliases
from ucp.converters.deepspeed.tp import Layouts, fp32_shard, untrained_shards
from ucp.converters.deepspeed.zero0 import zero0_slice
from ucp.converters.plan_common import finish_plan
from ucp.converters.tag_folder import TagDir, model_files, optim_files
from ucp.converters.torch_zip import LazyTensor
from ucp.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedLayoutError
from ucp.plan.plan import TRAINABLE, ConversionPlan, ParamPlan


def is_tensor_pipeline(names: list[str]) -> bool:
    """Pipeline layer files of more than one tensor-parallel rank (`layer_LL-model_TT-...`, some TT > 0)."""
    return any((m := LAYER_FILE.match(n)) and m.group(2) not in (None, "00") for n in names)


def plan_megatron(where: TagDir, names: list[str], patterns: dict[str, str] | None = None,
                  param_names: list[str] | None = None) -> ConversionPlan:
    """The plan of the TP x PP checkpoint in tag folder `where.path`, whose files are `names`.

    `patterns` (`--pattern NAME=PATTERN`) overrides or completes what the checkpoint declares; `param_names`
    (fp32 ZeRO-0 only, whose checkpoint names no optimizer slot) lists every stage's trainable parameter names in
    its optimizer's order, stage after stage.
    """
    folder = where.path
    models = model_files(folder, names)
    if 0 not in models:
        raise CheckpointNotFoundError(f"{folder / 'mp_rank_00_model_states.pt'}: missing; copy every model-states "
                                      "file of the checkpoint")
    first = load_dict(models[0])
    dims = first.get("checkpoint_parallel_dimensions") or {}
    pp, tp = int(dims.get("pp_degree") or 0), int(dims.get("tp_degree") or 0)
    if pp < 1 or tp < 2:
        raise CorruptCheckpointError(f"{models[0]}: records checkpoint_parallel_dimensions {dims!r}, but its layer "
                                     "files are those of several tensor-parallel ranks; files from different runs "
                                     "are mixed")
    missing = [mp for mp in range(pp * tp) if mp not in models]
    if missing:
        absent = folder / f"mp_rank_{missing[0]:02d}_model_states.pt"
        raise CheckpointNotFoundError(f"{absent}: missing (the checkpoint has {pp} pipeline stages x {tp} "
                                      "tensor-parallel ranks); copy every file")
    optims = optim_files(folder, names)
    contents = [first] + [load_dict(models[mp]) for mp in range(1, pp * tp)]
    buffers = {b for c in contents for b in (c.get("buffer_names") or [])}
    if not optims:
        slices, layers = _zero0_slices(folder, names, [models[mp] for mp in range(pp * tp)], contents, tp,
                                       buffers, param_names)
    elif all(c.get("param_shapes") for c in contents):
        slices = [read_slice(folder, mp, models[mp], contents[mp], optims) for mp in range(pp * tp)]
        known = {name for st in slices for name in st.shapes} | buffers
        layers = [_layer_tensors_of(folder, names, rank, known) for rank in range(tp)]
    else:
        raise UnsupportedLayoutError(f"{folder}: its model files record no param_shapes (the bf16 optimizer without "
                                     "ZeRO); tensor x pipeline parallel checkpoints are read with ZeRO stage 1 or "
                                     "fp32 without ZeRO")
    uc_info = first.get("universal_checkpoint_info") or {}
    trainable = {name for st in slices for name in st.shapes}
    layouts = Layouts(checkpoint_layouts(uc_info, str(models[0]), trainable), patterns or {},
                      "universal_checkpoint_info" in first)
    by_tp = [[slices[stage * tp + rank] for stage in range(pp)] for rank in range(tp)]
    params = [_trainable(name, by_tp, layers, layouts) for name in _in_order(slices)]
    aliases = {alias for c in contents for alias in tied_aliases(c)}
    params += untrained_shards(layers, layouts, trainable | aliases, buffers,
                               "copy every layer_*-model_*-model_states.pt of the checkpoint")
    layouts.check_used(folder)
    files = [p for st in slices for p in [*st.optim_paths, st.model_path]]
    files += [folder / n for n in names if LAYER_FILE.match(n)]
    return finish_plan(where, first, params, slices[0].hyper, slices[0].moment_names, slices[0].stage, slices[0].dp,
                       files, slices[0].loss_scaler, {"pp": pp, "tp": tp})


def _zero0_slices(folder: Path, names: list[str], paths: list[Path], contents: list[dict], tp: int,
                  buffers: set[str], param_names: list[str] | None
                  ) -> tuple[list[SliceState], list[dict[str, LazyTensor]]]:
    """fp32 without ZeRO: each slice's torch optimizer state sits in its model file by slot position, named by
    `param_names` (every stage's names, stage after stage, as for a pipeline: each TP rank of a stage holds the
    same names), its weights read from its TP rank's layer files. Returns the slices (model-parallel rank order)
    and each TP rank's layer tensors."""
    pp = len(paths) // tp
    listed = stage_param_names(folder, [paths[s * tp] for s in range(pp)], [contents[s * tp] for s in range(pp)],
                               param_names)
    for mp in range(pp * tp):
        held, expected = optimizer_slots(paths[mp], contents[mp]), len(listed[mp // tp])
        if held != expected:
            raise CorruptCheckpointError(f"{paths[mp]}: its optimizer holds {held} parameters, TP rank 0 of its "
                                         f"stage {expected}; files from different runs are mixed")
    known = {n for stage in listed for n in stage} | buffers
    layers = [_layer_tensors_of(folder, names, rank, known) for rank in range(tp)]
    slices = [zero0_slice(mp, paths[mp], {**contents[mp], "module": stage_module(layers[mp % tp], listed[mp // tp],
                                                                                mp // tp)}, listed[mp // tp])
              for mp in range(pp * tp)]
    return slices, layers


def _in_order(slices: list[SliceState]) -> list[str]:
    """Every trainable name once, stage by stage in flat order."""
    return list(dict.fromkeys(name for st in slices for name in st.shapes))


def _layer_tensors_of(folder: Path, names: list[str], rank: int, known: set[str]) -> dict[str, LazyTensor]:
    files = [folder / n for n in names if (m := LAYER_FILE.match(n)) and int(m.group(2) or 0) == rank]
    return layer_tensors(files, known)


def _trainable(name: str, by_tp: list[list[SliceState]], layers: list[dict[str, LazyTensor]],
               layouts: Layouts) -> ParamPlan:
    holders = [h for h in (next((st for st in stages if name in st.shapes), None) for stages in by_tp) if h is not None]
    if len(holders) < len(by_tp):
        raise CorruptCheckpointError(f"{name}: only some tensor-parallel ranks' model files list it; files from "
                                     "different runs are mixed")
    stage = holders[0].mp // len(by_tp)
    if any(h.mp // len(by_tp) != stage for h in holders):
        raise CorruptCheckpointError(f"{name}: its TP ranks place it on different pipeline stages; files from "
                                     "different runs are mixed")
    shard_shapes = [h.shapes[name] for h in holders]
    shape, hints = layouts.of(name, shard_shapes, lambda: [fp32_shard(name, h) for h in holders])
    states = outer_states(name, shape, holders, list(range(len(holders))), shard_shapes, hints, "TP ranks")
    group = holders[0].group_of[name]
    t = layers[0].get(name)
    return ParamPlan(name, shape, TRAINABLE, states, group, holders[0].steps.get(group),
                     dtype_name(t) if t is not None else "float32")

