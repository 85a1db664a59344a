#!/usr/bin/env python
"""Load two checkpoints into one tiny engine (train_tiny.py's model and config) and compare what each
rank holds after each: every module tensor (ZeRO-3: the rank's partition), flat fp32 partition and
optimizer state tensor, with torch.equal; plus global steps, LR scheduler and client state.

Launched with ``torchrun --nproc_per_node N compare_loads.py --stage S [--dtype D] --first A --second B
--out OUT [--check-keep-bytes K]``. Before the second load the engine goes back to what it was when fresh: every
tensor to what it held, and the optimizer states the first load created are removed (a fresh engine has none),
so the second load is a resume into a fresh engine too, and what it does not write compares unequal (or
missing) wherever the first load changed it (alignment padding of flat partitions neither load writes stays as
it was). Rank 0 writes, by rank: ``{"names", "equal" (per tensor),
"fresh_equal" (per tensor: the first load left it as the fresh engine had it), "meta_equal",
"stats" (ucp.deepspeed.LoadStats of both loads, less client state)}``.
"""
import argparse
import json
import os

import torch

from train_tiny import TinyModel, ds_config


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--optimizer", default="AdamW")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--first", required=True)
    p.add_argument("--second", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--check-keep-bytes", type=int, default=None, help="ucp.deepspeed.load's check_keep_bytes")
    args = p.parse_args()
    args.load_universal = False
    return args


def rank_tensors(engine) -> dict[str, torch.Tensor]:
    """Every live tensor this rank holds for the model and its optimizer, by a stable name."""
    out = {}
    for name, p in engine.module.named_parameters():
        out[f"module.{name}"] = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
    for name, b in engine.module.named_buffers():
        out[f"buffer.{name}"] = b
    zero = engine.optimizer
    for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp16_partitioned_groups_flat"):
        for g, flat in enumerate(getattr(zero, attr, [])):
            out[f"{attr}.{g}"] = flat.data
    inner = getattr(zero, "optimizer", zero)
    for g, group in enumerate(inner.param_groups):
        for i, p in enumerate(group["params"]):
            for key, value in inner.state.get(p, {}).items():
                if torch.is_tensor(value):
                    out[f"state.{g}.{i}.{key}"] = value
    return out


def snapshot(engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in rank_tensors(engine).items()}


def meta(engine, client_state: dict) -> dict:
    return {"global_steps": engine.global_steps, "lr_scheduler": engine.lr_scheduler.state_dict(),
            "client_state": client_state}


def stats_of(engine) -> dict:
    return {k: v for k, v in vars(engine.ucp_load_stats).items() if k != "client_state"}


def main():
    args = parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    import ucp.deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    model = TinyModel()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.param_groups(),
                                      config=ds_config(args, dist.get_world_size()))
    fresh = snapshot(engine)
    keep = {} if args.check_keep_bytes is None else {"check_keep_bytes": args.check_keep_bytes}
    first_meta = meta(engine, ucp.deepspeed.load(engine, args.first, **keep))
    first, first_stats = snapshot(engine), stats_of(engine)
    for name, t in rank_tensors(engine).items():
        if name in fresh:
            t.copy_(fresh[name])
    if not any(name.startswith("state.") for name in fresh):  # the fresh engine held no optimizer state
        getattr(engine.optimizer, "optimizer", engine.optimizer).state.clear()
    second_meta = meta(engine, ucp.deepspeed.load(engine, args.second, **keep))
    second = snapshot(engine)
    result = {"names": list(first), "equal": [k in second and torch.equal(first[k], second[k]) for k in first],
              "fresh_equal": [k in fresh and torch.equal(first[k], fresh[k]) for k in first],
              "meta_equal": json.dumps(first_meta, sort_keys=True, default=str)
              == json.dumps(second_meta, sort_keys=True, default=str),
              "stats": [first_stats, stats_of(engine)]}
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, result)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(found, f)
    dist.barrier()
    engine.destroy()
    dist.destroy_process_group()


if __name__ == "__main__":
    import ucp.deepspeed
    main()
    ucp.deepspeed.finish()
