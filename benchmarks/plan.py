#!/usr/bin/env python
"""Strategy-search benchmark: how long `ucp plan` takes as the GPU count grows.

    python benchmarks/plan.py [--repeat 5] [--gpu-memory 80] [--markdown-out FILE]

For each example model (examples/models/) and N in 8, 32, 128, 1024, 4096 GPUs (and the awkward
counts 28, 31, 1021), times `ucp.hmp.strategy.search` in process (CPU time, median of --repeat runs),
then the whole command `python -m ucp.cli.main plan --gpus 1024 ...` in a subprocess (wall and CPU
time, interpreter start and imports included). Prints a Markdown table and the best plan found.
"""
from __future__ import annotations

import argparse
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ucp.cli.plan import pipeline
from ucp.hmp.model_shapes import load_model_config
from ucp.hmp.strategy import CostModel, Workload, search

ROOT = Path(__file__).resolve().parent.parent
MODELS = ("llama2-7b", "llama2-13b", "qwen2.5-32b")
COUNTS = (8, 28, 31, 32, 128, 1021, 1024, 4096)


def time_search(model, gpus: int, cost: CostModel, repeat: int):
    times = []
    for _ in range(repeat):
        start = time.process_time()
        result = search(model, gpus, cost, Workload())
        times.append(time.process_time() - start)
    return statistics.median(times), result


def time_command(config: Path, gpus: int, memory: float) -> tuple[float, float]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "ucp.cli.main", "plan", "--gpus", str(gpus), "--gpu-memory", str(memory),
                    "--model", str(config)], check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--gpu-memory", type=float, default=80.0)
    parser.add_argument("--markdown-out", metavar="FILE")
    args = parser.parse_args()
    cost = CostModel(gpu_memory_gib=args.gpu_memory)
    lines = [f"{platform.processor() or platform.machine()}, Python {platform.python_version()}; "
             f"{args.gpu_memory:g} GiB GPUs, global batch 256 x 4096; search CPU time, median of {args.repeat}", "",
             "| model | GPUs | candidates | search (ms) | best step (s) | best plan |",
             "|---|---:|---:|---:|---:|---|"]
    for name in MODELS:
        model = load_model_config(ROOT / "examples" / "models" / f"{name}.json")
        for gpus in COUNTS:
            seconds, result = time_search(model, gpus, cost, args.repeat)
            best = result.plans[0]
            shape = ", ".join(f"{r.count} x [{pipeline(r.stages)}]" for r in best.replicas[:2]) + \
                (f", +{len(best.replicas) - 2} more" if len(best.replicas) > 2 else "")
            lines.append(f"| {name} | {gpus} | {result.candidates} | {seconds * 1e3:.1f} | {best.step_time_s:.2f} | "
                         f"DP {best.dp}: {shape} |")
    lines += ["", "Whole command (`python -m ucp.cli.main plan --gpus 1024 ...`, new interpreter):", "",
              "| model | wall (s) | CPU (s) |", "|---|---:|---:|"]
    for name in MODELS:
        runs = [time_command(ROOT / "examples" / "models" / f"{name}.json", 1024, args.gpu_memory)
                for _ in range(args.repeat)]
        lines.append(f"| {name} | {statistics.median(w for w, _ in runs):.2f} | "
                     f"{statistics.median(c for _, c in runs):.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.markdown_out:
        Path(args.markdown_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
