"""Plan the conversion of a DeepSpeed ZeRO checkpoint (stages 1, 2, 3; fp32, fp16, bf16).

Only metadata is read here: the pickles of every rank file are parsed lazily (see `torch_zip`),
and every parameter state becomes a list of fragments with absolute byte offsets. Layouts, as
written by DeepSpeed 0.19:

* ZeRO-1/2: `mp_rank_00_model_states.pt` holds `param_shapes` (per param group, in flat order),
  buffers and frozen parameters; `[bf16_]zero_pp_rank_{d}_mp_rank_00_optim_states.pt` holds rank
  d's flat fp32 partition per group, the Adam moments over the same partition, and
  `param_slice_mappings` (name -> numel, start within the partition).
* ZeRO-3: every parameter is partitioned on its own (see `deepspeed_zero3`); frozen parameters
  are partitioned the same way in the model files.
"""
from __future__ import annotations

import functools
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ucp import loss_scale
from ucp.converters.deepspeed_slices import dtype_name, load_dict, read_slice, tied_aliases, whole
from ucp.converters.deepspeed_zero0 import zero0_trainable
from ucp.converters.deepspeed_zero3 import read_zero3_slice, zero3_model_files
from ucp.converters.torch_zip import LazyTensor, as_python
from ucp.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedLayoutError
from ucp.patterns.recognize import recognize
from ucp.plan import (BUFFER, BUFFER_STATE, FROZEN, TRAINABLE, WEIGHT_STATE, ConversionPlan, Fragment, ParamPlan,
                      StateSource)
from ucp.trainer_folders import CHECKPOINT_RE, checkpoint_folders, folder_names, side_files

logger = logging.getLogger("ucp.input")

_MODEL_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "shared_params", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info",
}
_OPTIM_FILE = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_FILE = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")


@dataclass(frozen=True)
class TagDir:
    save_dir: Path
    tag: str

    @property
    def path(self) -> Path:
        return self.save_dir / self.tag


def resolve_tag(input_dir: str | os.PathLike, tag: str | None = None) -> TagDir:
    """The tag folder `engine.save_checkpoint` wrote: `input_dir/<tag or latest>`, or `input_dir` itself.

    A Hugging Face Trainer `output_dir` (`checkpoint-N` folders, no `latest`) stands for its last
    `checkpoint-N`, picked as transformers' `get_last_checkpoint` picks it (logged), and a
    `checkpoint-N` tag for that folder; each is a save directory with its own `latest`.
    """
    root = Path(input_dir)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"{root}: no such directory; pass the directory given to "
                                      "engine.save_checkpoint, or one of its tag folders")
    if tag is None and any(root.glob("*model_states.pt")):
        return TagDir(root.parent, root.name)
    folders = checkpoint_folders(root)
    if tag is not None and folders and CHECKPOINT_RE.search(tag):
        if not (root / tag).is_dir():
            raise CheckpointNotFoundError(f"{root / tag}: no such checkpoint folder; pass --tag with one of "
                                          f"{folder_names(folders)}")
        return _trainer_checkpoint(root / tag, folders)
    if tag is None:
        latest = root / "latest"
        if folders and not latest.is_file():
            logger.info("%s: using %s, the last of %s", root, folders[-1].name, folder_names(folders))
            return _trainer_checkpoint(folders[-1], folders)
        if not latest.is_file():
            raise CheckpointNotFoundError(f"{root}: no 'latest' file, no model-states files and no checkpoint-N "
                                          f"folders here; pass --tag (tags present: {_tags(root) or 'none'})")
        tag = latest.read_text().strip()
    if not (root / tag).is_dir():
        trainer = f"; checkpoint folders present: {folder_names(folders)}" if folders else ""
        raise CheckpointNotFoundError(f"{root / tag}: tag '{tag}' does not exist; "
                                      f"tags present: {_tags(root) or 'none'}{trainer}")
    return TagDir(root, tag)


def _trainer_checkpoint(folder: Path, folders: list[Path]) -> TagDir:
    """The DeepSpeed checkpoint inside a Trainer's `checkpoint-N` folder, through its `latest`."""
    latest = folder / "latest"
    if not latest.is_file():
        raise CheckpointNotFoundError(f"{folder}: no 'latest' file, so no finished DeepSpeed checkpoint; pass --tag "
                                      f"with another of {folder_names(folders)}")
    tag = latest.read_text().strip()
    if not (folder / tag).is_dir():
        raise CheckpointNotFoundError(f"{folder / tag}: named by {latest} but missing; pass --tag with another "
                                      f"of {folder_names(folders)}")
    return TagDir(folder, tag)


def _tags(root: Path) -> str:
    return ", ".join(sorted(p.name for p in root.iterdir() if p.is_dir() and any(p.glob("*model_states.pt"))))


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
    optim = _rank_files(folder, names, _OPTIM_FILE)
    zero3_models = zero3_model_files(folder, names)
    models = sorted(n for n in names if _MODEL_FILE.match(n))
    if not optim and not models and not zero3_models:
        raise CheckpointNotFoundError(f"{folder}: no DeepSpeed model-states files; is this a checkpoint tag folder?")
    family = _parallel_family(folder, names, patterns or {}, param_names)
    if family is not None:
        return family(where, names)
    if any(m != 0 for (_, m) in list(optim) + list(zero3_models)) or len(models) > 1:
        raise UnsupportedLayoutError(f"{folder}: tensor/pipeline-parallel checkpoints (several mp_rank files) "
                                     "are not supported by this converter yet")
    if zero3_models:
        return _plan_zero3(where, zero3_models, optim)
    if not models:
        raise CheckpointNotFoundError(f"{folder}: mp_rank_00_model_states.pt is missing; copy it from the "
                                      "training job's checkpoint directory")
    model_path = folder / models[0]
    model = load_dict(model_path)
    if not optim:
        return _plan_zero0(where, model_path, model, param_names)
    return _plan_zero12(where, model_path, model, optim)


def _parallel_family(folder: Path, names: list[str], patterns: dict[str, str], param_names: list[str] | None):
    """The planner of a tensor x pipeline, pipeline, tensor-parallel or MoE layout, or None for plain ZeRO.

    Imported here, not at the top: those planners build on this module's `finish_plan`.
    """
    from ucp.converters.deepspeed_megatron import is_tensor_pipeline, plan_megatron
    from ucp.converters.deepspeed_moe import is_moe, plan_moe
    from ucp.converters.deepspeed_pipe import is_pipeline, plan_pipe
    from ucp.converters.deepspeed_tp import is_tensor_parallel, plan_tp

    if is_tensor_pipeline(names):
        return functools.partial(plan_megatron, patterns=patterns)
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


def _rank_files(folder: Path, names: list[str], pattern: re.Pattern) -> dict[tuple[int, int], Path]:
    found = {}
    for n in names:
        m = pattern.match(n)
        if m:
            dp, mp = int(m.group(m.lastindex - 1)), int(m.group(m.lastindex))
            found[(dp, mp)] = folder / n
    return found


def _state_source(name: str, shape: tuple[int, ...], fragments: list[Fragment], dtype: str = "float32") -> StateSource:
    spec = recognize(name, shape, [f.info for f in fragments])
    return StateSource(spec, tuple(sorted(fragments, key=lambda f: f.info.rank)), dtype)


def _plan_zero12(where: TagDir, model_path: Path, model: dict, optim_files: dict) -> ConversionPlan:
    part = read_slice(where.path, 0, model_path, model, optim_files)
    module = model.get("module") or {}
    params = []
    for name, shape in part.shapes.items():
        states = {}
        for state_name in part.states():
            frags = part.fragments.get((name, state_name))
            if frags:
                states[state_name] = _state_source(name, shape, frags)
        if WEIGHT_STATE not in states:
            # ZeRO keeps no optimizer fragment for a parameter that never received a gradient;
            # its value is still in the module (as DeepSpeed's own converter falls back to).
            states[WEIGHT_STATE] = _module_state(name, shape, module, model_path)
        group = part.group_of[name]
        params.append(ParamPlan(name, shape, TRAINABLE, states, group, part.steps.get(group),
                                _module_dtype(module, name)))
    params += frozen_and_buffers(model, model_path, set(part.shapes))
    return finish_plan(where, model, params, part.hyper, part.moment_names, part.stage, part.dp,
                   list(part.optim_paths) + [model_path], part.loss_scaler)


def _plan_zero3(where: TagDir, model_files: dict, optim_files: dict) -> ConversionPlan:
    part = read_zero3_slice(where.path, 0, model_files, optim_files)
    module = part.model.get("module") or {}
    params = []
    for name, shape in part.shapes.items():
        states = {s: _state_source(name, shape, part.fragments[(name, s)]) for s in part.states()
                  if (name, s) in part.fragments}
        group = part.group_of[name]
        params.append(ParamPlan(name, shape, TRAINABLE, states, group, part.steps.get(group),
                                _module_dtype(module, name)))
    for name, (shape, frags) in part.frozen.items():
        params.append(ParamPlan(name, shape, FROZEN, {WEIGHT_STATE: _state_source(name, shape, frags)},
                                model_dtype=_module_dtype(module, name)))
    params += _buffers(part.model, part.model_path)
    return finish_plan(where, part.model, params, part.hyper, part.moment_names, part.stage, part.dp,
                       part.files(), part.loss_scaler)


def _plan_zero0(where: TagDir, model_path: Path, model: dict, param_names: list[str] | None) -> ConversionPlan:
    params, hyper, moment_names = zero0_trainable(model, model_path, param_names)
    params += frozen_and_buffers(model, model_path, {p.name for p in params})
    dp = int(model.get("dp_world_size") or 1)
    return finish_plan(where, model, params, hyper, moment_names, 0, dp, [model_path], model.get("optimizer"))


def _module_dtype(module: dict, name: str) -> str:
    t = module.get(name)
    return dtype_name(t) if isinstance(t, LazyTensor) else "float32"


def _module_state(name: str, shape: tuple[int, ...], module: dict, path: Path) -> StateSource:
    t = module.get(name)
    if not isinstance(t, LazyTensor) or t.shape != shape:
        raise CorruptCheckpointError(f"{path}: parameter '{name}' has no optimizer state and no full value in "
                                     "the module state; the checkpoint is incomplete")
    return _state_source(name, shape, [whole(t)])


def frozen_and_buffers(model: dict, path: Path, trainable: set[str]) -> list[ParamPlan]:
    """The module's other tensors: frozen parameters and buffers (a tied weight's alias is neither)."""
    module = model.get("module") or {}
    skip = trainable | set(model.get("buffer_names") or []) | set(tied_aliases(model))
    frozen = []
    for name, t in module.items():
        if name in skip or not isinstance(t, LazyTensor):
            continue
        frozen.append(ParamPlan(name, t.shape, FROZEN, {WEIGHT_STATE: _state_source(name, t.shape, [whole(t)])},
                                model_dtype=dtype_name(t)))
    return frozen + _buffers(model, path)


def _buffers(model: dict, path: Path) -> list[ParamPlan]:
    module = model.get("module") or {}
    out = []
    for name in model.get("buffer_names") or []:
        t = module.get(name)
        if not isinstance(t, LazyTensor):
            continue  # non-persistent buffers are not in the state dict
        out.append(ParamPlan(name, t.shape, BUFFER,
                             {BUFFER_STATE: _state_source(name, t.shape, [whole(t)], dtype_name(t))},
                             model_dtype=dtype_name(t)))
    return out


def finish_plan(where: TagDir, model: dict, params: list[ParamPlan], hyper, moment_names: list[str], stage, dp: int,
            files: list[Path], scaler=None, parallel: dict | None = None) -> ConversionPlan:
    config = model.get("ds_config") or {}
    optimizer_cfg = config.get("optimizer") or {}
    groups = []
    for g, hp in enumerate(hyper or []):
        hp = {k: as_python(v) for k, v in hp.items() if k != "params"}
        groups.append({"hyperparams": hp, "params": [p.name for p in params if p.kind == TRAINABLE and p.group == g]})
    precision = "bf16" if (config.get("bf16") or {}).get("enabled") else (
        "fp16" if (config.get("fp16") or {}).get("enabled") else "fp32")
    source = {
        "framework": "deepspeed", "ds_version": as_python(model.get("ds_version")), "zero_stage": stage,
        "dp": dp, "tp": 1, "pp": 1, "precision": precision, "tag": where.tag,
        "path": str(where.path.resolve()), **(parallel or {}),
    }
    training = {k: as_python(model.get(k)) for k in ("global_steps", "global_samples", "skipped_steps")
                if model.get(k) is not None}
    if precision == "fp16" and scaler is not None:
        state = as_python(scaler)  # a pickled LossScaler's attributes, or a ZeRO-0 optimizer dict
        training["loss_scaler"] = loss_scale.record_of(state) if isinstance(state, dict) else {}
    client = {k: as_python(v) for k, v in model.items() if k not in _MODEL_KEYS}
    optimizer = {"type": optimizer_cfg.get("type", "unknown"), "states": moment_names, "param_groups": groups}
    side = side_files(where.save_dir)  # a Trainer's config, tokenizer and trainer_state files
    return ConversionPlan(params=params, source=source, optimizer=optimizer, training=training,
                          lr_scheduler=as_python(model.get("lr_scheduler")), client_state=client,
                          source_files=[str(f) for f in files],
                          extra_files={name: str(path) for name, path in side.carried.items()}, left_out=side.left,
                          aliases=plan_aliases(model, params, where.path))


def plan_aliases(model: dict, params: list[ParamPlan], folder: Path) -> dict[str, str]:
    """The tied aliases of `model` (see `tied_aliases`), each naming a parameter of the plan, none one itself."""
    names = {p.name for p in params}
    found = tied_aliases(model)
    for alias, source in found.items():
        if alias in names:
            raise CorruptCheckpointError(f"{folder}: '{alias}' is a tied alias of '{source}' (shared_params) but also "
                                         "a parameter of its own; files from different runs are mixed")
        if source not in names:
            raise CorruptCheckpointError(f"{folder}: the tied alias '{alias}' names '{source}', which the checkpoint "
                                         "does not hold; files from different runs are mixed")
    return found
