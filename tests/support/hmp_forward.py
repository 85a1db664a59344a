#!/usr/bin/env python
"""Forward pass of the reference TP model (ucp.reference_tp) under an HMP layout, on CPU ranks (gloo).

Launched with ``torchrun --nproc_per_node N tests/support/hmp_forward.py LAYOUT.json CKPT OUT``.
Every rank loads its slices of CKPT through the layout and runs its stage on the same tokens;
the first rank of each replica's last stage writes ``OUT/replica<i>.pt`` (the logits). Each rank
writes ``OUT/rank<r>.json`` with what it read (bytes, read calls, bytes of its own slices).

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

from ucp.hmp import load_slices
from ucp.layout import Layout
from ucp.reference_tp import RefConfig, param_table, tp_groups
from ucp.reference_tp import Stage as RefStage

TOKENS_SEED = 7


def run(layout: Layout, rank: int, ckpt: str, cfg: RefConfig, groups: dict,
        tokens: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
    loaded = load_slices(layout, rank, ckpt, param_table(cfg))
    weights = {n: s["fp32"].to(torch.float64) for n, s in loaded.tensors.items()}
    stage = RefStage(layout, rank, cfg, weights, {n: s.box for n, s in loaded.slices.items()})
    stats = {"bytes_read": loaded.bytes_read, "read_calls": loaded.read_calls, "share_bytes": loaded.share_bytes,
             "tensors": loaded.tensors_touched}
    return stage.forward(tokens, groups), stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layout")
    parser.add_argument("ckpt")
    parser.add_argument("out")
    parser.add_argument("--config", default="{}", help="RefConfig fields as JSON")
    parser.add_argument("--control", metavar="CKPT2")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layout = Layout.from_json(Path(args.layout).read_text())
    cfg = RefConfig(**json.loads(args.config))
    out = Path(args.out)
    groups = tp_groups(layout)
    tokens = torch.randint(0, cfg.vocab, (2, 5), generator=torch.Generator().manual_seed(TOKENS_SEED))
    replica = layout.placement(rank).replica
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
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
