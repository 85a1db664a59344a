#!/usr/bin/env python
"""Goodput at scale, on paper: ucp's measured recovery parts carried to 1,024-16,384 GPUs (issue #42).

    python benchmarks/goodput.py [--gpus 1024 4096 16384] [--replace-min 30] [--disk-every-min 30]
                                 [--days 54] [--seed 0] [--markdown-out FILE]

Goodput is useful training time over wall time: time at a reduced size counts at that size's share of the
full job's tokens/s, and a save's blocked time, the time to detect a fault, to restart or regroup, to load
and the work redone count as lost. Four ways to recover, each from the parts measured for it on this 2-core
CPU machine with small models (benchmarks/README.md: Peers, Tiers, Save, Load, Convert; the in-process
restart's report), and the same job, GPUs and faults:

* ucp_inprocess: `ucp.elastic.run`; the survivors keep their processes: detection + regroup + engine rebuild
  + load from the memory tier (peer copies) + the work redone; it trains on at the size that is left. A node
  that joins later restarts the processes under ucp-torchrun today, so its grow is ucp_restart's. In process
  today: ZeRO-1/3 and AutoTP on gloo; the cost model's TP x PP and HMP plans in process are assumed here (#42).
* ucp_restart: today's elastic path: every process relaunched (imports, process group, model, DeepSpeed's
  initialize), `"load": "auto"` from the memory tier, at the size that is left.
* dlrover: a DLRover-style restart at the same size: it waits for replacement hardware, then restarts and
  loads from its node-local shared memory (from disk where the lost node held it).
* deepspeed: a restart from disk at the new size: `ds_to_universal` over the whole checkpoint, then a job with
  `"load_universal": true`; whole replicas dropped; and the same again when the hardware is back.

Step times and sizes after a loss come from ucp's cost model (`ucp.hmp.strategy.search`, what `ucp plan`
runs): an HMP plan on exactly the GPUs left, or the full plan less the replicas that lost a GPU, whichever the
model finds faster. Everything is arithmetic: no torch, no GPU; every number is printed beside its source.
"""
from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass, fields
from pathlib import Path

from ucp.hmp.model_shapes import ModelConfig, load_model_config
from ucp.hmp.strategy import CostModel, Workload, search

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ("ucp_inprocess", "ucp_restart", "dlrover", "deepspeed")
CASES = ("gpu", "node", "hung", "back")
CASE_NAMES = {"gpu": "one GPU lost", "node": "a node lost", "hung": "one rank hung", "back": "hardware back"}
GPUS_PER_NODE = 8
MB = 1e6
GB = 1e9

# Llama 2 70B's published config (Hugging Face meta-llama/Llama-2-70b-hf): 80 layers, hidden 8192, GQA 64/8 heads.
LLAMA2_70B = ModelConfig("llama2-70b", hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                         num_kv_heads=8, vocab_size=32000)

# Llama 3 paper (Llama Team, AI @ Meta, "The Llama 3 Herd of Models", arXiv:2407.21783, 2024, section 3.3.4): 419
# unexpected interruptions in a 54-day snapshot of pre-training on 16,384 H100 GPUs (466 in all, 47 planned).
LLAMA3_UNEXPECTED = 419
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16384
MTBF_GPU_S = LLAMA3_DAYS * 86400 * LLAMA3_GPUS / LLAMA3_UNEXPECTED  # about 50,677 GPU-hours a fault

ELASTOR_SPEEDUP = (1.12, 1.40)  # Elastor's end-to-end speed-up under failure traces, as issue #42 quotes it


@dataclass(frozen=True)
class Parts:
    """Every number the goodput is made of. MEASURED's values come from benchmarks/README.md; SOURCES says where."""

    # ucp in-process (`ucp.elastic.run`), its report on this machine, tiny model, 2 cores
    detect_dead_s: float = 1.8          # a dead peer: the failed collective
    detect_hung_s: float = 15.0         # a hung rank: `"elastic": {"detect_s"}`'s default
    regroup_s: float = 3.3
    engine_inprocess_s: float = 0.9
    inprocess_steps_redone: float = 0.0
    # process restarts, fault -> new process (detection by the launcher + relaunch)
    relaunch_ucp_s: float = 1.09        # one worker killed, torchrun's agent
    relaunch_dlrover_s: float = 0.59    # one worker killed, dlrover-run's agent
    relaunch_node_s: float = 22.3       # a node lost (its agent killed): torchrun agents, detection + relaunch
    hung_timeout_s: float = 600.0       # a hung rank under a restart: DeepSpeed's default_pg_timeout
    # start-up after the relaunch: imports + rendezvous + model + engine init
    startup_ucp_s: float = 7.96 + 0.12 + 2.33 + 4.37
    startup_dlrover_s: float = 9.38 + 0.79 + 2.04 + 3.84
    startup_deepspeed_s: float = 6.60 + 0.61 + 1.48 + 3.27
    restart_steps_redone: float = 1.0   # ucp's memory tier under a restart: the save in flight at the kill
    # per-byte rates (per rank)
    memory_load_bps: float = 1345 * MB / 4 / 2.42     # ucp's memory-tier load, CRC-32s checked
    dlrover_load_bps: float = 1793 * MB / 4 / 0.70    # DLRover's load from its agent's shared memory
    universal_load_bps: float = 2576 * 2**20 / 2 / 2.80  # DeepSpeed's load_universal
    memory_save_bps: float = 1345 * MB / 4 / 0.20     # ucp's memory save, blocked part
    dlrover_save_bps: float = 1793 * MB / 4 / 0.35    # DLRover's memory save, blocked part
    async_save_bps: float = 1.25 * 2**30 / 2 / 0.064  # ucp's async disk save call
    deepspeed_save_bps: float = 1.67 * 2**30 / 2 / 2.81  # DeepSpeed's save_checkpoint, all blocked
    convert_bps: float = 1.67 * 2**30 / 10.47         # ds_to_universal, 2 workers
    # assumed, not measured
    ucp_bytes_per_param: float = 12.0       # fp32 masters + Adam's two moments (measured 1345 MB for 112.1M)
    deepspeed_bytes_per_param: float = 16.0  # and the bf16 weights (measured 1793 MB for 112.1M)
    convert_speedup: float = 16.0           # ds_to_universal on one 32-worker host: 16x its 2-worker rate
    storage_bps: float = 1e12               # shared file system, aggregate read/write
    replace_s: float = 30 * 60.0            # until replacement hardware (a spare, the node repaired) is there
    disk_every_s: float = 30 * 60.0         # the disk saves beside the memory tier (ucp, DLRover)
    step_in_flight: float = 0.5             # a fault lands mid-step: half a step lost on average
    mtbf_gpu_s: float = MTBF_GPU_S          # one fault per this many GPU-seconds


MEASURED = Parts()
HERE = "measured on this 2-core CPU machine"
SOURCES = {
    "detect_dead_s": f"{HERE}: ucp.elastic.run's report, tiny model (`detection 1.8 s`)",
    "detect_hung_s": "ucp's default `elastic.detect_s` (issue #42)",
    "regroup_s": f"{HERE}: the same report (`regroup 3.3 s`, 4 ranks); held at this value at any scale",
    "engine_inprocess_s": f"{HERE}: the same report (`engine 0.9 s`, tiny model); held at any model size",
    "inprocess_steps_redone": f"{HERE}: the same report (0 steps redone, memory save every step)",
    "relaunch_ucp_s": f"{HERE}: Peers 2026-12-04, ucp_memory same size, relaunch",
    "relaunch_dlrover_s": f"{HERE}: Peers 2026-12-04, dlrover same size, relaunch",
    "relaunch_node_s": f"{HERE}: Tiers, recovery from the memory tier (detection + relaunch, 112M, under load)",
    "hung_timeout_s": "DeepSpeed 0.19.8's default_pg_timeout (deepspeed/constants.py, DEEPSPEED_TIMEOUT=10 min)",
    "startup_ucp_s": f"{HERE}: Peers 2026-12-04, ucp_memory: imports 7.96 + rendezvous 0.12 + model 2.33 + "
                     "engine init 4.37 s (112M, 4 ranks); held at any scale",
    "startup_dlrover_s": f"{HERE}: Peers 2026-12-04, dlrover: 9.38 + 0.79 + 2.04 + 3.84 s",
    "startup_deepspeed_s": f"{HERE}: Peers 2026-12-04, the universal job: 6.60 + 0.61 + 1.48 + 3.27 s",
    "restart_steps_redone": f"{HERE}: Peers and Tiers, ucp's memory tier after a restart (1 step redone)",
    "memory_load_bps": f"{HERE}: Peers, ucp_memory load 2.42 s for 1345 MB / 4 ranks",
    "dlrover_load_bps": f"{HERE}: Peers, dlrover load 0.70 s for 1793 MB / 4 ranks",
    "universal_load_bps": f"{HERE}: Load, stock load_universal 2.80 s for 2576 MiB on 2 ranks",
    "memory_save_bps": f"{HERE}: Peers 2026-12-03, ucp_memory blocked 0.20 s for 1345 MB / 4 ranks",
    "dlrover_save_bps": f"{HERE}: Peers 2026-12-03, dlrover blocked 0.35 s for 1793 MB / 4 ranks",
    "async_save_bps": f"{HERE}: Save 2026-12-01, ucp's save call 0.064 s for 1.25 GiB / 2 ranks",
    "deepspeed_save_bps": f"{HERE}: Save 2026-12-01, save_checkpoint 2.81 s for 1.67 GiB / 2 ranks",
    "convert_bps": f"{HERE}: Convert, ds_to_universal 10.47 s for 1.67 GiB, 2 workers",
    "ucp_bytes_per_param": "assumed from the measured 1345 MB for 112.1M parameters",
    "deepspeed_bytes_per_param": "assumed from the measured 1793 MB for 112.1M parameters",
    "convert_speedup": "assumed: 32 workers on one host scale the 2-worker rate linearly",
    "storage_bps": "assumed: 1 TB/s aggregate shared file system",
    "replace_s": "assumed: replacement hardware arrives 30 min after a loss (the trace's `back`)",
    "disk_every_s": "assumed: ucp and DLRover also save to disk every 30 min (DLRover restarts a lost node from it)",
    "step_in_flight": "assumed: a fault lands mid-step on average",
    "mtbf_gpu_s": "Llama 3 paper (arXiv:2407.21783, section 3.3.4): 419 unexpected interruptions in 54 days on "
                  "16,384 H100s; it also sets each tool's save interval (Young's optimum, below)",
}


@dataclass(frozen=True)
class Job:
    """A training job on `gpus` GPUs, with what the cost model says of it and of it after a loss."""

    model: str
    params: float
    gpus: int
    step_s: float
    dp: int                  # replicas of the full plan
    share_lost_gpu: float    # tokens/s after one GPU is lost, over the full job's (HMP or fewer replicas)
    share_lost_node: float
    share_fewer_replicas: float  # the full plan less one replica: DeepSpeed's homogeneous restart

    def share_after(self, tool: str, case: str) -> float:
        if tool == "deepspeed":
            return self.share_fewer_replicas
        return self.share_lost_node if case == "node" else self.share_lost_gpu


@dataclass(frozen=True)
class Recovery:
    """What one fault costs a tool, in seconds of the full job's training (each part's own name)."""

    detect_s: float = 0.0
    wait_s: float = 0.0        # idle until replacement hardware is there (same-size restarts)
    restart_s: float = 0.0     # regroup + engine (in process), or relaunch + start-up
    convert_s: float = 0.0
    load_s: float = 0.0
    redone_s: float = 0.0      # work lost: steps redone and the step in flight
    degraded_s: float = 0.0    # until the hardware is back, the share of the full job's tokens/s not trained
    grow_s: float = 0.0        # back to the full size when the hardware is back

    @property
    def lost_s(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


def ucp_bytes_per_gpu(job: Job, parts: Parts) -> float:
    """ucp's checkpoint bytes a GPU loads: each byte is read once across the job (Load: 0.50 of stock at 2 ranks)."""
    return parts.ucp_bytes_per_param * job.params / job.gpus


def disk_load_s(job: Job, parts: Parts) -> float:
    """DeepSpeed's load_universal: every rank reads its model part's whole state, not 1/DP of it (Load: 2576 MiB
    read on 2 ranks where ucp reads 1283), bound by its own rate or the shared file system's."""
    per_rank = parts.ucp_bytes_per_param * job.params * job.dp / job.gpus
    return max(per_rank / parts.universal_load_bps, per_rank * job.gpus / parts.storage_bps)


def convert_s(job: Job, parts: Parts) -> float:
    return parts.deepspeed_bytes_per_param * job.params / (parts.convert_bps * parts.convert_speedup)


def deepspeed_save_s(job: Job, parts: Parts) -> float:
    total = parts.deepspeed_bytes_per_param * job.params
    return max(total / job.gpus / parts.deepspeed_save_bps, total / parts.storage_bps)


def blocked_per_save_s(tool: str, job: Job, parts: Parts = MEASURED) -> float:
    """Training blocked by one save: ucp's and DLRover's into memory (the snapshot copy), DeepSpeed's to disk."""
    if tool in ("ucp_inprocess", "ucp_restart"):
        return ucp_bytes_per_gpu(job, parts) / parts.memory_save_bps
    if tool == "dlrover":
        return parts.deepspeed_bytes_per_param * job.params / job.gpus / parts.dlrover_save_bps
    return deepspeed_save_s(job, parts)


def save_interval_s(tool: str, job: Job, parts: Parts = MEASURED) -> float:
    """Young's optimum checkpoint interval, sqrt(2 x blocked per save x the job's MTBF) (J. W. Young, "A first order
    approximation to the optimum checkpoint interval", CACM 17(9), 1974), in whole steps, at least one."""
    young = math.sqrt(2 * blocked_per_save_s(tool, job, parts) * parts.mtbf_gpu_s / job.gpus)
    return max(1, round(young / job.step_s)) * job.step_s


def recovery(tool: str, case: str, job: Job, parts: Parts = MEASURED) -> Recovery:
    """One fault of `case` ("gpu", "node", "hung") and its hardware back `parts.replace_s` later, or the grow alone
    ("back"), for `tool`. Work redone: the step in flight, and half the steps since the last save (none with a
    save every step, as measured in process)."""
    if tool not in TOOLS or case not in CASES:
        raise ValueError(f"tool {tool!r} / case {case!r}: expected one of {TOOLS} / {CASES}")
    since_save = (save_interval_s(tool, job, parts) - job.step_s) / 2
    in_flight = parts.step_in_flight * job.step_s
    memory_load = ucp_bytes_per_gpu(job, parts) / parts.memory_load_bps
    if tool == "ucp_inprocess":
        # a node that joins restarts every process under ucp-torchrun today (README, "ucp.elastic.run"): the grow
        # is the process restart's
        grow = parts.startup_ucp_s + memory_load
        if case == "back":
            return Recovery(grow_s=grow)
        detect = parts.detect_hung_s if case == "hung" else parts.detect_dead_s
        part = Recovery(detect_s=detect, restart_s=parts.regroup_s + parts.engine_inprocess_s, load_s=memory_load,
                        redone_s=in_flight + since_save + parts.inprocess_steps_redone * job.step_s)
    elif tool == "ucp_restart":
        grow = parts.startup_ucp_s + memory_load
        if case == "back":
            return Recovery(grow_s=grow)
        detect = {"gpu": parts.relaunch_ucp_s, "node": parts.relaunch_node_s, "hung": parts.hung_timeout_s}[case]
        part = Recovery(detect_s=detect, restart_s=parts.startup_ucp_s, load_s=memory_load,
                        redone_s=in_flight + since_save + parts.restart_steps_redone * job.step_s)
    elif tool == "dlrover":
        if case == "back":
            return Recovery()  # it waited for the hardware: already at the full size
        detect = {"gpu": parts.relaunch_dlrover_s, "node": parts.relaunch_node_s, "hung": parts.hung_timeout_s}[case]
        load = parts.deepspeed_bytes_per_param * job.params / job.gpus / parts.dlrover_load_bps
        # its memory copy is node-local: a lost node's is gone, so that node's ranks restart from disk
        redone = in_flight + (parts.disk_every_s / 2 if case == "node" else since_save)
        return Recovery(detect_s=detect, wait_s=max(0.0, parts.replace_s - detect),
                        restart_s=parts.startup_dlrover_s, load_s=load, redone_s=redone)
    else:  # deepspeed
        grow = (deepspeed_save_s(job, parts) + convert_s(job, parts) + parts.startup_deepspeed_s
                + disk_load_s(job, parts))
        if case == "back":
            return Recovery(grow_s=grow)
        detect = {"gpu": parts.relaunch_ucp_s, "node": parts.relaunch_node_s, "hung": parts.hung_timeout_s}[case]
        part = Recovery(detect_s=detect, restart_s=parts.startup_deepspeed_s, convert_s=convert_s(job, parts),
                        load_s=disk_load_s(job, parts), redone_s=in_flight + since_save)
    down = part.lost_s
    degraded = max(0.0, parts.replace_s - down) * (1.0 - job.share_after(tool, case))
    return Recovery(part.detect_s, part.wait_s, part.restart_s, part.convert_s, part.load_s, part.redone_s,
                    degraded, grow)


def fault_to_training_s(r: Recovery) -> float:
    """Fault to the first step after it: the job is idle for this long."""
    return r.detect_s + r.wait_s + r.restart_s + r.convert_s + r.load_s


def save_stall_share(tool: str, job: Job, parts: Parts = MEASURED) -> float:
    """Blocked save time over wall time with no fault: one save per `save_interval_s`, and for ucp and DLRover a
    disk save every `disk_every_s` besides (ucp's asynchronous save call; DLRover's copy into shared memory)."""
    blocked = blocked_per_save_s(tool, job, parts)
    share = blocked / (save_interval_s(tool, job, parts) + blocked)
    if tool in ("ucp_inprocess", "ucp_restart"):
        share += ucp_bytes_per_gpu(job, parts) / parts.async_save_bps / parts.disk_every_s
    elif tool == "dlrover":
        share += blocked / parts.disk_every_s
    return share


def failure_trace(gpus: int, horizon_s: float, seed: int, mtbf_gpu_s: float = MTBF_GPU_S) -> tuple[float, ...]:
    """Fault times in [0, horizon_s): a Poisson process of rate gpus / mtbf_gpu_s, seeded, so reproducible."""
    rng, t, out = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(gpus / mtbf_gpu_s)
        if t >= horizon_s:
            return tuple(out)
        out.append(t)


def goodput(tool: str, faults: int, case: str, horizon_s: float, job: Job, parts: Parts = MEASURED) -> float:
    """Useful training time over wall time: `faults` faults of `case` (each with its hardware back) in
    `horizon_s`, counted one by one (overlaps ignored), and the saves' blocked share of what is left."""
    lost = faults * recovery(tool, case, job, parts).lost_s
    return (1.0 - save_stall_share(tool, job, parts)) * max(0.0, 1.0 - lost / horizon_s)


def plan_job(model: ModelConfig, gpus: int, cost: CostModel, work: Workload) -> Job:
    """The job's step and its shares after a loss, from `ucp.hmp.strategy.search` (the cost model of `ucp plan`)."""
    full = search(model, gpus, cost, work, top=1).plans[0]

    def share_after(lost: int) -> float:
        hmp = search(model, gpus - lost, cost, work, top=1).plans[0].tokens_per_s / full.tokens_per_s
        # ucp loads at any layout: an HMP plan on exactly the GPUs left, or a replica fewer; never above the full job
        return min(1.0, max(hmp, fewer))

    fewer = (full.dp - 1) / full.dp  # micro-batches spread over the replicas left, bubble and sync unchanged
    return Job(model.name, float(model.num_params), gpus, full.step_time_s, full.dp, share_after(1),
               share_after(GPUS_PER_NODE), fewer)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--models", nargs="+", default=["llama2-7b", "llama2-13b", "llama2-70b"])
    parser.add_argument("--replace-min", type=float, default=30.0)
    parser.add_argument("--disk-every-min", type=float, default=30.0)
    parser.add_argument("--days", type=float, default=float(LLAMA3_DAYS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown-out", metavar="FILE")
    return parser.parse_args(argv)


def load_model(name: str) -> ModelConfig:
    return LLAMA2_70B if name == "llama2-70b" else load_model_config(ROOT / "examples" / "models" / f"{name}.json")


def report(args: argparse.Namespace) -> str:
    parts = Parts(replace_s=args.replace_min * 60, disk_every_s=args.disk_every_min * 60)
    cost = CostModel(gpu_memory_gib=80.0, peak_tflops=989.0)
    work = Workload(global_batch=1024, seq_len=4096, micro_batch_size=4)
    horizon = args.days * 86400
    lines = ["Assumptions and measured parts (each number with its source):", ""]
    for f in fields(Parts):
        value = getattr(parts, f.name)
        source = SOURCES[f.name]
        if f.name in ("replace_s", "disk_every_s"):
            source = source.replace("30 min", f"{value / 60:g} min")
        lines.append(f"* {f.name} = {value:,.4g}: {source}")
    lines += [f"* GPUs: {cost.gpu_memory_gib:g} GiB, {cost.peak_tflops:g} TFLOP/s dense bf16 (H100 SXM), mfu "
              f"{cost.mfu:g}, {GPUS_PER_NODE} a node; global batch {work.global_batch} x {work.seq_len} tokens "
              f"(Llama 2's 4M), micro-batch {work.micro_batch_size}: ucp's cost model (ucp/hmp/strategy.py), "
              "an estimate, not a measurement",
              f"* MTBF trace: one fault per {MTBF_GPU_S / 3600:,.0f} GPU-hours, from the Llama 3 paper (arXiv:"
              f"2407.21783, section 3.3.4: {LLAMA3_UNEXPECTED} unexpected interruptions in {LLAMA3_DAYS} days on "
              f"{LLAMA3_GPUS:,} H100s); assumed: each takes out its node until the hardware is back; "
              f"{args.days:g} days, seed {args.seed}; faults counted one by one (overlaps ignored)",
              f"* Elastor reports {ELASTOR_SPEEDUP[0]:.2f}-{ELASTOR_SPEEDUP[1]:.2f}x end to end under failure traces "
              "(as issue #42 quotes it)", ""]
    cases = ["| model | GPUs | case | " + " | ".join(f"{t}: down / lost (s)" for t in TOOLS) + " |",
             "|---|---:|---|" + "---:|" * len(TOOLS)]
    table = ["| model | GPUs | step (s) | faults | saves every (s): ucp / dlrover / deepspeed | node lost: ucp / "
             "deepspeed tokens/s | " + " | ".join(TOOLS) + " | in-process / restart | in-process / dlrover | "
             "in-process / deepspeed |", "|---|---:|---:|---:|---:|---:|" + "---:|" * (len(TOOLS) + 3)]
    for name in args.models:
        model = load_model(name)
        for gpus in args.gpus:
            job = plan_job(model, gpus, cost, work)
            for case in CASES:
                cells = []
                for tool in TOOLS:
                    r = recovery(tool, case, job, parts)
                    cells.append(f"{fault_to_training_s(r):,.1f} / {r.lost_s:,.1f}")
                cases.append(f"| {name} | {gpus:,} | {CASE_NAMES[case]} | " + " | ".join(cells) + " |")
            faults = len(failure_trace(gpus, horizon, args.seed, parts.mtbf_gpu_s))
            g = {tool: goodput(tool, faults, "node", horizon, job, parts) for tool in TOOLS}
            every = " / ".join(f"{save_interval_s(t, job, parts):,.0f}" for t in TOOLS[1:])
            table.append(f"| {name} | {gpus:,} | {job.step_s:.2f} | {faults} | {every} | "
                         f"{job.share_lost_node:.3f} / {job.share_fewer_replicas:.3f} | "
                         + " | ".join(f"{g[t]:.4f}" for t in TOOLS) + " | "
                         + " | ".join(f"{g['ucp_inprocess'] / g[t]:.3f}x" for t in TOOLS[1:]) + " |")
    return "\n".join(lines + [f"Per fault ({parts.replace_s / 60:g} min until the hardware is back; down: fault "
                              "to the first step; lost: seconds of the full job's training lost, grow included):",
                              ""] + cases + ["", "Goodput under the MTBF trace (node faults):", ""] + table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    text = report(args)
    print(text)
    if args.markdown_out:
        Path(args.markdown_out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
