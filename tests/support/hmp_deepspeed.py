#!/usr/bin/env python
"""HMP through the DeepSpeed hook: each rank's engine loads its slices by the layout (CPU, gloo).

Launched with ``torchrun --nproc_per_node N tests/support/hmp_deepspeed.py LAYOUT.json CKPT OUT``.
Every rank builds the reference model's `StageModule` for its slices, wraps it in its own
DeepSpeed engine (ZeRO-0, AdamW; a data-parallel group of the rank alone, as under HMP each
replica's TP group differs) through ``ucp.deepspeed.initialize`` with ``"ucp": {"load": CKPT,
"layout": ...}``, then writes ``OUT/rank<r>.pt`` (its parameters and their Adam moments, step)
and ``OUT/rank<r>.json`` (what it read), and the first rank of each replica's last stage writes
``OUT/replica<i>.pt``, the logits of a forward pass over the loaded slices.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import ucp.deepspeed
from ucp.layout import Layout
from ucp.reference_tp import RefConfig, Stage, StageModule, tp_groups

TOKENS_SEED = 7


class RankAloneMpu:
    """DeepSpeed's model-parallel unit for one HMP rank: its TP group, and a data-parallel group of itself."""

    def __init__(self, tp_group, tp_ranks: tuple[int, ...], dp_group):
        self.tp_group, self.tp_ranks, self.dp_group = tp_group, tp_ranks, dp_group

    def get_model_parallel_rank(self) -> int:
        return self.tp_ranks.index(dist.get_rank())

    def get_model_parallel_world_size(self) -> int:
        return len(self.tp_ranks)

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_group(self):
        return self.dp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layout")
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--config", default="{}", help="RefConfig fields as JSON")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layout = Layout.from_json(Path(args.layout).read_text())
    cfg = RefConfig(**json.loads(args.config))
    out = Path(args.out)
    groups = tp_groups(layout)
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    where = layout.placement(rank)
    tp_ranks = layout.replicas[where.replica].stages[where.stage].ranks
    module = StageModule(layout, rank, cfg)
    config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
              "ucp": {"load": args.ckpt, "layout": layout.to_json()}}
    engine, _, _, _ = ucp.deepspeed.initialize(model=module, model_parameters=module.parameters(),
                                                       config=config, mpu=RankAloneMpu(groups[tp_ranks], tp_ranks,
                                                                                       alone[rank]))
    names = {p: n for n, p in module.named_parameters()}
    state = {names[p]: {"fp32": p.detach().clone(), **{k: v.clone() for k, v in engine.optimizer.state[p].items()}}
             for p in module.parameters()}
    torch.save(state, out / f"rank{rank}.pt")
    stats = engine.ucp_load_stats
    (out / f"rank{rank}.json").write_text(json.dumps({"bytes_read": stats.bytes_read,
                                                      "read_calls": stats.read_calls,
                                                      "tensors": stats.tensors}))
    tokens = torch.randint(0, cfg.vocab, (2, 5), generator=torch.Generator().manual_seed(TOKENS_SEED))
    logits = Stage.of_module(module).forward(tokens, groups)
    if logits is not None:
        torch.save(logits, out / f"replica{where.replica}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
