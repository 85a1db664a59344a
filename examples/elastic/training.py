"""The training function of the elastic examples: a standard DeepSpeed loop that continues the same run at any
world size. torchrun (`torchrun/train.py`) and Ray Train (`ray/train.py`) both run it as it is.

The only lines that differ from a stock DeepSpeed loop are marked "ucp":
* the config's `"ucp"` section: resume from the newest committed checkpoint or start fresh, save every step
  asynchronously and keep the newest 3, and share a fixed global batch over whatever world size this is;
* `ucp.deepspeed.initialize` in place of `deepspeed.initialize`;
* `ElasticBatchSampler` in place of a `DistributedSampler`, and its `loss_weight` on the loss.
"""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import ucp.deepspeed
from ucp.elastic import ElasticBatchSampler


@dataclass
class Run:
    save_dir: str
    steps: int = 16
    stage: int = 1
    global_batch: int = 10
    micro_batch: int = 2
    every: int = 1
    keep: int = 3
    losses_out: str | None = None   # a JSON line per step from rank 0: step, loss, world size
    stock: bool = False             # negative control: DistributedSampler and per-rank batch keys, no "elastic"
    ucp: dict | None = None         # the "ucp" section's load and save keys, when a launcher gives them (Ray Train)
    memory: dict | None = None      # the save section's "memory" tier: {"every": k, "replicas": r, "dir": ...}
    detect_s: float | None = None   # ucp.elastic.run: how long a rank may be silent before it is taken for hung
    after_step: Callable[[object, float], None] = field(default=lambda engine, loss: None)  # (engine, mean loss)


class Regression(Dataset):
    """A fixed synthetic regression task: 40 samples of 16 features."""

    def __init__(self, n: int = 40, dim: int = 16):
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x @ torch.randn(dim, 1, generator=g)).tanh() + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


def model() -> torch.nn.Module:
    torch.manual_seed(0)  # no dropout: every draw of the run is in the data order and the initial weights
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                               torch.nn.Linear(64, 1))


def deepspeed_config(run: Run) -> dict:
    config = {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-2}},
        "zero_optimization": {"stage": run.stage}, "steps_per_print": 10 ** 9,
        "ucp": run.ucp or {"load": "auto", "save": {"dir": run.save_dir, "every": run.every, "keep": run.keep}},  # ucp
    }
    if run.memory is not None:
        config["ucp"]["save"]["memory"] = run.memory                                                    # ucp
    if run.stock:
        world = dist.get_world_size()
        config.update(train_micro_batch_size_per_gpu=-(-run.global_batch // world), gradient_accumulation_steps=1)
    else:
        config["ucp"]["elastic"] = {"global_batch": run.global_batch, "micro_batch": run.micro_batch}    # ucp
        if run.detect_s is not None:
            config["ucp"]["elastic"]["detect_s"] = run.detect_s                                           # ucp
    return config


def train(run: Run) -> None:
    """Train until `run.steps` optimizer steps, from wherever the save folder says the run is."""
    dataset = Regression()
    net = model()
    engine, *_ = ucp.deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                          config=deepspeed_config(run))                                # ucp
    if run.stock:
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=0)
        loader, weight = DataLoader(dataset, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler), None
    else:
        sampler = ElasticBatchSampler(dataset, engine, shuffle=True, seed=0)                            # ucp
        loader, weight = DataLoader(dataset, batch_sampler=sampler), sampler.loss_weight
    epoch = 0
    while engine.global_steps < run.steps:
        if run.stock:
            sampler.set_epoch(epoch)
        summed = torch.zeros(1)  # sum over this rank's samples of the step, for the logged mean
        for batch in loader:
            loss = torch.nn.functional.mse_loss(engine(batch["x"]), batch["y"])   # mean over the micro-batch
            k = len(batch["x"])
            engine.backward(loss * weight(k) if weight else loss)                                        # ucp
            summed += loss.detach() * k
            step = engine.global_steps
            engine.step()
            if engine.global_steps != step:
                run.after_step(engine, _log(run, engine, summed))
                summed = torch.zeros(1)
                if engine.global_steps >= run.steps:
                    break
        epoch += 1
    ucp.deepspeed.wait(engine)  # the last save is committed


def _log(run: Run, engine, summed: torch.Tensor) -> float:
    """The step's mean loss over its global batch, appended to `run.losses_out` by rank 0."""
    dist.all_reduce(summed)
    world = dist.get_world_size()
    samples = run.global_batch if not run.stock else engine.train_micro_batch_size_per_gpu() * world
    loss = summed.item() / samples
    if dist.get_rank() == 0 and run.losses_out:
        with open(run.losses_out, "a") as f:
            f.write(json.dumps({"step": engine.global_steps, "loss": loss, "world": world, "pid": os.getpid()}) + "\n")
    return loss
