"""What rank 0 records of a save besides the tensors, taken with the snapshot on the training thread: the step,
the parameters' records, hyper-parameters, scheduler and client state must be those of the snapshot's step, before
training goes on (`ucp.deepspeed.saving.saver`). The index is built from it once every rank wrote its pieces
(`ucp.deepspeed.saving.index`).
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ucp.deepspeed.engine.autotp import tp_size
from ucp.deepspeed.engine.placement import engine_hmp
from ucp.deepspeed.engine.targets import Target, Zero3Target, module_aliases
from ucp.deepspeed.saving.hmp import source_record as hmp_source
from ucp.deepspeed.saving.layout import mpu_tp_size
from ucp.deepspeed.saving.plan import Holding
from ucp.deepspeed.saving.snapshot import Prepared
from ucp.format import loss_scale
from ucp.format.optimizer import optimizer_record
from ucp.storage.locations import Location

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def metadata(engine: DeepSpeedEngine, target: Target, saving_ranks: int, prepared: Prepared, tag: str,
             tag_dir: Location, client_state: dict[str, Any] | None) -> dict[str, Any]:
    """What the index says besides tensors, taken at snapshot time on rank 0 (`saving_ranks`: the size of the
    group that saves one checkpoint)."""
    groups, group_index = _param_groups(target, prepared.model)
    params = []
    for h in prepared.model:
        group = h.group  # every trainable tensor is in a param group
        params.append({"name": h.name, "shape": h.shape, "kind": h.kind, "states": dict(h.states),
                       "group": group_index[group] if group is not None else None,
                       "step": target.saved_step(group) if group is not None else None,
                       "model_dtype": h.model_dtype})
    config = engine.config if isinstance(engine.config, dict) else {}
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    training = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                "skipped_steps": engine.skipped_steps}
    scaler = loss_scale.live_scaler(engine.optimizer)
    if precision == "fp16" and scaler is not None:
        training["loss_scaler"] = loss_scale.record_live(scaler)
    stages = engine.num_stages if getattr(engine, "pipeline_parallelism", False) else 1
    tp = tp_size(engine) * mpu_tp_size(engine)  # AutoTP's or a Megatron-style mpu's (never both)
    import deepspeed

    hmp = engine_hmp(engine)
    source = hmp_source(hmp) if hmp is not None else {"dp": saving_ranks // (tp * stages), "tp": tp, "pp": stages}
    return {
        "params": params,
        "source": {"framework": "deepspeed", "ds_version": deepspeed.__version__,
                   "zero_stage": engine.zero_optimization_stage(), **source,
                   "precision": precision, "tag": tag, "path": str(tag_dir), "writer": "ucp.deepspeed.save"},
        "training": training,
        "optimizer": optimizer_record(config.get("optimizer"), groups, list(prepared.moments), engine.optimizer_name()),
        "lr_scheduler": _to_json(engine.lr_scheduler.state_dict()) if engine.lr_scheduler is not None else None,
        "client_state": _to_json(client_state or {}),
        "aliases": module_aliases(engine.module),  # what DeepSpeed's own save lists in shared_params
    }


def _param_groups(target: Target, model: Sequence[Holding]) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """The torch param groups as the index records them, and each engine group's index among them: group i
    holds the trainable tensors of `model` (every pipeline stage's) in group i, with this rank's hyper-parameters
    of group i (the stages' optimizers are built from one config).

    ZeRO-3 splits a param group into sub-groups with the same hyper-parameters; like `ucp convert`,
    consecutive sub-groups with equal hyper-parameters are one group again.
    """
    names: dict[int, list[str]] = {}
    for h in model:
        if h.group is not None:
            names.setdefault(h.group, []).append(h.name)
    groups: list[dict[str, Any]] = []
    index = {}
    for i, entry in enumerate(target.optimizer_groups):
        hyper = _to_json({k: v for k, v in entry["group"].items() if k != "params"})
        if isinstance(target, Zero3Target) and groups and groups[-1]["hyperparams"] == hyper:
            groups[-1]["params"] += names.get(i, [])
        else:
            groups.append({"hyperparams": hyper, "params": names.get(i, [])})
        index[i] = len(groups) - 1
    return groups, index


def _to_json(value: object) -> Any:
    """A JSON copy of `value`: tensors as numbers or lists, anything else JSON cannot hold by its repr."""
    def plain(v: object) -> object:
        if torch.is_tensor(v):
            return v.item() if v.dim() == 0 else v.tolist()
        return repr(v)
    return json.loads(json.dumps(value, default=plain))
