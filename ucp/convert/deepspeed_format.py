"""`--format deepspeed`: write DeepSpeed's own universal layout, so stock `load_universal` resumes from it.

The layout mirrors what `ds_to_universal` (DeepSpeed 0.19) writes: `zero/<param>/<state>.pt`
(a dict with the full-shape tensor under `param` and the keys `deepspeed_keys` decides; plain
ZeRO-3 without tensor parallelism: the bare flat tensor), a
`zero/optimizer_state.pt` with the optimizer's global state, copies of the model-state files, and
`latest_universal` beside the output folder, written last. The tensors come from the same
Extract → Union → StripPad tasks as the atomic format; only the sink differs. This is the one
module that writes pickles, because that is DeepSpeed's format; it unpickles none (issue #11): the
source's own pickles are parsed with the allow-list reader, so a crafted file cannot run code.
"""
from __future__ import annotations

import importlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ucp.convert.deepspeed_keys import UNIVERSAL_CHECKPOINT_INFO, DeclaredPatterns, declared_patterns, universal_keys
from ucp.convert.executor import Executor, Report
from ucp.convert.result import ConvertResult
from ucp.converters.deepspeed.slices import load_dict
from ucp.converters.torch_zip import Device, DtypeName, LazyTensor, Opaque, read_tensor
from ucp.errors import CorruptCheckpointError, OutputExistsError, UnsupportedLayoutError
from ucp.plan.assemble import materialize_tensor
from ucp.plan.balance import plan_bins
from ucp.plan.plan import BUFFER_STATE, TRAINABLE, WEIGHT_STATE, ConversionPlan, ParamPlan

_EXPERT_FILE = re.compile(r"^layer_\d+_expert_\d+_.*model_states\.pt$")
# DeepSpeed's key names (deepspeed.checkpoint.constants), spelled out so that planning needs no deepspeed.
OPTIMIZER_STATE_DICT = "optimizer_state_dict"
BASE_OPTIMIZER_STATE = "base_optimizer_state"
PARAM_GROUPS = "param_groups"
LOSS_SCALER = "loss_scaler"
# Read by `_load_global_state` (ZeRO-1/2; ZeRO-3 reads the first three) beside the loss scaler.
_GLOBAL_KEYS = ("dynamic_loss_scale", "overflow", "clip_grad", "ds_version")
_LOSS_SCALERS = frozenset({"deepspeed.runtime.fp16.loss_scaler.LossScaler",
                           "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"})


@dataclass(frozen=True)
class SaveBin:
    zero_dir: str
    params: tuple[ParamPlan, ...]
    zero3: bool  # ds_to_universal writes no step.pt for ZeRO-3
    flat: bool  # plain ZeRO-3 (no TP): ds_to_universal writes each state as the bare flat tensor
    untrained: bool  # frozen parameters and buffers too (see write_deepspeed_universal)
    declared: DeclaredPatterns | None  # the source's universal_checkpoint_info, which decides the keys
    strict: bool


def write_deepspeed_universal(plan: ConversionPlan, output: Path, executor: Executor, *,
                              strict: bool = False) -> ConvertResult:
    if plan.source["zero_stage"] == 0:
        raise UnsupportedLayoutError(f"{plan.source['path']}: --format deepspeed needs a ZeRO 1-3 source (stock "
                                     "DeepSpeed has no universal layout for ZeRO-0); convert to the ucp format and "
                                     "resume through ucp.deepspeed instead")
    if output.exists() and any(output.iterdir()):
        raise OutputExistsError(f"{output}: is not empty; choose a new --output directory for the DeepSpeed "
                                "universal checkpoint")
    zero_dir = output / "zero"
    zero_dir.mkdir(parents=True, exist_ok=True)
    zero3 = plan.source["zero_stage"] == 3
    flat = zero3 and int(plan.source.get("tp") or 1) == 1
    declared = declared_patterns(_universal_checkpoint_info(plan))
    bins = plan_bins(plan, executor.workers)
    # ds_to_universal writes frozen parameters and buffers from the `module` of the mp_rank files: ZeRO-3 and
    # pipeline engines keep none there. Stock load_universal restores neither in any case.
    untrained = not zero3 and int(plan.source.get("pp") or 1) == 1
    tasks = [SaveBin(str(zero_dir), tuple(b), zero3, flat, untrained, declared, strict) for b in bins]
    written = executor.map(save_bin, tasks, total_bytes=sum(p.nbytes for p in plan.params), desc="convert")
    aliases = 0 if zero3 else _save_aliases(plan, zero_dir)
    _save_optimizer_state(plan, zero_dir / "optimizer_state.pt", zero3)
    copied = _copy_model_files(plan, output, zero3)
    # `latest_universal` names the folder stock DeepSpeed loads; written last, it is the commit point.
    (output.parent / "latest_universal").write_text(output.name)
    files = sum(w["files"] for w in written) + aliases + copied + 2
    return ConvertResult(output, len(plan.params), tuple(), sum(w["bytes"] for w in written), files_written=files)


def save_bin(task: SaveBin, report: Report) -> dict:
    files = nbytes = 0
    for p in task.params:
        if p.kind != TRAINABLE and not task.untrained:
            report(sum(source.nbytes for source in p.states.values()))
            continue
        folder = Path(task.zero_dir) / p.name
        folder.mkdir(parents=True, exist_ok=True)
        for state, source in p.states.items():
            tensor = materialize_tensor(source, name=p.name, strict=task.strict).float()
            payload: torch.Tensor | dict[str, Any]
            if p.kind != TRAINABLE:
                payload = {"param": tensor}
            elif task.flat:
                payload = tensor.reshape(-1)
            else:  # ZeRO-1/2, and ZeRO-3 under TP, whose loader cuts a TP rank's share only out of this dict
                payload = {"param": tensor, **universal_keys(p.name, task.declared, source.spec)}
            # A buffer's one state is stored as DeepSpeed does for module tensors: fp32.pt.
            torch.save(payload, folder / f"{WEIGHT_STATE if state == BUFFER_STATE else state}.pt")
            files += 1
            nbytes += tensor.numel() * 4
            report(source.nbytes)
        if p.step is not None and not task.zero3:
            torch.save(torch.tensor(p.step, dtype=torch.float32), folder / "step.pt")
            files += 1
    return {"files": files, "bytes": nbytes}


def _save_aliases(plan: ConversionPlan, zero_dir: Path) -> int:
    """ZeRO-1/2: `zero/<alias>/fp32.pt` holding its source's weight, as `ds_to_universal` writes one for every
    module tensor without a folder: from the module's copy, that is the fp32 master rounded to the model's dtype
    (bf16 or fp16 training keeps the module in it). Stock `load_universal` never reads it (an alias is no
    optimizer parameter); ZeRO-3 output has none."""
    for alias, source in plan.aliases.items():
        weight = torch.load(zero_dir / source / f"{WEIGHT_STATE}.pt", weights_only=True)["param"]
        module_dtype = getattr(torch, plan.param(source).model_dtype)
        (zero_dir / alias).mkdir(parents=True, exist_ok=True)
        torch.save({"param": weight.to(module_dtype).float()}, zero_dir / alias / f"{WEIGHT_STATE}.pt")
    return len(plan.aliases)


def _save_optimizer_state(plan: ConversionPlan, path: Path, zero3: bool) -> None:
    """`zero/optimizer_state.pt`: exactly the global state stock `load_universal` reads back.

    The rank-0 file is parsed with the allow-list reader (`torch_zip`), never unpickled: a crafted
    file cannot run code here. ZeRO-1/2 and the bf16 optimizer read `param_groups` and the
    `_load_global_state` fields; ZeRO-3 reads those fields and `optimizer_state_dict` (its
    `param_groups` and each sub-group's `step`).
    """
    rank0 = Path(next(f for f in plan.source_files if "optim_states" in os.path.basename(f)))
    sd = load_dict(rank0).get(OPTIMIZER_STATE_DICT)
    if not isinstance(sd, dict):
        raise CorruptCheckpointError(f"{rank0}: holds no {OPTIMIZER_STATE_DICT}; copy the file again from the "
                                     "training job")
    out = {k: _plain(sd[k], rank0, k) for k in _GLOBAL_KEYS if k in sd}
    if LOSS_SCALER in sd:
        out[LOSS_SCALER] = _loss_scaler(sd[LOSS_SCALER], rank0)
    if zero3:
        inner = _field(sd, OPTIMIZER_STATE_DICT, rank0, dict)
        state = _field(inner, "state", rank0, dict)
        out[OPTIMIZER_STATE_DICT] = {
            "state": {i: {"step": _plain(_field(state, i, rank0, dict).get("step"), rank0, "step")} for i in state},
            PARAM_GROUPS: _plain(_field(inner, PARAM_GROUPS, rank0, list), rank0, PARAM_GROUPS)}
    else:
        base = _field(sd, BASE_OPTIMIZER_STATE, rank0, dict)
        out[PARAM_GROUPS] = _plain(_field(base, PARAM_GROUPS, rank0, list), rank0, PARAM_GROUPS)
    torch.save(out, path)


def _field(sd: dict, key: object, path: Path, kind: type[dict] | type[list]) -> Any:
    """`sd[key]`, which must be a `kind` (as DeepSpeed writes it); else one error naming the file."""
    value = sd.get(key)
    if not isinstance(value, kind):
        raise CorruptCheckpointError(f"{path}: optimizer state has no {key!r} {kind.__name__}; copy the file again "
                                     "from the training job")
    return value


def _plain(value, path: Path, key: str):
    """`value` as plain Python and real tensors (tiny ones: steps, hyper-parameters); any other object
    is refused, so nothing the file names is ever built."""
    if isinstance(value, dict):
        return {k: _plain(v, path, key) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v, path, key) for v in value)
    if isinstance(value, DtypeName):
        return getattr(torch, value)
    if isinstance(value, Device):
        return torch.device(value.type) if value.index is None else torch.device(value.type, value.index)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, LazyTensor):
        return read_tensor(value)
    raise CorruptCheckpointError(f"{path}: optimizer state '{key}' holds {value!r}, which --format deepspeed does "
                                 "not rebuild; convert with --format ucp and resume through ucp.deepspeed")


def _loss_scaler(value, path: Path) -> object:
    """The loss scaler stock `load_universal` installs as is: rebuilt from its pickled fields, for
    DeepSpeed's own scaler classes only (imported from the installed deepspeed)."""
    qualname = getattr(value, "_qualname", None)
    if not isinstance(value, Opaque) or qualname not in _LOSS_SCALERS or not isinstance(value.state, dict):
        raise CorruptCheckpointError(f"{path}: optimizer state '{LOSS_SCALER}' holds {value!r}, not one of "
                                     f"DeepSpeed's loss scalers ({', '.join(sorted(_LOSS_SCALERS))}); copy the "
                                     "file again from the training job")
    module, _, name = qualname.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    scaler = cls.__new__(cls)
    scaler.__dict__.update(_plain(value.state, path, LOSS_SCALER))
    return scaler


def _universal_checkpoint_info(plan: ConversionPlan) -> object:
    """What the source's first model-states file records as `universal_checkpoint_info` (None if nothing),
    parsed with the allow-list reader."""
    folder = Path(plan.source["path"])
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (folder / name).is_file():
            return load_dict(folder / name).get(UNIVERSAL_CHECKPOINT_INFO)
    return None


def _copy_model_files(plan: ConversionPlan, output: Path, zero3: bool) -> int:
    folder = Path(plan.source["path"])
    copied = 0
    for name in sorted(os.listdir(folder)):
        if not name.endswith("model_states.pt") or _EXPERT_FILE.match(name):
            continue
        if not zero3 and not name.startswith("mp_rank_"):
            continue
        shutil.copy2(folder / name, output / name)
        copied += 1
    return copied
