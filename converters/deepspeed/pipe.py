"""Plan the conversion of a DeepSpeed pipeline-parallel (`PipelineModule`) checkpoint, ZeRO-0/1.

Layout written by DeepSpeed 0.19 (tensor parallelism 1), for stages SS = 0 .. pp-1:

* `mp_rank_{SS}_model_states.pt`: the stage's `param_shapes`, named as its PipelineModule names
  them (`<layer index>.<param>` for a LayerSpec, `tied_modules.<key>.<param>` for a TiedLayerSpec),
  `buffer_names`, and no module (the pipeline engine saves layers instead).
* `[bf16_]zero_pp_rank_{D}_mp_rank_{SS}_optim_states.pt`: ZeRO partitions of the stage's parameters
  over its data-parallel ranks.
* fp32 ZeRO-0 writes no optimizer files: the stage's torch optimizer state dict sits in its model
  file, by slot position, and nothing in the checkpoint names the slots (no param_shapes, no module,
  no tied-module keys, no layer-to-stage map): the user names them (`--param-names`), and the
  names are checked against the layer files' shapes (see `deepspeed.zero0`).
* `layer_{LL}[-model_{TT}]-model_states.pt`: the state dict of layer LL (keys without the layer
  prefix), written by the stage that runs it; the `-model_TT` part appears with an explicit
  topology that has a model axis. A tied module is written once for every layer that uses it
  without a `forward_fn`.

A parameter on one stage is Unique to it. A tied one lives on every stage that uses it and stays
identical there (DeepSpeed all-reduces its gradient between them): Replicate, each stage's copy
partitioned by ZeRO (a nested spec), checked equal under --strict. Buffers and frozen parameters
come from the layer files.
"""
from __future__ import annotations

import re
from pathlib import Path

from ucp.converters.deepspeed.slices import (
    dp_paths,
    dtype_name,
    expect,
    held_params,
    load_dict,
    param_groups,
    read_slice,
    slice_names,
    whole,
)
from ucp.converters.deepspeed.zero0 import zero0_slice
from ucp.converters.plan_common import finish_plan
from ucp.converters.tag_folder import TagDir, model_files, optim_files
from ucp.converters.torch_zip import LazyTensor
from ucp.errors import AmbiguousPatternError, CheckpointNotFoundError, CorruptCheckpointError
from ucp.patterns import recognize
from ucp.plan.plan import BUFFER, BUFFER_STATE, FROZEN, WEIGHT_STATE, ConversionPlan, ParamPlan, StateSource

LAYER_FILE = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
_TIED = re.compile(r"^tied_modules\.([^.]+)\.(.+)$")


def is_pipeline(names: list[str]) -> bool:
    return any(LAYER_FILE.match(n) for n in names)


def plan_pipe(where: TagDir, names: list[str], param_names: list[str] | None = None) -> ConversionPlan:
    """The plan of the pipeline checkpoint in tag folder `where.path`, whose files are `names`.

    `param_names` (fp32 ZeRO-0 only, where the checkpoint names no parameter) lists every stage's
    trainable parameter names in its optimizer's order, stage after stage.
    """
    folder = where.path
    models = model_files(folder, names)
    if 0 not in models:
        raise CheckpointNotFoundError(f"{folder / 'mp_rank_00_model_states.pt'}: missing; copy every stage's "
                                      "model-states file from the training job")
    first = load_dict(models[0])
    dims = first.get("checkpoint_parallel_dimensions") or {}
    pp, tp = int(dims.get("pp_degree") or len(models)), int(dims.get("tp_degree") or 1)
    if tp != 1:
        # Tensor x pipeline checkpoints have layer files of every TP rank (see `megatron`).
        raise CheckpointNotFoundError(f"{folder}: records tensor parallelism {tp} but holds the layer files of TP "
                                      "rank 0 only; copy every layer_*-model_*-model_states.pt of the checkpoint")
    missing = [s for s in range(pp) if s not in models]
    if missing:
        raise CheckpointNotFoundError(f"{folder / f'mp_rank_{missing[0]:02d}_model_states.pt'}: missing (the "
                                      f"checkpoint has {pp} pipeline stages); copy every stage's file")
    optims = optim_files(folder, names)
    contents = [first] + [load_dict(models[s]) for s in range(1, pp)]
    layer_files = [folder / n for n in names if LAYER_FILE.match(n)]
    buffers = {b for m in contents for b in (m.get("buffer_names") or [])}
    if not optims:
        # A tied weight's value is read from its first layer file for every stage (the checkpoint does not
        # say which stage wrote which layer file); --strict still compares the stages' own moments.
        listed = stage_param_names(folder, [models[s] for s in range(pp)], contents, param_names)
        tensors = layer_tensors(layer_files, {n for stage in listed for n in stage} | buffers)
        stages = [zero0_slice(s, models[s], {**contents[s], "module": stage_module(tensors, listed[s], s)},
                              listed[s]) for s in range(pp)]
    elif first.get("param_shapes"):
        stages = [read_slice(folder, s, models[s], contents[s], optims) for s in range(pp)]
        tensors = layer_tensors(layer_files, {name for st in stages for name in st.shapes} | buffers)
    else:
        # bf16 without ZeRO: the model files list no param_shapes; the optimizer files name the
        # parameters and the layer files give their shapes.
        numels = [slice_names(dp_paths(folder, optims, int(contents[s].get("dp_world_size") or 1), s))
                  for s in range(pp)]
        tensors = layer_tensors(layer_files, {n for groups in numels for g in groups for n in g} | buffers)
        stages = [read_slice(folder, s, models[s], contents[s], optims,
                             param_shapes=[{n: _shape_in(tensors, n, numel, models[s]) for n, numel in g.items()}
                                           for g in numels[s]]) for s in range(pp)]
    trainable = {name for st in stages for name in st.shapes}
    params = held_params(stages, tensors, "pipeline stage")
    for name, t in tensors.items():
        if name in buffers:
            params.append(ParamPlan(name, t.shape, BUFFER, {BUFFER_STATE: _whole_source(name, t, dtype_name(t))},
                                    model_dtype=dtype_name(t)))
        elif name not in trainable:
            params.append(ParamPlan(name, t.shape, FROZEN, {WEIGHT_STATE: _whole_source(name, t)},
                                    model_dtype=dtype_name(t)))
    files = [p for st in stages for p in [*st.optim_paths, st.model_path]] + layer_files
    return finish_plan(where, first, params, stages[0].hyper, stages[0].moment_names, stages[0].stage, stages[0].dp,
                       files, stages[0].loss_scaler, {"pp": pp, "tp": 1})


def stage_param_names(folder: Path, paths: list[Path], contents: list[dict],
                      param_names: list[str] | None) -> list[list[str]]:
    """Each stage's optimizer slots named by `param_names`, split by the slot counts of the stages' model files
    `paths` (holding `contents`), in stage order."""
    counts = [optimizer_slots(path, model) for path, model in zip(paths, contents)]
    if param_names is None:
        raise AmbiguousPatternError(
            f"{folder}: fp32 ZeRO-0 keeps each pipeline stage's optimizer state in mp_rank_SS_model_states.pt "
            f"({' + '.join(map(str, counts))} slots) by position only, and the checkpoint records neither the "
            "stages' parameter names, nor which layers each stage runs, nor the keys of tied modules, so its "
            "slots cannot be named from it; pass --param-names FILE listing every stage's trainable parameter "
            "names in optimizer order, stage after stage (on each stage: [n for n, p in "
            "engine.module.named_parameters() if p.requires_grad]), or save with ZeRO stage 1 or bf16")
    if len(param_names) != sum(counts):
        raise AmbiguousPatternError(f"--param-names lists {len(param_names)} names, the {len(counts)} stages' "
                                    f"optimizers hold {' + '.join(map(str, counts))} parameters")
    starts = [sum(counts[:s]) for s in range(len(counts))]
    return [list(param_names[start:start + count]) for start, count in zip(starts, counts)]


def optimizer_slots(path: Path, model: dict) -> int:
    """How many parameters the optimizer state dict in ZeRO-0 model file `path` (holding `model`) holds."""
    opt = model.get("optimizer")
    if not isinstance(opt, dict):
        raise CheckpointNotFoundError(f"{path}: a pipeline checkpoint with no *_optim_states.pt files and no "
                                      "optimizer state in its model files; was it saved with an optimizer?")
    inner = expect(opt.get("optimizer_state_dict", opt), dict, path, "its optimizer_state_dict")
    return sum(len(expect(g.get("params"), list, path, f"the 'params' of param group {i}"))
               for i, g in enumerate(param_groups(inner.get("param_groups") or [], path)))


def stage_module(tensors: dict[str, LazyTensor], stage_names: list[str], stage: int) -> dict[str, LazyTensor]:
    missing = [n for n in stage_names if n not in tensors]
    if missing:
        raise AmbiguousPatternError(f"--param-names: '{missing[0]}' (stage {stage}) is in no layer file of the "
                                    "checkpoint; check the names (<layer>.<param>, tied_modules.<key>.<param>)")
    return {n: tensors[n] for n in stage_names}


def _shape_in(tensors: dict[str, LazyTensor], name: str, numel: int, path: Path) -> tuple[int, ...]:
    t = tensors.get(name)
    if t is None or t.numel != numel:
        raise CorruptCheckpointError(f"{path}: its optimizer holds {numel} elements of '{name}', which no layer file "
                                     "holds with that size; copy every layer_*-model_states.pt of the checkpoint")
    return t.shape


def layer_tensors(layer_files: list[Path], known: set[str]) -> dict[str, LazyTensor]:
    """Every tensor of the layer files under the name its stage gives it (first file wins for tied copies)."""
    tied_keys = sorted({m.group(1) for n in known if (m := _TIED.match(n))})
    out: dict[str, LazyTensor] = {}
    for path in sorted(layer_files):
        match = LAYER_FILE.match(path.name)
        if match is None:
            raise ValueError(f"{path}: not a layer file")  # callers pass only LAYER_FILE's
        layer = int(match.group(1))
        state = {k: v for k, v in load_dict(path).items() if isinstance(v, LazyTensor)}
        prefix = _layer_prefix(layer, state, known, tied_keys, path)
        for key, t in state.items():
            out.setdefault(prefix + key, t)
    return out


def _layer_prefix(layer: int, state: dict, known: set[str], tied_keys: list[str], path: Path) -> str:
    """How the stage names layer `layer`'s keys: `<layer>.`, or `tied_modules.<key>.` for a tied module."""
    if not state or any(f"{layer}.{k}" in known for k in state):
        return f"{layer}."
    fits = [key for key in tied_keys if all(f"tied_modules.{key}.{k}" in known for k in state)]
    if len(fits) == 1:
        return f"tied_modules.{fits[0]}."
    if not fits:
        return f"{layer}."  # frozen parameters only: the layer's index names them
    raise AmbiguousPatternError(f"{path}: its keys {sorted(state)} fit the tied modules {fits} alike; the layer "
                                "file does not say which module it holds, so its tensors cannot be named")


def _whole_source(name: str, t: LazyTensor, dtype: str = "float32") -> StateSource:
    fragment = whole(t)
    return StateSource(recognize(name, t.shape, [fragment.info]), (fragment,), dtype)
