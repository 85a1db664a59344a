#!/usr/bin/env python
"""One load of the benchmark Llama under torchrun, timed and counted on every rank.

    torchrun --nproc_per_node N benchmarks/_load_llama.py --mode MODE --path P --out F

`stock` loads DeepSpeed's universal layout with `load_universal`; the ucp modes (`ucp`,
`ucp-no-bypass`) load the atomic checkpoint through `ucp.deepspeed.load`, and `ucp-no-conversion`
(`ucp-no-conversion-zero1`: of a ZeRO-1 source) the DeepSpeed checkpoint itself. Bytes and read calls come
from /proc/self/io (rchar, syscr), so all tools are measured the same way, page-cache hits included. Memory:
peak RSS over the process's life (`ru_maxrss`), and the engine's own footprint (VmRSS just before the load, and of
it RssAnon and RssFile: the resident pages of mapped libraries vary from run to run with the machine's other
memory use) with the peak during the load alone (VmHWM, reset before the load through /proc/self/clear_refs), so
that what the load itself holds shows, and VmRSS after the load (the engine with the optimizer states the load
created), so that what it held only while it ran shows.
"""
import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _train_llama import MODELS  # noqa: E402


def proc_io() -> dict:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def vm_mib(field: str) -> float:
    """VmRSS (resident now), VmHWM (its peak since the last reset), RssAnon or RssFile of this process, in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024


def reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux 4.0+: "5" to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["stock", "ucp", "ucp-no-bypass", "ucp-no-conversion",
                                                     "ucp-no-conversion-zero1"], required=True)
    parser.add_argument("--path", required=True, help="stock: the universal tag folder; ucp: the atomic dir; "
                        "ucp-no-conversion(-zero1): DeepSpeed's save dir")
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--model", choices=sorted(MODELS), default="112m")
    parser.add_argument("--check-keep-bytes", type=int, help="ucp modes: check_keep_bytes (default: ucp's own)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import deepspeed
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import ucp.deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**MODELS[args.model]))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": args.stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "steps_per_print": 10 ** 9}
    if args.mode == "stock":
        config["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dist.barrier()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engine_rss, engine_anon, engine_file = vm_mib("VmRSS"), vm_mib("RssAnon"), vm_mib("RssFile")
    reset_peak()
    io_before = proc_io()
    start = time.perf_counter()
    if args.mode == "stock":
        path = Path(args.path)
        engine.load_checkpoint(str(path.parent), tag=path.name)
    else:
        keep = {} if args.check_keep_bytes is None else {"check_keep_bytes": args.check_keep_bytes}
        ucp.deepspeed.load(engine, args.path, bypass=args.mode != "ucp-no-bypass", **keep)
    dist.barrier()
    wall = time.perf_counter() - start
    io_after = proc_io()
    load_peak, loaded_rss = vm_mib("VmHWM"), vm_mib("VmRSS")
    mine = {"wall_s": wall, "bytes_read": io_after["rchar"] - io_before["rchar"],
            "read_calls": io_after["syscr"] - io_before["syscr"],
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "rss_before_mib": rss_before / 1024, "engine_rss_mib": engine_rss, "engine_anon_mib": engine_anon,
            "engine_file_mib": engine_file, "load_peak_rss_mib": load_peak,
            "loaded_rss_mib": loaded_rss}
    stats = getattr(engine, "ucp_load_stats", None)
    if stats is not None:
        mine.update(ucp_bytes_read=stats.bytes_read, ucp_read_calls=stats.read_calls,
                    bytes_broadcast=stats.bytes_broadcast, bytes_checked_extra=stats.bytes_checked_extra,
                    bytes_checked_sources=stats.bytes_checked_sources, bytes_read_again=stats.bytes_read_again,
                    bytes_exchanged=stats.bytes_exchanged)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(everyone))
    ucp.deepspeed.finish()  # measured and written: leave with exit 0 (docs/RELIABILITY.md, exit aborts)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
