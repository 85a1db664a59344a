"""What every family's plan shares: the module's frozen parameters and buffers, tied aliases, and the
plan's record of its source, optimizer and training counters."""
from __future__ import annotations

from pathlib import Path

from ucp.converters.deepspeed.slices import dtype_name, tied_aliases, whole
from ucp.converters.tag_folder import TagDir
from ucp.converters.torch_zip import LazyTensor, as_python
from ucp.converters.trainer_folders import side_files
from ucp.errors import CorruptCheckpointError
from ucp.format import loss_scale
from ucp.format.index import NotSaved
from ucp.format.optimizer import optimizer_record
from ucp.patterns.recognize import recognize
from ucp.plan.plan import (
    BUFFER,
    BUFFER_STATE,
    FROZEN,
    TRAINABLE,
    WEIGHT_STATE,
    ConversionPlan,
    Fragment,
    ParamPlan,
    StateSource,
)

# Why a checkpoint lacks its frozen parameters: DeepSpeed's save_checkpoint argument that left them out.
EXCLUDE_FROZEN = "exclude_frozen_parameters"
_MODEL_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "shared_params", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
    "ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info",
    "num_experts", "ds_autoep_layers",  # what an MoE engine's save adds (not client state)
}


def state_source(name: str, shape: tuple[int, ...], fragments: list[Fragment], dtype: str = "float32") -> StateSource:
    spec = recognize(name, shape, [f.info for f in fragments])
    return StateSource(spec, tuple(sorted(fragments, key=lambda f: f.info.rank)), dtype)


def module_dtype(module: dict, name: str) -> str:
    t = module.get(name)
    return dtype_name(t) if isinstance(t, LazyTensor) else "float32"


def module_state(name: str, shape: tuple[int, ...], module: dict, path: Path) -> StateSource:
    t = module.get(name)
    if not isinstance(t, LazyTensor) or t.shape != shape:
        raise CorruptCheckpointError(f"{path}: parameter '{name}' has no optimizer state and no full value in "
                                     "the module state; the checkpoint is incomplete")
    return state_source(name, shape, [whole(t)])


def frozen_and_buffers(model: dict, path: Path, trainable: set[str]) -> list[ParamPlan]:
    """The module's other tensors: frozen parameters and buffers (a tied weight's alias is neither)."""
    module = model.get("module") or {}
    skip = trainable | set(model.get("buffer_names") or []) | set(tied_aliases(model))
    frozen = []
    for name, t in module.items():
        if name in skip or not isinstance(t, LazyTensor):
            continue
        frozen.append(ParamPlan(name, t.shape, FROZEN, {WEIGHT_STATE: state_source(name, t.shape, [whole(t)])},
                                model_dtype=dtype_name(t)))
    return frozen + buffers(model, path)


def buffers(model: dict, path: Path) -> list[ParamPlan]:
    module = model.get("module") or {}
    out = []
    for name in model.get("buffer_names") or []:
        t = module.get(name)
        if not isinstance(t, LazyTensor):
            continue  # non-persistent buffers are not in the state dict
        out.append(ParamPlan(name, t.shape, BUFFER,
                             {BUFFER_STATE: state_source(name, t.shape, [whole(t)], dtype_name(t))},
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
    optimizer = optimizer_record(optimizer_cfg, groups, moment_names)
    side = side_files(where.save_dir, model.get("lr_scheduler") is not None)  # a Trainer's or Accelerate's files
    not_saved = unsaved_frozen(model, params, stage)
    return ConversionPlan(params=params, source=source, optimizer=optimizer, training=training,
                          lr_scheduler=as_python(model.get("lr_scheduler")), client_state=client,
                          source_files=[str(f) for f in files],
                          extra_files={name: str(path) for name, path in side.carried.items()}, left_out=side.left,
                          aliases=plan_aliases(model, params, where.path, not_saved), not_saved=not_saved)


def unsaved_frozen(model: dict, params: list[ParamPlan], stage) -> NotSaved | None:
    """The record of frozen parameters left out by `save_checkpoint(exclude_frozen_parameters=True)` (the
    Trainer saves a PEFT model so), where the model-states file shows it; None where it does not.

    DeepSpeed records no name of a parameter it leaves out. It shows in two ways: under ZeRO-2/3 the file
    holds `frozen_param_shapes` (an empty dict when nothing is frozen) unless frozen parameters were
    excluded; and the module state dict, which holds every parameter's name otherwise, lacks the first
    name of a tied pair that `shared_params` lists. Its second name stays in the module state dict
    (`named_parameters`, which DeepSpeed deletes by, lists a tied weight once) and is left out too.
    """
    module = model.get("module") or {}
    held = {p.name for p in params}
    pairs = {str(a): str(s) for a, s in (model.get("shared_params") or {}).items()}
    unsaved_pairs = {a: s for a, s in pairs.items() if module and s not in held and s not in module}
    unrecorded = isinstance(stage, int) and stage >= 2 and "frozen_param_shapes" in model \
        and model["frozen_param_shapes"] is None
    if not unsaved_pairs and not unrecorded:
        return None
    names = [n for a, s in unsaved_pairs.items() for n in (s, a)]
    return NotSaved(FROZEN, EXCLUDE_FROZEN, tuple(dict.fromkeys(names)))


def plan_aliases(model: dict, params: list[ParamPlan], folder: Path,
                 not_saved: NotSaved | None = None) -> dict[str, str]:
    """The tied aliases of `model` (see `tied_aliases`), each naming a parameter of the plan, none one itself.
    A tied pair left out as frozen (`not_saved`) is no alias: neither name is held."""
    names = {p.name for p in params}
    left_out = set(not_saved.names) if not_saved is not None else set()
    found = {a: s for a, s in tied_aliases(model).items() if a not in left_out}
    for alias, source in found.items():
        if alias in names:
            raise CorruptCheckpointError(f"{folder}: '{alias}' is a tied alias of '{source}' (shared_params) but also "
                                         "a parameter of its own; files from different runs are mixed")
        if source not in names:
            raise CorruptCheckpointError(f"{folder}: the tied alias '{alias}' names '{source}', which the checkpoint "
                                         "does not hold; files from different runs are mixed")
    return found
