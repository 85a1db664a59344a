#!/usr/bin/env python
"""Heterogeneous model parallelism: (a) the gradient sync's cost, measured; (b) HMP plans after a failure
against the best homogeneous layout on the same GPUs, through the cost model (an estimate).

    python benchmarks/hmp_train.py [--gpu-memory 80] [--markdown-out FILE] [--measure [--repeat 5]]

(a), with --measure: 3 CPU ranks (gloo) under torchrun, a Megatron-style table of 17 M parameters
(hidden 512, ffn 2048, 4 layers, vocab 8000). Per step, `ucp.hmp.grad_sync.GradSync` on TP sizes 2, 1
against a data-parallel all-reduce of the whole model's flat fp32 gradient on the same 3 ranks (what
DeepSpeed's ZeRO-0 data parallelism runs: one `dist.all_reduce` per flat bucket; here one bucket, the
engine itself is not built). Median wall time of --repeat, and each rank's bytes sent by a ring
all-reduce, 2 (g - 1) / g of every buffer it reduces in a group of g.

For Llama 2 7B and 13B (examples/models/) on 32 GPUs and on the 31 and 28 left after failures, scores
with `ucp.hmp.strategy.estimate`: every homogeneous DP x TP x PP layout that fits in the GPUs left
(layers split evenly, micro-batches ceil(M / DP) per replica, the slowest replica sets the step), and
the best plan of `ucp.hmp.strategy.search` (replicas of their own TP sizes and stages, micro-batches by
speed). Elastor reports 1.12-1.40x end to end under failure traces; this is the cost model's estimate of
the step alone. Pure arithmetic: no torch, no GPU.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ucp.hmp.layout import Layout, ParamSpec, Replica, Stage
from ucp.hmp.model_shapes import ModelConfig, load_model_config
from ucp.hmp.strategy import CostModel, Workload, estimate, search, tp_sizes

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("llama2-7b", "llama2-13b")
COUNTS = (32, 31, 28)


def best_homogeneous(model: ModelConfig, gpus: int, cost: CostModel, work: Workload) -> tuple[float, str]:
    """(tokens/s, "DP x TP x PP") of the fastest homogeneous layout that fits on at most `gpus` GPUs."""
    best = (0.0, "none fits")
    for tp in tp_sizes(model, min(cost.tp_max, gpus)):
        for pp in range(1, min(model.num_layers, gpus // tp) + 1):
            for dp in range(1, min(gpus // (tp * pp), work.micro_batches) + 1):
                micro = math.ceil(work.micro_batches / dp)
                layout = Layout.homogeneous(dp, tp, pp, model.num_layers, zero_stage=cost.zero_stage,
                                            micro_batches=micro)
                score = estimate(layout, model, cost, work)
                speed = work.global_batch * work.seq_len / score.step_time_s
                if score.fits and speed > best[0]:
                    best = (speed, f"{dp} x {tp} x {pp} ({dp * tp * pp} GPUs)")
    return best


def table(hidden: int = 512, ffn: int = 2048, layers: int = 4, vocab: int = 8000) -> list[ParamSpec]:
    out = [ParamSpec("embed.weight", (vocab, hidden), 0, -1)]
    for i in range(layers):
        out += [ParamSpec(f"layers.{i}.norm.weight", (hidden,), None, i),
                ParamSpec(f"layers.{i}.fc1.weight", (ffn, hidden), 0, i),
                ParamSpec(f"layers.{i}.fc1.bias", (ffn,), 0, i),
                ParamSpec(f"layers.{i}.fc2.weight", (hidden, ffn), 1, i),
                ParamSpec(f"layers.{i}.fc2.bias", (hidden,), None, i)]
    return out + [ParamSpec("head.weight", (vocab, hidden), 0, layers)]


def measure_worker(repeat: int, out: Path) -> None:
    """One rank of (a): time GradSync on TP 2 + TP 1 against a DP all-reduce of the whole model's gradient."""
    import torch
    import torch.distributed as dist

    from ucp.hmp.grad_sync import GradSync

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    specs = table()
    layout = Layout(4, (Replica((Stage((0, 4), (0, 1)),), 5), Replica((Stage((0, 4), (2,)),), 3)))
    params = {}
    for name, owned in layout.rank_slices(rank, specs).items():
        p = torch.nn.Parameter(torch.zeros(tuple(b - a for a, b in owned.box)))
        p.grad = torch.randn(p.shape)
        params[name] = p
    sync = GradSync(layout, specs, params, [5, 3])
    flat = torch.randn(sum(math.prod(s.shape) for s in specs))

    def timed(step) -> float:
        step()  # warm-up: the first call on a group pays for its connections
        times = []
        for _ in range(repeat):
            dist.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    dp = timed(lambda: dist.all_reduce(flat))
    hmp = timed(sync)
    sent = sum(2 * (len(b.group) - 1) / len(b.group) * 4 * sum(_numel(params[p.name], p) for p in b.pieces)
               for b in sync.buckets)
    held = sum(p.numel() for p in params.values()) * 4
    (out / f"rank{rank}.json").write_text(json.dumps({"hmp_s": hmp, "dp_s": dp, "sent": sent, "held": held,
                                                      "dp_sent": 2 * 2 / 3 * flat.numel() * 4}))
    dist.destroy_process_group()


def _numel(param, piece) -> int:
    if piece.dim is None:
        return param.numel()
    return param.numel() // param.shape[piece.dim] * (piece.hi - piece.lo)


def measure(repeat: int) -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", __file__,
                        "--worker", tmp, "--repeat", str(repeat)], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(3)]
    step = max(r["hmp_s"] for r in ranks), max(r["dp_s"] for r in ranks)
    lines = [f"(a) 3 CPU ranks (gloo), {sum(math.prod(s.shape) for s in table()) / 1e6:.1f} M fp32 parameters, "
             f"median of {repeat}: HMP sync (TP 2 + TP 1) {step[0] * 1e3:.0f} ms, DP all-reduce of the whole "
             f"gradient (3 x TP 1) {step[1] * 1e3:.0f} ms: {step[0] / step[1]:.2f}x", "",
             "| rank | holds (MiB) | HMP sync sends (MiB) | DP all-reduce sends (MiB) |", "|---:|---:|---:|---:|"]
    lines += [f"| {i} | {r['held'] / 2**20:.1f} | {r['sent'] / 2**20:.1f} | {r['dp_sent'] / 2**20:.1f} |"
              for i, r in enumerate(ranks)]
    return lines + [""]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-memory", type=float, default=80.0)
    parser.add_argument("--markdown-out", metavar="FILE")
    parser.add_argument("--measure", action="store_true", help="also run (a) on 3 CPU ranks")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)  # a rank of (a), started by --measure
    args = parser.parse_args()
    if args.worker:
        measure_worker(args.repeat, Path(args.worker))
        return 0
    cost, work = CostModel(gpu_memory_gib=args.gpu_memory), Workload()
    lines = measure(args.repeat) if args.measure else []
    lines += [f"(b) Cost-model estimates ({args.gpu_memory:g} GiB GPUs, global batch {work.global_batch} x "
              f"{work.seq_len} tokens): tokens/s of one optimizer step", "",
              "| model | GPUs | best homogeneous DP x TP x PP | tokens/s | HMP plan | tokens/s | HMP / homogeneous |",
              "|---|---:|---|---:|---|---:|---:|"]
    for name in MODELS:
        model = load_model_config(ROOT / "examples" / "models" / f"{name}.json")
        for gpus in COUNTS:
            homogeneous, shape = best_homogeneous(model, gpus, cost, work)
            plan = search(model, gpus, cost, work).plans[0]
            kinds = " + ".join(f"{r.count} x TP[{','.join(str(s.tp) for s in r.stages)}]" for r in plan.replicas)
            lines.append(f"| {name} | {gpus} | {shape} | {homogeneous:,.0f} | DP {plan.dp}: {kinds} | "
                         f"{plan.tokens_per_s:,.0f} | {plan.tokens_per_s / homogeneous:.2f}x |")
    text = "\n".join(lines)
    print(text)
    if args.markdown_out:
        Path(args.markdown_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
