#!/usr/bin/env python
"""Benchmark: loading one checkpoint on N ranks — stock `load_universal` vs ucp, bypass off and on.

    python benchmarks/load.py [--ranks 2 3] [--cache DIR] [--markdown-out FILE]

Builds (once, cached) a ZeRO-3 checkpoint of the ~112M-parameter benchmark Llama on 2 ranks,
converts it with `ucp convert` (atomic format) and `ucp convert --format deepspeed` (DeepSpeed's
universal layout), then loads it into a ZeRO-3 engine on N ranks with each tool, and with ucp
straight from the DeepSpeed checkpoint (no conversion). ZeRO-3 is the
target because there every rank holds a part of every parameter, which is where stock
`load_universal` makes each rank read every file whole. Prints wall time of the load (barrier to
barrier), bytes read and read calls summed over ranks (/proc/self/io: rchar, syscr), and peak RSS
per rank, with the ratios the project targets: ucp-with-bypass bytes = 1/N of stock's, wall time
≤ stock's.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def env() -> dict:
    e = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    e.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/ucp/torch_extensions"))
    return e


def torchrun(script: Path, args: list[str], nproc: int, log: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(port), str(script), *args]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, env=env(), stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"{script.name} failed (exit {rc}); see {log}")


def build(cache: Path) -> tuple[Path, Path, Path]:
    """The ZeRO-3 source checkpoint (DeepSpeed's save dir, trained once and cached) and its conversions to both
    formats, made again on every run so that they are this ucp's (an older atomic checkpoint has no chunk
    checksums, and a rank then reads whole tensors to check them)."""
    root = cache / "load-zero3"
    atomic, universal = root / "atomic", root / "universal" / "global_step1"
    if not (root / ".done").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        print("building a ZeRO-3 checkpoint of the benchmark Llama on 2 ranks (once) ...", flush=True)
        torchrun(HERE / "_train_llama.py", [str(root / "deepspeed"), "--stage", "3"], 2, root / "train.log")
        (root / ".done").touch()
    for stale in (atomic, universal.parent):
        shutil.rmtree(stale, ignore_errors=True)
    for fmt, out in (("ucp", atomic), ("deepspeed", universal)):
        subprocess.run(["ucp", "convert", "--input", str(root / "deepspeed"), "--output", str(out),
                        "--format", fmt, "--quiet"], check=True, env=env())
    return atomic, universal, root / "deepspeed"


def run(mode: str, path: Path, nproc: int, work: Path) -> list[dict]:
    out = work / f"{mode}-{nproc}.json"
    torchrun(HERE / "_load_llama.py", ["--mode", mode, "--path", str(path), "--out", str(out)], nproc,
             work / f"{mode}-{nproc}.log")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--cache", type=Path, default=Path(os.path.expanduser("~/.cache/ucp-bench")))
    parser.add_argument("--markdown-out", type=Path)
    parser.add_argument("--splits", action="store_true",
                        help="instead, split-driven loading under layout changes (benchmarks/load_splits.py): bytes "
                        "and read calls of ucp.hmp.load_slices vs whole-tensor reads, as stock load_universal does")
    args = parser.parse_args()
    if args.splits:
        import load_splits

        sys.exit(load_splits.main(["--markdown-out", str(args.markdown_out)] if args.markdown_out else []))
    atomic, universal, source = build(args.cache)
    work = Path(tempfile.mkdtemp(prefix="ucp-load-bench-"))
    rows = []
    for n in args.ranks:
        results = {}
        for mode, path in (("stock", universal), ("ucp-no-bypass", atomic), ("ucp", atomic),
                           ("ucp-no-conversion", source)):
            ranks = run(mode, path, n, work)
            results[mode] = {"wall_s": max(r["wall_s"] for r in ranks),
                             "bytes_read": sum(r["bytes_read"] for r in ranks),
                             "read_calls": sum(r["read_calls"] for r in ranks),
                             "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
                             # read only to check CRC-32s: whole chunks around partial reads, rank-file entries
                             "check_bytes": sum(r.get("bytes_checked_extra", 0) + r.get("bytes_checked_sources", 0)
                                                for r in ranks)}
        for mode, r in results.items():
            rows.append((n, mode, r, r["bytes_read"] / results["stock"]["bytes_read"],
                         r["wall_s"] / results["stock"]["wall_s"],
                         (r["bytes_read"] - r["check_bytes"]) / results["stock"]["bytes_read"]))
    atomic_bytes = sum(f.stat().st_size for f in atomic.glob("*.safetensors"))
    header = ("| ranks | tool | load wall (s) | bytes read (all ranks) | of which only to check CRCs | read calls "
              "| peak RSS/rank (MiB) | bytes vs stock | without the checks | wall vs stock |")
    lines = [header, "|" + "---|" * 10]
    for n, mode, r, bytes_ratio, wall_ratio, share_ratio in rows:
        lines.append(f"| {n} | {mode} | {r['wall_s']:.2f} | {r['bytes_read'] / 2**20:.0f} MiB | "
                     f"{r['check_bytes'] / 2**20:.0f} MiB | {r['read_calls']} | {r['peak_rss_mib']:.0f} | "
                     f"{bytes_ratio:.2f} | {share_ratio:.2f} | {wall_ratio:.2f} |")
    verdicts = []
    for n in args.ranks:
        for mode in ("ucp", "ucp-no-conversion"):
            ucp_row = next(r for r in rows if r[0] == n and r[1] == mode)
            verdicts.append(f"N={n}: {mode} bytes / stock = {ucp_row[3]:.3f}, {ucp_row[5]:.3f} without the reads "
                            f"only made to check CRC-32s (target 1/{n} = {1 / n:.3f}: "
                            f"{'PASS' if ucp_row[3] <= 1 / n * 1.05 else 'MISS'} with them, "
                            f"{'PASS' if ucp_row[5] <= 1 / n * 1.05 else 'MISS'} without); wall / stock = "
                            f"{ucp_row[4]:.2f} (target ≤ 1: {'PASS' if ucp_row[4] <= 1 else 'MISS'})")
    import deepspeed
    import torch

    text = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d')} on {os.cpu_count()} cores, {platform.machine()}, torch "
        f"{torch.__version__}, deepspeed {deepspeed.__version__}; ZeRO-3 target, checkpoint of "
        f"{atomic_bytes / 2**30:.2f} GiB (atomic), page cache warm.", "", *lines, "", *verdicts])
    print(text)
    if args.markdown_out:
        args.markdown_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
