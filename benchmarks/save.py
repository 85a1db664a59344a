#!/usr/bin/env python
"""Training stall of a checkpoint: DeepSpeed's `engine.save_checkpoint` vs ucp's asynchronous save.

    python benchmarks/save.py [--repeat 3] [--after 4] [--dir DIR] [--markdown-out FILE]

Trains a 112.1M-parameter Llama (`transformers.LlamaConfig`, random init, no download; the same
shapes as benchmarks/convert.py) with DeepSpeed ZeRO-1 fp32 (AdamW, torch_adam) on 2 CPU
processes (torchrun, gloo), and times, with a barrier before each and the slowest rank reported:

* plain training steps (median of 2, again before each save, so a change of machine load between
  repeats does not leak into the differences);
* a step followed by `engine.save_checkpoint(dir)`: the stall is its time minus a plain step, and
  the save call's own time; DeepSpeed does not fsync, so a `sync` right after gives the time until
  its checkpoint is durable;
* a step followed by `ucp.deepspeed.save(engine, dir)`: the same two stall measures; then
  `--after` more steps run while the writers work (their extra time over plain steps is the
  background cost on shared CPU cores), then `ucp.deepspeed.wait`; *durable* is the time from the
  save call until the index is committed (data fsynced).

One untimed save of each kind first (ucp allocates its snapshot buffer and process group then).
Checkpoints are deleted and `sync` is called between measurements. Rank 0 prints the table.

With `--crc32 zlib,zlib-ng`, each round also times ucp's save with each CRC-32 implementation named
(`ucp.format.crc.use_crc32`), beside the default one (the fastest installed).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL = dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=10,
             num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=256, tie_word_embeddings=False)
SEQ_LEN = 64
SEED = 1234


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeat", type=int, default=3, help="measured saves of each kind (medians reported)")
    p.add_argument("--after", type=int, default=4, help="training steps timed while ucp's writers work")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder in /tmp)")
    p.add_argument("--markdown-out", default=None, help="also write the table as markdown here")
    p.add_argument("--crc32", metavar="NAMES", default="",
                   help="also time ucp's save with each of these CRC-32 implementations (comma-separated: isal, "
                   "zlib-ng, zlib), in the same rounds")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def launch(args: argparse.Namespace) -> int:
    folder = Path(args.dir or tempfile.mkdtemp(prefix="ucp-bench-save-"))
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TORCH_EXTENSIONS_DIR=os.path.expanduser("~/.cache/ucp/torch_extensions"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), __file__, "--worker",
           "--repeat", str(args.repeat), "--after", str(args.after), "--dir", str(folder), "--crc32", args.crc32]
    if args.markdown_out:
        cmd += ["--markdown-out", str(Path(args.markdown_out).resolve())]
    try:
        return subprocess.run(cmd, env=env).returncode
    finally:
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(args: argparse.Namespace) -> int:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import ucp.deepspeed
    from ucp.format.crc import crc32_implementation, use_crc32

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**MODEL))
    n_params = sum(p.numel() for p in model.parameters())
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, _, _, _ = ucp.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids = torch.randint(0, MODEL["vocab_size"], (1, SEQ_LEN), generator=torch.Generator().manual_seed(SEED + rank))
    ds_dir, ucp_dir = Path(args.dir) / "deepspeed", Path(args.dir) / "ucp"

    def step() -> None:
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def timed(fn) -> float:
        dist.barrier()
        began = time.perf_counter()
        fn()
        return slowest(time.perf_counter() - began)

    def step_then(save) -> tuple[float, float]:
        """(the step and the save, the save call alone), slowest rank each."""
        dist.barrier()
        began = time.perf_counter()
        step()
        stepped = time.perf_counter()
        save()
        done = time.perf_counter()
        return slowest(done - began), slowest(done - stepped)

    def plain_step() -> float:
        return statistics.median(timed(step) for _ in range(2))

    def clean() -> None:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(ds_dir, ignore_errors=True)
            shutil.rmtree(ucp_dir, ignore_errors=True)
            os.sync()
        dist.barrier()

    def ucp_save(tag: str) -> None:
        ucp.deepspeed.save(engine, ucp_dir, tag=tag)

    for _ in range(2):
        step()
    timed(lambda: (step(), ucp_save("warmup"), ucp.deepspeed.wait(engine)))
    timed(lambda: (step(), engine.save_checkpoint(str(ds_dir), tag="warmup")))
    size = sum(f.stat().st_size for f in (ucp_dir / "warmup").iterdir())
    clean()
    crcs = [crc32_implementation(), *(name for name in args.crc32.split(",") if name)]
    rows = []
    for r in range(args.repeat):
        plain = plain_step()
        total, ds_call = step_then(lambda: engine.save_checkpoint(str(ds_dir), tag=f"r{r}"))
        ds_sync = timed(os.sync)
        clean()
        row = {"plain": plain, "ds_save": total - plain, "ds_call": ds_call, "ds_durable": ds_call + ds_sync}
        for crc in crcs:
            use_crc32(crc)
            plain_ucp = plain_step()
            total_ucp, ucp_call = step_then(lambda: ucp_save(f"r{r}"))
            during = [timed(step) for _ in range(args.after)]
            durable = slowest(ucp.deepspeed.wait(engine).durable_s)
            clean()
            row |= {f"stall:{crc}": total_ucp - plain_ucp, f"ucp_call:{crc}": ucp_call,
                    f"extra:{crc}": sum(during) - plain_ucp * len(during), f"durable:{crc}": durable}
            row["plain"] += plain_ucp
        row["plain"] /= 1 + len(crcs)
        use_crc32(crcs[0])
        rows.append(row)
        if rank == 0:
            print(f"repeat {r}: " + ", ".join(f"{k} {v:.2f}s" for k, v in rows[-1].items()), flush=True)
    if rank == 0:
        med = {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        table = report(med, crcs, n_params, size, args)
        print(table)
        if args.markdown_out:
            Path(args.markdown_out).write_text(table + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(med: dict, crcs: list[str], n_params: int, size: int, args: argparse.Namespace) -> str:
    """The table: DeepSpeed's save, then ucp's with each CRC-32 implementation (the default first); the targets
    are judged on the default's."""
    import platform

    import deepspeed
    import torch

    first = crcs[0]
    stall_ok = med[f"stall:{first}"] <= 0.1 * med["ds_save"]
    durable_ok = med[f"durable:{first}"] <= med["ds_call"]

    def cells(key: str, digits: int, share_of: str | None = None) -> str:
        return " | ".join(f"{med[f'{key}:{c}']:.{digits}f} s"
                          + (f" ({100 * med[f'{key}:{c}'] / med[share_of]:.1f}%)" if share_of else "") for c in crcs)

    lines = [
        f"{n_params / 1e6:.1f}M-parameter Llama, ZeRO-1 fp32, 2 CPU ranks; ucp checkpoint {size / 2**30:.2f} GiB; "
        f"plain step {med['plain']:.2f} s; medians of {args.repeat}.",
        "",
        "| | DeepSpeed `save_checkpoint` | " + " | ".join(f"ucp async save, CRC-32 {c}" for c in crcs) + " |",
        "|---|---|" + "---|" * len(crcs),
        f"| training stall: saving step − plain step | {med['ds_save']:.2f} s | {cells('stall', 3, 'ds_save')} |",
        f"| training stall: the save call itself | {med['ds_call']:.2f} s | {cells('ucp_call', 3, 'ds_call')} |",
        f"| extra time of the next {args.after} steps (writers running) | — | {cells('extra', 2)} |",
        f"| until durable | {med['ds_call']:.2f} s in page cache, {med['ds_durable']:.2f} s with `sync` "
        f"(it does not fsync) | " + " | ".join(f"{med[f'durable:{c}']:.2f} s" for c in crcs) + " |",
        "",
        "*Until durable*, for ucp: fsynced, index committed.",
        "",
        f"* stall ≤ 10% of DeepSpeed's save ({first}): **{'PASS' if stall_ok else 'MISS'}** "
        f"({med[f'stall:{first}']:.3f} s vs {0.1 * med['ds_save']:.3f} s; save calls {med[f'ucp_call:{first}']:.3f} s "
        f"vs {0.1 * med['ds_call']:.3f} s)",
        f"* durable ≤ DeepSpeed's save time ({first}): **{'PASS' if durable_ok else 'MISS'}** "
        f"({med[f'durable:{first}']:.2f} s vs {med['ds_call']:.2f} s; vs DeepSpeed's save + sync: "
        f"{med['ds_durable']:.2f} s)",
        "",
        f"Machine: {os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, load average "
        f"{os.getloadavg()[0]:.1f}; torch {torch.__version__}, deepspeed {deepspeed.__version__}; "
        f"{time.strftime('%Y-%m-%d')}.",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    return worker(args) if args.worker else launch(args)


if __name__ == "__main__":
    sys.exit(main())
