"""`--format deepspeed`: write DeepSpeed's own universal layout, so stock `load_universal` resumes from it.

The layout mirrors what `ds_to_universal` (DeepSpeed 0.19) writes: `zero/<param>/<state>.pt`
(ZeRO-1/2: a dict with the full-shape tensor under `param`; ZeRO-3: the flat tensor), a
`zero/optimizer_state.pt` with the optimizer's global state, copies of the model-state files, and
`latest_universal` beside the output folder, written last. The tensors come from the same
Extract → Union → StripPad tasks as the atomic format; only the sink differs. This is the one
module that writes pickles, because that is DeepSpeed's format.
"""
from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from ucp.assemble import materialize
from ucp.convert import ConvertResult, plan_bins
from ucp.errors import OutputExistsError, UnsupportedLayoutError
from ucp.executor import Executor, Report
from ucp.patterns import Pattern, PatternSpec
from ucp.plan import BUFFER_STATE, TRAINABLE, WEIGHT_STATE, ConversionPlan, ParamPlan

_EXPERT_FILE = re.compile(r"^layer_\d+_expert_\d+_.*model_states\.pt$")
_SHARDED_OPTIM_KEYS = {"base_optimizer_state", "param_slice_mappings", "single_partition_of_fp32_groups"}


@dataclass(frozen=True)
class SaveBin:
    zero_dir: str
    params: tuple[ParamPlan, ...]
    zero3: bool
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
    bins = plan_bins(plan, executor.workers)
    tasks = [SaveBin(str(zero_dir), tuple(b), zero3, strict) for b in bins]
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
        folder = Path(task.zero_dir) / p.name
        folder.mkdir(parents=True, exist_ok=True)
        for state, source in p.states.items():
            tensor = materialize(source, name=p.name, strict=task.strict).float()
            if task.zero3 and p.kind == TRAINABLE:
                payload = tensor.reshape(-1)
            else:
                payload = {"param": tensor, **tp_keys(source.spec)} if p.kind == TRAINABLE else {"param": tensor}
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
    module tensor without a folder (from the module's copy: under bf16 the rounded one, here the fp32 master).
    Stock `load_universal` never reads it (an alias is no optimizer parameter); ZeRO-3 output has none."""
    for alias, source in plan.aliases.items():
        weight = torch.load(zero_dir / source / f"{WEIGHT_STATE}.pt", weights_only=True)["param"]
        (zero_dir / alias).mkdir(parents=True, exist_ok=True)
        torch.save({"param": weight}, zero_dir / alias / f"{WEIGHT_STATE}.pt")
    return len(plan.aliases)


def tp_keys(spec: PatternSpec) -> dict:
    """The keys with which `ds_to_universal` tells stock `load_universal` how to cut a full tensor for
    a TP rank: `cat_dim` (the split dim), `vocab_tensor` (padding to restore), and for fused parameters
    `param_n_sub_params` (two equal halves) or `sub_param_shape` (sub-parameter sizes along a dim)."""
    keys: dict = {"cat_dim": 0}
    if spec.flat or spec.dim is None:
        return keys
    keys["cat_dim"] = spec.dim
    if spec.pattern is Pattern.SHARD_NC:
        sizes = tuple(sum(w) for w in spec.sub_widths)
        if len(sizes) == 2 and sizes[0] == sizes[1]:
            keys["param_n_sub_params"] = 2
        else:
            from deepspeed.checkpoint.universal_checkpoint import SubparamShape

            shape = tuple(sizes if d == spec.dim else s for d, s in enumerate(spec.shape))
            keys["sub_param_shape"] = SubparamShape(patterns=[], shape=shape, partition_dim=spec.dim)
    elif spec.padded_size is not None and spec.dim == 0:
        keys["vocab_tensor"] = True
    return keys


def _save_optimizer_state(plan: ConversionPlan, path: Path, zero3: bool) -> None:
    rank0 = next(f for f in plan.source_files if "optim_states" in os.path.basename(f))
    # mmap keeps the shard's big flat tensors on disk: only the small global fields are kept.
    sd = torch.load(rank0, map_location="cpu", mmap=True, weights_only=False)["optimizer_state_dict"]
    if zero3:
        inner = sd["optimizer_state_dict"]
        steps = {i: {"step": s["step"].clone() if torch.is_tensor(s.get("step")) else s.get("step")}
                 for i, s in inner["state"].items()}
        out = {k: v for k, v in sd.items() if k != "fp32_flat_groups"}
        out["optimizer_state_dict"] = {"state": steps, "param_groups": inner["param_groups"]}
        out["param_groups"] = inner["param_groups"]
    else:
        out = {k: v for k, v in sd.items() if k not in _SHARDED_OPTIM_KEYS}
        out["param_groups"] = sd["base_optimizer_state"]["param_groups"]
    torch.save(out, path)


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
