"""`ucp plan`: the strategy search on the command line. Imports no torch: it must start fast."""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from ucp.cli.tables import table
from ucp.hmp.layout import choose_global_split
from ucp.hmp.model_shapes import ModelConfig, load_model_config
from ucp.hmp.strategy import CostModel, Plan, SearchResult, StagePlan, Workload, search


def run_plan(args: argparse.Namespace) -> int:
    model = load_model_config(args.model)
    given = {"peak_tflops": args.gpu_tflops, "tp_max": args.tp_max, "zero_stage": args.zero}
    cost = CostModel(gpu_memory_gib=args.gpu_memory, **{k: v for k, v in given.items() if v is not None})
    work = Workload(global_batch=args.global_batch, seq_len=args.seq_len)
    start = time.perf_counter()
    result = search(model, args.gpus, cost, work, top=args.top)
    elapsed = time.perf_counter() - start
    if args.json:
        json.dump({"model": model.name, "params": model.num_params, "gpus": args.gpus,
                   "cost_model": vars(cost), "workload": vars(work), "search_s": elapsed,
                   "candidates": result.candidates, "global_split": global_split(result),
                   "plans": [{**p.to_json(), "layout": p.layout().to_json()} for p in result.plans]},
                  sys.stdout, indent=1)
        print()
        return 0
    print(report(model, args.gpus, cost, work, result, elapsed))
    return 0


def report(model: ModelConfig, gpus: int, cost: CostModel, work: Workload, result: SearchResult, elapsed: float) -> str:
    lines = [f"{model.name}: {model.num_params / 1e9:.2f} B parameters, {model.num_layers} layers; {gpus} GPUs x "
             f"{cost.gpu_memory_gib:g} GiB; global batch {work.global_batch} x {work.seq_len} tokens",
             f"cost model (docs/PLAN.md): {cost.peak_tflops:g} TFLOP/s x {cost.mfu:g} per GPU, TP efficiency "
             f"1/(1 + {cost.tp_overhead:g}(t-1)), ZeRO-{cost.zero_stage}, DP all-reduce {cost.dp_bandwidth_gbs:g} GB/s",
             f"searched {result.candidates} (TP_max, DP) candidates in {elapsed:.2f} s; a checkpoint every plan "
             f"below loads split by split: ucp convert ... --splits {global_split(result)}", ""]
    for i, plan in enumerate(result.plans, 1):
        lines.append(f"#{i}  {plan.step_time_s:.2f} s/step  {plan.tokens_per_s / 1e3:.1f}k tokens/s  "
                     f"max {plan.memory_gib:.1f} GiB/GPU  DP {plan.dp}  TP_max {plan.tp_max}  "
                     f"(all-reduce {plan.sync_time_s:.2f} s)")
        lines += _replica_lines(plan)
    return "\n".join(lines)


def global_split(result: SearchResult) -> int:
    """The split count under which every rank of every plan found owns whole splits."""
    return choose_global_split(s.tp for p in result.plans for r in p.replicas for s in r.stages)


def _replica_lines(plan: Plan) -> list[str]:
    rows = [(f"{r.count} x", pipeline(r.stages), f"{r.micro_batches} micro-batches",
             f"{r.time_s:.2f} s", f"{r.memory_gib:.1f} GiB") for r in plan.replicas]
    return table(rows, right=(0, 3, 4), indent="    ")


def pipeline(stages: Sequence[StagePlan]) -> str:
    """Stages as 'TP8:11 > TP8:11 > TP4:10' (TP size : layers), repeats folded as 'TP8:3 (x10)'."""
    runs: list[list] = []
    for s in stages:
        if runs and runs[-1][0] == (s.tp, s.layers):
            runs[-1][1] += 1
        else:
            runs.append([(s.tp, s.layers), 1])
    return " > ".join(f"TP{tp}:{k}" + (f" (x{n})" if n > 1 else "") for (tp, k), n in runs)
