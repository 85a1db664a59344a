#!/usr/bin/env python
"""Resume a DCP export (`ucp export --to dcp`) in an FSDP2 job and train on, for the export tests.

Launched with ``torchrun --nproc_per_node N tests/support/fsdp2_resume.py --dcp DIR --config DIR
--from-step S --steps K --out JSON``: builds the model from ``config.json`` (eager attention, as the
DeepSpeed run trained), shards every decoder layer and the root with ``fully_shard`` on a CPU device
mesh (gloo), loads model and optimizer with ``dcp.load`` then ``set_model_state_dict`` /
``set_optimizer_state_dict``, and trains steps S .. S+K-1 on the batches of train_hf_model.py.
Rank 0 writes ``{"losses": [...], "fresh_losses": [...]}``: the resumed run's global losses, and
(negative control) those of the same job from a freshly initialised model that loads nothing.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from train_hf_model import OPTIMIZER, build_model, load_dcp, rows


def build(config_dir: str):
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(config_dir, attn_implementation="eager")
    model = build_model(config)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = OPTIMIZER["params"]
    optimizer = torch.optim.AdamW(model.parameters(), lr=params["lr"], betas=params["betas"], eps=params["eps"],
                                  weight_decay=params["weight_decay"])
    return model, optimizer


def train(model, optimizer, start: int, steps: int) -> list[float]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in range(start, start + steps):
        ids = rows(step, model.config.vocab_size, rank, world)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dcp", required=True)
    p.add_argument("--config", required=True, help="folder holding the model's config.json")
    p.add_argument("--from-step", type=int, required=True, help="the first step's batch")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    model, optimizer = build(args.config)
    load_dcp(model, optimizer, args.dcp)
    losses = train(model, optimizer, args.from_step, args.steps)
    model, optimizer = build(args.config)
    fresh = train(model, optimizer, args.from_step, args.steps)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"losses": losses, "fresh_losses": fresh, "world_size": int(os.environ["WORLD_SIZE"])}, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(main())
