#!/usr/bin/env python
"""Train a tiny PipelineModule with DeepSpeed on CPU (2 pipeline stages) and save a checkpoint.

Launched with ``torchrun --nproc_per_node N tests/support/train_pipe.py --runs JSON`` (N = 2 × DP);
``--runs`` trains several configurations ({stage, dtype, topology, save_dir, dump_state}) one
after another in one launch, and a run's ``dump_state`` path gets every rank's gathered fp32
state (see support/gather.py).

Layers (LayerSpec / TiedLayerSpec), split uniformly over 2 stages:

  0  TiedLayerSpec("embed", TiedEmbedding)    token ids -> vectors          stage 0
  1  LayerSpec(Block)                         residual MLP, buffer "scale"  stage 0
  2  LayerSpec(Block)                                                       stage 0
  3  LayerSpec(LayerNorm)                                                   stage 1
  4  TiedLayerSpec("embed", TiedEmbedding)    vectors -> logits             stage 1

The tied embedding lives on both stages (``tied_modules.embed.weight``); DeepSpeed keeps it in
sync by all-reducing its gradient between the two stages, so both copies stay identical. With
``topology`` the module gets an explicit ``PipeModelDataParallelTopology`` (model axis of 1),
which changes the layer file names to ``layer_XX-model_00-model_states.pt``.
"""
import argparse

import torch
import torch.nn.functional as F

from multi_run import run_all, save_and_close

VOCAB, DIM, HIDDEN, SEQ = 11, 6, 10, 4
MICRO_BATCH, ACCUMULATION = 2, 2
INIT_SEED = 4321


class TiedEmbedding(torch.nn.Module):
    """Embeds token ids (int input) or projects hidden states onto the vocabulary (float input)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(INIT_SEED)
        self.weight = torch.nn.Parameter(torch.randn(VOCAB, DIM, generator=g))

    def forward(self, x):
        if x.dtype in (torch.int64, torch.int32):
            return F.embedding(x, self.weight)
        return F.linear(x, self.weight)


class Block(torch.nn.Module):

    def __init__(self, seed):
        super().__init__()
        g = torch.Generator().manual_seed(INIT_SEED + seed)
        self.fc1 = torch.nn.Linear(DIM, HIDDEN)
        self.fc2 = torch.nn.Linear(HIDDEN, DIM)
        with torch.no_grad():
            for p in (self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias):
                p.copy_(torch.randn(p.shape, generator=g) * 0.4)
        self.register_buffer("scale", torch.linspace(1.0, 0.5, DIM) + seed)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x))) * self.scale.to(x.dtype)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def build(args, world_size):
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    layers = [
        TiedLayerSpec("embed", TiedEmbedding),
        LayerSpec(Block, 1),
        LayerSpec(Block, 2),
        LayerSpec(torch.nn.LayerNorm, DIM),
        TiedLayerSpec("embed", TiedEmbedding),
    ]
    if args.topology:
        topo = PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=world_size // 2)
        return PipelineModule(layers, topology=topo, loss_fn=loss_fn, partition_method="uniform")
    return PipelineModule(layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform")


def ds_config(args):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": ACCUMULATION,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "betas": [0.9, 0.95], "weight_decay": 0.05,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def batches(step, dp_rank, dp):
    """Micro-batches of global step `step` for data-parallel rank `dp_rank` (same data at any DP)."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH * ACCUMULATION * dp, SEQ), generator=g)
    targets = (tokens * 2 + 1) % VOCAB
    for m in range(ACCUMULATION):
        rows = slice((dp_rank * ACCUMULATION + m) * MICRO_BATCH, (dp_rank * ACCUMULATION + m + 1) * MICRO_BATCH)
        yield tokens[rows], targets[rows]


def train_one(run: dict, args: argparse.Namespace) -> None:
    import deepspeed
    import torch.distributed as dist

    from gather import dump_states, local_state

    opts = argparse.Namespace(stage=run.get("stage", 1), dtype=run.get("dtype", "fp32"),
                              topology=run.get("topology", False))
    model = build(opts, dist.get_world_size())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[q for q in model.parameters()],
                                           config=ds_config(opts))
    dp, dp_rank = engine.grid.data_parallel_size, engine.grid.data_parallel_id
    for step in range(args.steps):
        engine.train_batch(iter(list(batches(step, dp_rank, dp))))
    if run.get("dump_state"):
        dump_states(run["dump_state"], {"stage": engine.stage_id, "dp_rank": dp_rank,
                                        "params": local_state(engine, model.named_parameters())},
                    {"global_steps": engine.global_steps})
    save_and_close(engine, run, {"client_marker": 11})


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(run_all(train_one, "{stage, dtype, topology, save_dir, dump_state}"))
