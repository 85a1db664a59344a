#!/usr/bin/env python
"""Heterogeneous model parallelism: (a) the gradient sync's cost, measured; (b) HMP plans after a failure
against the best homogeneous layout on the same GPUs, through the cost model (an estimate).

    python benchmarks/hmp_train.py [--gpu-memory 80] [--markdown-out FILE] [--measure [--repeat 5] [--zero 0|1]]

(a), with --measure: 3 CPU ranks (gloo) under torchrun, the Megatron-style model of examples/hmp/tp_model.py at
17 M fp32 parameters (hidden 512, ffn 2048, 4 layers, vocab 8000), on real DeepSpeed engines (ZeRO stage
--zero, default 0): (i) DeepSpeed's own data parallelism, one engine per rank over the 3 ranks (TP 1 each): the
time of its gradient reduce per step, `engine.allreduce_gradients` as `engine.backward` calls it; (ii) HMP
engines on TP sizes --engine-tp-sizes (default 2,1) with `"ucp": {"layout", "hmp"}`: the time of the HMP sync
per step (`ucp.deepspeed.engine.hmp_sync.sync_engine_grads`, inside `engine.step`), and with it the engine's own reduce
over its data-parallel group of one. Each timed call starts after a barrier, so a rank's time is the
communication and copies, not the wait for a slower replica's backward. Median over --repeat steps (after one
warm-up step) per rank, the slowest rank's median reported. Bytes: each rank's sends under a ring all-reduce,
2 (g - 1) / g of every buffer it reduces in a group of g. The raw comparison follows: `GradSync` on the
same table against one `dist.all_reduce` of the whole flat gradient, without engines.

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


ENGINE_MODEL = {"vocab": 8000, "hidden": 512, "ffn": 2048, "layers": 4}  # examples/hmp/tp_model.Config's fields


def engine_worker(kind: str, tp_sizes: list[int], zero: int, repeat: int, out: Path) -> None:
    """One rank of (a) on DeepSpeed engines: `kind` "dp" (DeepSpeed's data parallelism over every rank) or "hmp"
    (one replica per entry of `tp_sizes`, the sync inside `engine.step`); times the gradient reduce of each step."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "examples" / "hmp"))
    from tp_model import Config, TPModel, init_weights

    import ucp.deepspeed
    from ucp.deepspeed.engine import hmp_sync
    from ucp.elastic import init_distributed

    init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = Config(**ENGINE_MODEL)
    sizes = tp_sizes if kind == "hmp" else [1] * world
    layout = Layout.one_stage(sizes, [1] * len(sizes), cfg.layers)
    config: dict = {"zero_optimization": {"stage": zero}, "steps_per_print": 10**9, "gradient_clipping": 0.0,
                    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    if kind == "hmp":
        mpu = hmp_sync.RankAloneMpu.for_layout(layout)
        group = mpu.tp_group
        config["ucp"] = {"layout": layout.to_json(),
                         "hmp": {"global_batch": len(sizes), "micro_batch": 1, "shares": [1] * len(sizes)}}
    else:
        mpu = None
        group = [dist.new_group([r]) for r in range(world)][rank]  # every rank creates every group, in order
        config["train_batch_size"] = world
    model = TPModel(layout, rank, cfg, group, init_weights(cfg))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, *_ = ucp.deepspeed.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu)
    times: dict[str, list[float]] = {"reduce": [], "sync": []}

    def timed(key: str, call):
        def run(*args, **kwargs):
            dist.barrier()  # time the reduce, not the wait for a slower replica's backward
            start = time.perf_counter()
            result = call(*args, **kwargs)
            times[key].append(time.perf_counter() - start)
            return result
        return run

    engine.allreduce_gradients = timed("reduce", engine.allreduce_gradients)  # engine.backward calls it
    hmp_sync.sync_engine_grads = timed("sync", hmp_sync.sync_engine_grads)  # the pre-step action calls it
    tokens = torch.randint(0, cfg.vocab, (1, 9), generator=torch.Generator().manual_seed(rank))
    for _ in range(repeat + 1):
        logits = engine(tokens[:, :-1])
        engine.backward(F.cross_entropy(logits.reshape(-1, cfg.vocab), tokens[:, 1:].reshape(-1)))
        engine.step()
    params = dict(model.named_parameters())
    held = sum(p.numel() for p in params.values()) * 4
    if kind == "hmp":
        sent = sum(2 * (len(b.group) - 1) / len(b.group) * 4 * sum(_numel(params[p.name], p) for p in b.pieces)
                   for b in engine.ucp_hmp.sync.buckets)
    else:
        sent = 2 * (world - 1) / world * held
    result = {"reduce_s": statistics.median(times["reduce"][1:]), "held": held, "sent": sent,
              "sync_s": statistics.median(times["sync"][1:]) if times["sync"] else None}
    (out / f"{kind}-rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def _launch(ranks: int, *flags: str) -> None:
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), __file__, *flags],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})


def measure_engines(repeat: int, zero: int, tp_sizes: list[int]) -> list[str]:
    """(a) on DeepSpeed engines: DeepSpeed's own DP reduce against the HMP sync, per step, on sum(tp_sizes) ranks."""
    ranks = sum(tp_sizes)
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("dp", "hmp"):
            _launch(ranks, "--engine-worker", kind, "--engine-tp-sizes", ",".join(map(str, tp_sizes)),
                    "--zero", str(zero), "--repeat", str(repeat), "--worker", tmp)
        dp = [json.loads((Path(tmp) / f"dp-rank{r}.json").read_text()) for r in range(ranks)]
        hmp = [json.loads((Path(tmp) / f"hmp-rank{r}.json").read_text()) for r in range(ranks)]
    reduce_dp = max(r["reduce_s"] for r in dp)
    sync = max(r["sync_s"] for r in hmp)
    both = max(r["sync_s"] + r["reduce_s"] for r in hmp)
    sizes = ",".join(map(str, tp_sizes))
    verdict = "PASS" if sync <= 1.2 * reduce_dp else "MISS"
    lines = [f"(a) DeepSpeed engines, ZeRO-{zero} fp32, {ranks} CPU ranks (gloo), {_engine_params() / 1e6:.1f} M "
             f"parameters, median of {repeat} steps, slowest rank: DeepSpeed's DP reduce ({ranks} x TP 1, "
             f"engine.allreduce_gradients) {reduce_dp * 1e3:.0f} ms; HMP sync (TP {sizes}) {sync * 1e3:.0f} ms: "
             f"{sync / reduce_dp:.2f}x ({verdict} against 1.2x); with the HMP engines' own reduce over a "
             f"data-parallel group of one, {both * 1e3:.0f} ms: {both / reduce_dp:.2f}x", "",
             "| rank | holds (MiB) | HMP sync sends (MiB) | DeepSpeed DP reduce sends (MiB) |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {i} | {h['held'] / 2**20:.1f} | {h['sent'] / 2**20:.1f} | {d['sent'] / 2**20:.1f} |"
              for i, (h, d) in enumerate(zip(hmp, dp))]
    return lines + [""]


def _engine_params() -> int:
    return sum(math.prod(s.shape) for s in _engine_table())


def _engine_table() -> list[ParamSpec]:
    sys.path.insert(0, str(ROOT / "examples" / "hmp"))
    from tp_model import Config, param_table

    return param_table(Config(**ENGINE_MODEL))


def _numel(param, piece) -> int:
    if piece.dim is None:
        return param.numel()
    return param.numel() // param.shape[piece.dim] * (piece.hi - piece.lo)


def measure(repeat: int) -> list[str]:
    """(a), raw: `GradSync` against one `dist.all_reduce` of the whole flat gradient, no engines."""
    with tempfile.TemporaryDirectory() as tmp:
        _launch(3, "--worker", tmp, "--repeat", str(repeat))
        ranks = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(3)]
    step = max(r["hmp_s"] for r in ranks), max(r["dp_s"] for r in ranks)
    lines = [f"(a, raw) 3 CPU ranks (gloo), {sum(math.prod(s.shape) for s in table()) / 1e6:.1f} M fp32 parameters, "
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
    parser.add_argument("--zero", type=int, choices=(0, 1), default=0, help="(a): the engines' ZeRO stage")
    parser.add_argument("--engine-tp-sizes", default="2,1", help="(a): TP sizes of the HMP engines' replicas; "
                        "DeepSpeed's DP engines run on as many ranks")
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)  # a rank of (a), started by --measure
    parser.add_argument("--engine-worker", choices=("dp", "hmp"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    tp_sizes = [int(t) for t in args.engine_tp_sizes.split(",")]
    if args.engine_worker:
        engine_worker(args.engine_worker, tp_sizes, args.zero, args.repeat, Path(args.worker))
        return 0
    if args.worker:
        measure_worker(args.repeat, Path(args.worker))
        return 0
    cost, work = CostModel(gpu_memory_gib=args.gpu_memory), Workload()
    lines = [*measure_engines(args.repeat, args.zero, tp_sizes), *measure(args.repeat)] if args.measure else []
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
