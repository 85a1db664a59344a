"""A tiny Fabric + DeepSpeed loop on CPU (gloo), run under torchrun by tests/integration/test_lightning.py.

    torchrun --nproc_per_node W train_fabric.py --out DIR --stage S [--save-at K] [--load FOLDER]

A fixed global batch (`--global-batch`, cut into W equal batches by Fabric's DistributedSampler, seed 0, epoch set
each epoch); rank 0 appends each step's loss averaged over the ranks to `DIR/losses.jsonl`. `--save-at K` saves
`DIR/step-K.ckpt` with `fabric.save` after step K; `--load` resumes from such a folder with `fabric.load`.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import ucp.lightning
import ucp.lightning.fabric


def stock_strategy(stage: int):
    from lightning.fabric.strategies import DDPStrategy, DeepSpeedStrategy

    class CpuDeepSpeed(DeepSpeedStrategy):
        def setup_environment(self):
            self.parallel_devices = [torch.device("cpu", i) for i in range(len(self.parallel_devices))]
            DDPStrategy.setup_environment(self)

    return CpuDeepSpeed(stage=stage)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--global-batch", type=int, default=6)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--load", default=None)
    p.add_argument("--stock", action="store_true", help="Fabric's own strategy, only its CUDA-only check bypassed")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = stock_strategy(a.stage) if a.stock else ucp.lightning.fabric.DeepSpeedStrategy(stage=a.stage)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(24, 8, generator=g), torch.randn(24, 1, generator=g))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=ucp.lightning.per_process_batch(a.global_batch,
                                                                                                  world), shuffle=True))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if a.load:
        fabric.load(a.load, state)
    a.out.mkdir(parents=True, exist_ok=True)
    step, per_epoch = state["step"], len(loader)
    while step < a.steps:
        epoch = step // per_epoch
        loader.sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(loader):
            if epoch * per_epoch + i < step:
                continue  # the batches of this epoch trained before the checkpoint
            loss = torch.nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            mean = loss.detach().to(torch.float64)
            dist.all_reduce(mean)
            if fabric.global_rank == 0:
                with open(a.out / "losses.jsonl", "a") as f:
                    f.write(json.dumps({"step": step, "loss": mean.item() / world, "world": world}) + "\n")
            if step == a.save_at:
                fabric.save(a.out / f"step-{step}.ckpt", {**state, "step": step})
            if step >= a.steps:
                break
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # outputs are written: skip finalization, where gloo's threads can abort (REFERENCE, exit aborts)


if __name__ == "__main__":
    main()
