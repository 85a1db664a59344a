#!/usr/bin/env python
"""Forward pass of the reference TP model (support.reference_tp) under an HMP layout, on CPU ranks (gloo).

Launched with ``torchrun --nproc_per_node N tests/support/hmp_forward.py LAYOUT.json CKPT OUT``.
Every rank loads its slices of CKPT through the layout and runs its stage on the same tokens;
the first rank of each replica's last stage writes ``OUT/replica<i>.pt`` (the logits). Each rank
writes ``OUT/rank<r>.json`` with what it read (bytes, read calls, bytes of its own slices).

With ``--deepspeed`` the slices come through the DeepSpeed hook instead of `ucp.hmp.load_slices`:
every rank builds the reference model's `StageModule`, wraps it in its own engine (ZeRO-0,
AdamW; a data-parallel group of the rank alone, as under HMP each replica's TP group differs)
through ``ucp.deepspeed.initialize`` with ``"ucp": {"load": CKPT, "layout": ...}``, and also
writes ``OUT/rank<r>.pt``: its parameters with their Adam moments and step, as loaded.

With ``--control CKPT2``, every rank runs once more loading from CKPT2 and writes
``OUT/control_replica<i>.pt``; the test passes a deliberately broken copy of CKPT as a negative
control that must not match.
"""
import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

import ucp.deepspeed
from reference_tp import RefConfig, StageModule, param_table, tp_groups
from reference_tp import Stage as RefStage
from ucp.hmp import load_slices
from ucp.hmp.layout import Layout

TOKENS_SEED = 7


def run(layout: Layout, rank: int, ckpt: str, cfg: RefConfig, groups: dict,
        tokens: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
    loaded = load_slices(layout, rank, ckpt, param_table(cfg))
    weights = {n: s["fp32"].to(torch.float64) for n, s in loaded.tensors.items()}
    stage = RefStage(layout, rank, cfg, weights, {n: s.box for n, s in loaded.slices.items()})
    stats = {"bytes_read": loaded.bytes_read, "bytes_checked_extra": loaded.bytes_checked_extra,
             "read_calls": loaded.read_calls, "share_bytes": loaded.share_bytes, "tensors": loaded.tensors_touched}
    return stage.forward(tokens, groups), stats


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


def run_deepspeed(layout: Layout, rank: int, ckpt: str, cfg: RefConfig, groups: dict, tokens: torch.Tensor,
                  out: Path) -> tuple[torch.Tensor | None, dict]:
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank creates every group
    where = layout.placement(rank)
    tp_ranks = layout.replicas[where.replica].stages[where.stage].ranks
    module = StageModule(layout, rank, cfg)
    config = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 0}, "steps_per_print": 10**9,
              "ucp": {"load": ckpt, "layout": layout.to_json()}}
    mpu = RankAloneMpu(groups[tp_ranks], tp_ranks, alone[rank])
    engine, _, _, _ = ucp.deepspeed.initialize(model=module, model_parameters=module.parameters(), config=config,
                                               mpu=mpu)
    state = {n: {"fp32": p.detach().clone(), **{k: v.clone() for k, v in engine.optimizer.state[p].items()}}
             for n, p in module.named_parameters()}
    torch.save(state, out / f"rank{rank}.pt")
    stats = engine.ucp_load_stats
    return RefStage.of_module(module).forward(tokens, groups), {"bytes_read": stats.bytes_read,
                                                                "bytes_checked_extra": stats.bytes_checked_extra,
                                                                "read_calls": stats.read_calls,
                                                                "tensors": stats.tensors}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layout")
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--config", default="{}", help="RefConfig fields as JSON")
    parser.add_argument("--control", metavar="CKPT2")
    parser.add_argument("--deepspeed", action="store_true", help="load through ucp.deepspeed.initialize")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layout = Layout.from_json(Path(args.layout).read_text())
    cfg = RefConfig(**json.loads(args.config))
    out = Path(args.out)
    groups = tp_groups(layout)
    tokens = torch.randint(0, cfg.vocab, (2, 5), generator=torch.Generator().manual_seed(TOKENS_SEED))
    replica = layout.placement(rank).replica
    if args.deepspeed:
        logits, stats = run_deepspeed(layout, rank, args.ckpt, cfg, groups, tokens, out)
    else:
        logits, stats = run(layout, rank, args.ckpt, cfg, groups, tokens)
    if logits is not None:
        torch.save(logits, out / f"replica{replica}.pt")
    (out / f"rank{rank}.json").write_text(json.dumps(stats))
    if args.control:
        logits, _ = run(layout, rank, args.control, cfg, groups, tokens)
        if logits is not None:
            torch.save(logits, out / f"control_replica{replica}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    import ucp.deepspeed
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ucp.deepspeed.finish(main())
