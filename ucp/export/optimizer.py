"""The param groups of a DCP export, keyed for the optimizer class the loading job runs (`--optimizer`).

`dcp.load` fills exactly the keys of the state dict it is given, and `get_optimizer_state_dict` of a torch
optimizer lists every key of its param groups, so the export must hold each of them. DeepSpeed's own Adam
(`FusedAdam`, `DeepSpeedCPUAdam`) keeps other keys (`bias_correction`, a group `step`) and keeps
`adam_w_mode` outside its groups. Both compute the same update as torch's Adam and AdamW when bias
correction is on; this module writes the groups under the target class's keys, from the checkpoint's
hyper-parameters and the record of its weight-decay mode (`ucp.format.optimizer`), and refuses, naming
the key, where the update would differ. The target's other keys (`foreach`, `fused`, `capturable`,
`differentiable`: how torch computes the update, not what) take the class's defaults; keys of the source
that the target lacks stay in the export, where `dcp.load` ignores them.
"""
from __future__ import annotations

import torch

from ucp.errors import ExportError
from ucp.format.optimizer import ADAM_TYPES

TARGETS = {"torch.optim.AdamW": torch.optim.AdamW, "torch.optim.Adam": torch.optim.Adam}
SAVED = "saved"  # the param groups as the checkpoint holds them
CHOICES = (*TARGETS, SAVED)


def default_target(optimizer: dict | None) -> str:
    """torch.optim.AdamW for an Adam-family optimizer, else the param groups as saved."""
    return "torch.optim.AdamW" if is_adam(optimizer) else SAVED


def is_adam(optimizer: dict | None) -> bool:
    return optimizer is not None and str(optimizer.get("type")).lower() in ADAM_TYPES


def export_groups(optimizer: dict, target: str, where: str) -> list[dict]:
    """`optimizer`'s param groups (the index's record) as the optimizer `target` holds them, with `params`
    as name lists; `where` (the checkpoint) names the source in errors."""
    if target == SAVED:
        return [{**g["hyperparams"], "params": list(g["params"])} for g in optimizer["param_groups"]]
    if target not in TARGETS:
        raise ExportError(f"--optimizer {target}: choose one of {', '.join(CHOICES)}")
    if not is_adam(optimizer):
        raise ExportError(f"{where}: trained with optimizer {optimizer.get('type')}, whose state {target} cannot "
                          f"take; export with --optimizer {SAVED} and load into the optimizer that trained it")
    defaults = _defaults(TARGETS[target])
    return [{**_torch_keys(g["hyperparams"], optimizer, target, defaults, where), "params": list(g["params"])}
            for g in optimizer["param_groups"]]


def _torch_keys(hyper: dict, optimizer: dict, target: str, defaults: dict, where: str) -> dict:
    if hyper.get("bias_correction", True) is False:
        raise ExportError(f"{where}: bias_correction is false (DeepSpeed's Adam ran without bias correction), and "
                          f"{target} always corrects; export with --optimizer {SAVED} and load into the optimizer "
                          "that trained it")
    decoupled = optimizer.get("adam_w_mode")
    weight_decay = hyper.get("weight_decay", 0) or 0
    if decoupled is None and weight_decay:
        raise ExportError(f"{where}: the checkpoint does not record adam_w_mode (whether weight decay was decoupled) "
                          "and weight_decay is not 0; convert the checkpoint again with this ucp")
    if target == "torch.optim.AdamW" and weight_decay and not decoupled:
        raise ExportError(f"{where}: adam_w_mode is false with weight_decay {weight_decay}: DeepSpeed ran Adam with "
                          "L2 weight decay, which torch.optim.AdamW does not compute; export with --optimizer "
                          "torch.optim.Adam")
    out = {**hyper, **{key: hyper.get(key, default) for key, default in defaults.items()}}
    if "decoupled_weight_decay" in defaults:  # torch >= 2.6; before, Adam is L2 and AdamW decoupled
        out["decoupled_weight_decay"] = bool(decoupled) if weight_decay else defaults["decoupled_weight_decay"]
    elif weight_decay and decoupled and target == "torch.optim.Adam":
        raise ExportError(f"{where}: adam_w_mode is true with weight_decay {weight_decay}, which this torch's "
                          "torch.optim.Adam does not compute; export with --optimizer torch.optim.AdamW")
    return out


def _defaults(cls) -> dict:
    """The keys (and default values) `cls` gives each of its param groups, in the torch installed here."""
    return dict(cls([torch.nn.Parameter(torch.zeros(1))]).defaults)
