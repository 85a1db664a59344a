"""Reference state for the 3D-parallel training scripts: each rank's full fp32 view of its parameters.

`local_state` asks the live engine for every trainable parameter's fp32 master and Adam moments,
gathered over the data-parallel group that partitions it (ZeRO-1/2 and the bf16 optimizer), as
`deepspeed.utils.safe_get_full_fp32_param` / `safe_get_full_optimizer_state` return them. Under
tensor parallelism that is the rank's TP shard; `dump_states` then collects every rank's entries
on rank 0 so a test can consolidate them by hand.
"""
from __future__ import annotations

import torch

MOMENTS = ("exp_avg", "exp_avg_sq")


def relink(engine) -> None:
    """Re-link optimizer-state fragments (DeepSpeed 0.19 links them before later groups have state)."""
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state") and hasattr(opt, "_hp_optimizer_states_linked"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def local_state(engine, named_params) -> dict[str, dict[str, torch.Tensor]]:
    """{name: {"fp32", "exp_avg", "exp_avg_sq"}} for this rank's trainable parameters (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    relink(engine)
    out = {}
    for name, p in named_params:
        if not p.requires_grad:
            continue
        fp32 = safe_get_full_fp32_param(p)
        if fp32 is None:  # ZeRO-0 fp32: the parameter is the master, its state keyed by the parameter
            entry = {"fp32": p.detach()}
            state = engine.optimizer.state.get(p, {}) if hasattr(engine.optimizer, "state") else {}
            entry.update({k: state[k] for k in MOMENTS if k in state})
        else:
            entry = {"fp32": fp32, **{k: safe_get_full_optimizer_state(p, k) for k in MOMENTS}}
        out[name] = {k: v.detach().float().cpu().reshape(p.shape).clone() for k, v in entry.items() if v is not None}
    return out


def dump_states(path: str, per_rank: dict, extra: dict | None = None) -> None:
    """Gather every rank's `per_rank` dict on rank 0 and save `{"ranks": [...], **extra}` to `path`."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_rank)
    if dist.get_rank() == 0:
        torch.save({"ranks": gathered, **(extra or {})}, path)
