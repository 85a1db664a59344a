#!/usr/bin/env python
"""Split-driven loading benchmark: bytes read and read calls per layout change, three ways.

    python benchmarks/load_splits.py [--tmp DIR] [--markdown-out FILE]

Builds a small Llama-shaped model (random weights, fp32 + Adam's two moments, Hugging Face names,
written through ucp's own writer) twice: split-major with `--splits 4` and plain row-major. Then,
for every rank of each target layout, loads its slices (weights and both moments):

* **splits**: `ucp.hmp.load_slices` on the split-major checkpoint: each rank reads exactly its runs
  of splits, touching ranges merged;
* **row-major**: the same loader on the plain checkpoint: dim-0 slices are still one range each,
  but row-parallel (dim-1) slices need the whole tensor;
* **per-tensor**: every tensor the rank touches read whole with `open_checkpoint(...).tensor()`
  and sliced in memory, as DeepSpeed's universal loader reads its per-parameter files.

Reports bytes read (all ranks, and the busiest rank), read calls, the bytes of the slices
themselves (what an exact loader must read) and load time, and checks every slice against the
per-tensor result.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from ucp.checkpoint import AtomicCheckpoint
from ucp.convert.split_policy import SplitPolicy
from ucp.convert.tensors import write_tensors
from ucp.hmp.layout import Layout, Replica, Stage
from ucp.hmp.model_shapes import ModelConfig
from ucp.hmp.slice_load import load_slices

ADAM_STATES = ("fp32", "exp_avg", "exp_avg_sq")

MODEL = ModelConfig("llama-20m", hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8,
                    num_kv_heads=2, vocab_size=8000)


def layouts() -> dict[str, Layout]:
    L = MODEL.num_layers
    return {
        "DP3 x TP2 (from TP4 x DP2)": Layout.homogeneous(dp=3, tp=2, pp=1, num_layers=L),
        "HMP: [TP4] + [TP2 L0-2 > TP1 L3] + [TP1]": Layout(L, (
            Replica((Stage((0, L), (0, 1, 2, 3)),), 1),
            Replica((Stage((0, 3), (4, 5)), Stage((3, L), (6,))), 1),
            Replica((Stage((0, L), (7,)),), 1))),
        "DP2 x TP2 x PP2": Layout.homogeneous(dp=2, tp=2, pp=2, num_layers=L),
    }


def per_tensor(layout: Layout, rank: int, path: Path, table) -> tuple[dict, int, int]:
    ckpt = AtomicCheckpoint(path)
    out = {}
    for name, piece in layout.rank_slices(rank, table).items():
        box = tuple(slice(a, b) for a, b in piece.box)
        out[name] = {s: ckpt.tensor(name, s)[box] for s in ADAM_STATES}
    return out, ckpt.counter.bytes, ckpt.counter.calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tmp", metavar="DIR", help="where to write the two checkpoints (deleted after)")
    parser.add_argument("--markdown-out", metavar="FILE")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ucp-load-splits-", dir=args.tmp))
    try:
        table = MODEL.param_table()
        g = torch.Generator().manual_seed(0)
        tensors = {s.name: {state: torch.randn(s.shape, generator=g) for state in ADAM_STATES} for s in table}
        split = write_tensors(work / "split", tensors, splits=SplitPolicy(4))
        plain = write_tensors(work / "plain", tensors)
        del tensors
        size = sum(f.stat().st_size for f in split.glob("data-*"))
        lines = [f"{MODEL.name}: {MODEL.num_params / 1e6:.1f} M parameters x 3 states (fp32, exp_avg, exp_avg_sq) = "
                 f"{size / 2**20:.0f} MiB; split-major checkpoint with --splits 4", "",
                 "| target layout | reader | bytes read, all ranks (MiB) | busiest rank (MiB) | read calls | "
                 "slices themselves (MiB) | load time, all ranks (s) |", "|---|---|---:|---:|---:|---:|---:|"]
        for name, layout in layouts().items():
            rows = {"splits": [], "row-major": [], "per-tensor": []}
            share = 0
            for rank in range(layout.world_size):
                start = time.perf_counter()
                ref, nbytes, calls = per_tensor(layout, rank, plain, table)
                rows["per-tensor"].append((nbytes, calls, time.perf_counter() - start))
                for label, path in (("splits", split), ("row-major", plain)):
                    start = time.perf_counter()
                    loaded = load_slices(layout, rank, path, table, ADAM_STATES)
                    rows[label].append((loaded.bytes_read, loaded.read_calls, time.perf_counter() - start))
                    for pname, states in ref.items():
                        for state, t in states.items():
                            if not torch.equal(loaded.tensors[pname][state], t):
                                print(f"MISMATCH {label} rank {rank} {pname}:{state}")
                                return 1
                share += loaded.share_bytes
            for label, r in rows.items():
                lines.append(f"| {name} | {label} | {sum(b for b, _, _ in r) / 2**20:.1f} | "
                             f"{max(b for b, _, _ in r) / 2**20:.1f} | {sum(c for _, c, _ in r)} | "
                             f"{share / 2**20:.1f} | {sum(t for _, _, t in r):.2f} |")
        text = "\n".join(lines)
        print(text)
        if args.markdown_out:
            Path(args.markdown_out).write_text(text + "\n")
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
