"""The index's optimizer record: which optimizer trained the checkpoint, its states and param groups, and for
the Adam family whether its weight decay was decoupled (AdamW) or an L2 term of the gradient (Adam).

DeepSpeed names its optimizer in the config (`{"optimizer": {"type": "AdamW", "params": {...}}}`). Its own
Adam (`FusedAdam`, `DeepSpeedCPUAdam`) keeps `adam_w_mode` outside the param groups, so the record takes
it from the config as DeepSpeed does: type AdamW, or `adam_w_mode` (default true) for type Adam. A client
optimizer (passed to `deepspeed.initialize(optimizer=...)`, as Accelerate does) is named nowhere in the
checkpoint; torch's own optimizers are told apart by the keys they give their param groups.
"""
from __future__ import annotations

from typing import Any

ADAM_TYPES = ("adam", "adamw")
# Keys every torch.optim.Adam / AdamW param group holds (torch 2.x); `decoupled_weight_decay` (torch >= 2.6)
# tells them apart.
TORCH_ADAM_KEYS = frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad", "maximize"})
TORCH_SGD_KEYS = frozenset({"lr", "momentum", "dampening", "nesterov", "weight_decay"})
UNKNOWN = "unknown"


def optimizer_record(config: dict[str, Any] | None, param_groups: list[dict[str, Any]], states: list[str],
                     client_type: str | None = None) -> dict[str, Any]:
    """The index's `optimizer` for `param_groups` ([{"hyperparams", "params"}]) and `states`, trained by the
    optimizer the DeepSpeed config's `optimizer` section names, else `client_type`, else the torch optimizer
    the param groups' keys show."""
    config = config or {}
    kind = config.get("type") or client_type or client_optimizer_type(param_groups)
    record = {"type": kind, "states": list(states), "param_groups": param_groups}
    mode = adam_w_mode(config, kind, param_groups)
    if mode is not None:
        record["adam_w_mode"] = mode
    return record


def client_optimizer_type(param_groups: list[dict[str, Any]]) -> str:
    """"AdamW", "Adam" or "SGD" where the param groups have the keys torch's optimizer of that name gives them."""
    hyper = param_groups[0]["hyperparams"] if param_groups else {}
    if TORCH_ADAM_KEYS <= hyper.keys() and "decoupled_weight_decay" in hyper:
        return "AdamW" if hyper["decoupled_weight_decay"] else "Adam"
    if TORCH_SGD_KEYS <= hyper.keys():
        return "SGD"
    return UNKNOWN


def adam_w_mode(config: dict[str, Any], kind: str, param_groups: list[dict[str, Any]]) -> bool | None:
    """Whether an Adam-family optimizer decoupled its weight decay; None for another optimizer, or where
    nothing says."""
    if str(kind).lower() not in ADAM_TYPES:
        return None
    hyper = param_groups[0]["hyperparams"] if param_groups else {}
    if "decoupled_weight_decay" in hyper:  # a torch optimizer ran (torch_adam, or a client one)
        return bool(hyper["decoupled_weight_decay"])
    if config.get("type"):  # DeepSpeed's own Adam, as engine._configure_basic_optimizer sets it up
        return str(config["type"]).lower() == "adamw" or bool((config.get("params") or {}).get("adam_w_mode", True))
    return None
