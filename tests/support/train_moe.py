#!/usr/bin/env python
"""Train a tiny model with a native DeepSpeed MoE layer (4 experts) on CPU and save checkpoints.

Launched with ``torchrun --nproc_per_node 2 tests/support/train_moe.py --runs JSON``; ``--runs``
trains several configurations ({ep_size, stage, dtype, save_dir, dump_state}) one after another
in one launch.

Model: embedding -> MoE(Expert MLP, 4 experts, top-1 gate) -> head. Experts differ from one
another from the start (global expert e is initialised from seed 100 + e), so an expert read under
the wrong global id is visible. The optimizer gets DeepSpeed's MoE param groups
(`split_params_into_different_moe_groups_for_optimizer`): expert parameters are partitioned
over the expert-data-parallel group, the rest over the whole data-parallel group.

A run's ``dump_state`` path gets every rank's gathered fp32 state (see support/gather.py), each
rank's local expert ids mapped to global ones from DeepSpeed's own expert-parallel rank.
"""
import argparse
import re

import torch
import torch.nn.functional as F

from multi_run import run_all, save_and_close

VOCAB, DIM, HIDDEN, SEQ, EXPERTS = 12, 8, 6, 4, 4
MICRO_BATCH = 3
INIT_SEED = 777
LOCAL_EXPERT = re.compile(r"(.*\.deepspeed_experts\.)(\d+)(\..*)")


class Expert(torch.nn.Module):

    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(DIM, HIDDEN)
        self.w2 = torch.nn.Linear(HIDDEN, DIM, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


class MoEModel(torch.nn.Module):

    def __init__(self, ep_size, ep_rank):
        from deepspeed.moe.layer import MoE

        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.moe = MoE(hidden_size=DIM, expert=Expert(), num_experts=EXPERTS, ep_size=ep_size, k=1,
                       min_capacity=SEQ * MICRO_BATCH, capacity_factor=2.0)
        self.head = torch.nn.Linear(DIM, VOCAB)
        g = torch.Generator().manual_seed(INIT_SEED)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if ".deepspeed_experts." not in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            for local, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
                ge = torch.Generator().manual_seed(100 + ep_rank * self.moe.num_local_experts + local)
                for p in expert.parameters():
                    p.copy_(torch.randn(p.shape, generator=ge) * 0.5)

    def forward(self, tokens, targets):
        h, l_aux, _ = self.moe(self.emb(tokens))
        logits = self.head(h)
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1)) + 0.01 * l_aux


def _ep_rank(model) -> int:
    from deepspeed.utils import groups

    return groups._get_expert_parallel_rank(model.moe.deepspeed_moe.ep_group_name)


def global_name(name: str, ep_rank: int, local_experts: int) -> str:
    m = LOCAL_EXPERT.match(name)
    if not m:
        return name
    return f"{m.group(1)}{ep_rank * local_experts + int(m.group(2))}{m.group(3)}"


def ds_config(args):
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "betas": [0.9, 0.95], "weight_decay": 0.01,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": args.stage},
        "steps_per_print": 10**9,
    }
    if args.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def train_step(engine, step: int, rank: int, world: int) -> torch.Tensor:
    """One optimizer step on global step `step`'s batch (the same global batch at any ep_size); this rank's loss."""
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCH * world, SEQ), generator=g)
    targets = (tokens * 5 + 2) % VOCAB
    rows = slice(rank * MICRO_BATCH, (rank + 1) * MICRO_BATCH)
    loss = engine(tokens[rows], targets[rows])
    engine.backward(loss)
    engine.step()
    return loss


def train_one(run: dict, args: argparse.Namespace) -> None:
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from gather import dump_states, local_state

    rank, world = dist.get_rank(), dist.get_world_size()
    ep_size = run.get("ep_size", 2)
    opts = argparse.Namespace(stage=run.get("stage", 1), dtype=run.get("dtype", "fp32"))
    # DeepSpeed makes its expert groups at initialize; with no model parallelism rank r is EP rank r % ep_size.
    model = MoEModel(ep_size, rank % ep_size)
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "all"}])
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config(opts))
    if _ep_rank(model) != rank % ep_size:
        raise RuntimeError(f"rank {rank}: DeepSpeed made EP rank {_ep_rank(model)}, expected {rank % ep_size}")
    for step in range(args.steps):
        train_step(engine, step, rank, world)
    if run.get("dump_state"):
        ep_rank, local = _ep_rank(model), model.moe.num_local_experts
        state = local_state(engine, model.named_parameters())
        dump_states(run["dump_state"], {"ep_rank": ep_rank,
                                        "params": {global_name(n, ep_rank, local): v for n, v in state.items()}},
                    {"global_steps": engine.global_steps})
    save_and_close(engine, run, {"client_marker": 13})


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(run_all(train_one, "{stage, dtype, ep_size, save_dir, dump_state}"))
