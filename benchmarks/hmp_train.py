#!/usr/bin/env python
"""Heterogeneous model parallelism after a failure, through the cost model: the HMP plan against the best
homogeneous layout on the same GPUs (part (b) of issue #30's benchmark; an estimate, not a measurement).

    python benchmarks/hmp_train.py [--gpu-memory 80] [--markdown-out FILE]

For Llama 2 7B and 13B (examples/models/) on 32 GPUs and on the 31 and 28 left after failures, scores
with `ucp.hmp.strategy.estimate`: every homogeneous DP x TP x PP layout that fits in the GPUs left
(layers split evenly, micro-batches ceil(M / DP) per replica, the slowest replica sets the step), and
the best plan of `ucp.hmp.strategy.search` (replicas of their own TP sizes and stages, micro-batches by
speed). Elastor reports 1.12-1.40x end to end under failure traces; this is the cost model's estimate of
the step alone. Pure arithmetic: no torch, no GPU.
"""
from __future__ import annotations

import argparse
import math
from pathlib import Path

from ucp.hmp.layout import Layout
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu-memory", type=float, default=80.0)
    parser.add_argument("--markdown-out", metavar="FILE")
    args = parser.parse_args()
    cost, work = CostModel(gpu_memory_gib=args.gpu_memory), Workload()
    lines = [f"Cost-model estimates ({args.gpu_memory:g} GiB GPUs, global batch {work.global_batch} x {work.seq_len} "
             "tokens): tokens/s of one optimizer step", "",
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
