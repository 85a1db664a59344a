#!/usr/bin/env python
"""Benchmark: loading one checkpoint on N ranks — stock `load_universal` vs ucp, from a ucp checkpoint and
straight from DeepSpeed's files.

    python benchmarks/load.py [--ranks 2 3] [--model 112m 359m] [--cache DIR] [--markdown-out FILE]
    python benchmarks/load.py --ranks 2 --modes stock ucp-no-conversion-zero1   # issue #32's case

Builds (once, cached) a ZeRO-3 checkpoint of the benchmark Llama (112M, or 359M parameters) on 2 ranks,
converts it with `ucp convert` (atomic format) and `ucp convert --format deepspeed` (DeepSpeed's
universal layout), then loads it into a ZeRO-3 engine on N ranks with each tool, and with ucp
straight from the DeepSpeed checkpoint (no conversion); `--modes ucp-no-conversion-zero1` adds a load straight from a
ZeRO-1 checkpoint of the same Llama saved on 2 ranks (a ZeRO-1 dp2 -> ZeRO-3 dpN resume, against the same stock row:
DeepSpeed's own path to a ZeRO-3 layout, since its `load_universal` cannot cross ZeRO-1 -> 3). ZeRO-3 is the
target because there every rank holds a part of every parameter, which is where stock
`load_universal` makes each rank read every file whole. Prints wall time of the load (barrier to
barrier); bytes read and read calls summed over ranks (/proc/self/io: rchar, syscr), and of them what ucp
read only for its checks and what it read a second time (beyond `check_keep_bytes`); the bytes each rank
exchanged for the checks; peak RSS per rank, the load's peak above the engine before it, and of that what
was gone once the load ended; with the ratios the project targets: bytes = 1/N of stock's, checks <= 2% of
the load's bytes, wall and peak RSS <= stock's.
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


def trained_once(cache: Path, stage: int, model: str) -> Path:
    """The folder holding a ZeRO-`stage` checkpoint of `model` saved on 2 ranks (`deepspeed/`), trained on the
    first call and cached."""
    root = cache / (f"load-zero{stage}" if model == "112m" else f"load-zero{stage}-{model}")
    if not (root / ".done").exists():
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        print(f"building a ZeRO-{stage} checkpoint of the {model} benchmark Llama on 2 ranks (once) ...", flush=True)
        torchrun(HERE / "_train_llama.py", [str(root / "deepspeed"), "--stage", str(stage), "--model", model], 2,
                 root / "train.log")
        (root / ".done").touch()
    return root


def zero1_source(cache: Path, model: str) -> Path:
    """A ZeRO-1 checkpoint of `model`, for `ucp-no-conversion-zero1`."""
    return trained_once(cache, 1, model) / "deepspeed"


def build(cache: Path, model: str) -> tuple[Path, Path, Path]:
    """The ZeRO-3 source checkpoint of `model` (DeepSpeed's save dir, trained once and cached) and its conversions
    to both formats, made again on every run so that they are this ucp's (an older atomic checkpoint has no chunk
    checksums, and a rank then reads whole tensors to check them)."""
    root = trained_once(cache, 3, model)
    atomic, universal = root / "atomic", root / "universal" / "global_step1"
    for stale in (atomic, universal.parent):
        shutil.rmtree(stale, ignore_errors=True)
    for fmt, out in (("ucp", atomic), ("deepspeed", universal)):
        subprocess.run(["ucp", "convert", "--input", str(root / "deepspeed"), "--output", str(out),
                        "--format", fmt, "--quiet"], check=True, env=env())
    return atomic, universal, root / "deepspeed"


def run(mode: str, path: Path, nproc: int, model: str, work: Path, keep: int | None) -> list[dict]:
    out = work / f"{model}-{mode}-{nproc}.json"
    extra = [] if keep is None else ["--check-keep-bytes", str(keep)]
    torchrun(HERE / "_load_llama.py", ["--mode", mode, "--path", str(path), "--out", str(out), "--model", model,
                                       *extra], nproc, work / f"{model}-{mode}-{nproc}.log")
    return json.loads(out.read_text())


MODES = ("stock", "ucp-no-bypass", "ucp", "ucp-no-conversion", "ucp-no-conversion-zero1")


def summary(ranks: list[dict]) -> dict:
    """One load's figures: sums over ranks for bytes and calls, the largest rank for time and memory."""
    return {"wall_s": max(r["wall_s"] for r in ranks),
            "bytes_read": sum(r["bytes_read"] for r in ranks),
            "read_calls": sum(r["read_calls"] for r in ranks),
            "peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
            "engine_rss_mib": max(r["engine_rss_mib"] for r in ranks),
            "above_engine_mib": max(r["load_peak_rss_mib"] - r["engine_rss_mib"] for r in ranks),
            # held only while loading: the peak above the engine as loaded (with the optimizer states it created)
            "transient_mib": max(r["load_peak_rss_mib"] - r["loaded_rss_mib"] for r in ranks),
            # read only to check CRC-32s: whole chunks around partial reads, bytes of rank-file entries no rank loads
            "check_bytes": sum(r.get("bytes_checked_extra", 0) + r.get("bytes_checked_sources", 0) for r in ranks),
            # read a second time to install, beyond what the check before the load could keep
            "again_bytes": sum(r.get("bytes_read_again", 0) for r in ranks),
            "bytes_exchanged": sum(r.get("bytes_exchanged", 0) for r in ranks)}


def table(rows: list[tuple]) -> list[str]:
    header = ("| model | ranks | tool | load wall (s) | bytes read (all ranks) | of which only to check CRCs "
              "| of which read again | exchanged/rank (KiB) | read calls | peak RSS/rank (MiB) "
              "| load peak above engine (MiB) | of which transient (MiB) | bytes vs stock | checks / load's bytes "
              "| wall vs stock | peak RSS vs stock |")
    lines = [header, "|" + "---|" * 16]
    for model, n, mode, r, stock in rows:
        own = r["bytes_read"] - r["check_bytes"] - r["again_bytes"]
        lines.append(
            f"| {model} | {n} | {mode} | {r['wall_s']:.2f} | {r['bytes_read'] / 2**20:.0f} MiB | "
            f"{r['check_bytes'] / 2**20:.1f} MiB | {r['again_bytes'] / 2**20:.0f} MiB | "
            f"{r['bytes_exchanged'] / n / 1024:.1f} | {r['read_calls']} | "
            f"{r['peak_rss_mib']:.0f} | {r['above_engine_mib']:.0f} | {r['transient_mib']:.0f} | "
            f"{r['bytes_read'] / stock['bytes_read']:.2f} | "
            f"{100 * r['check_bytes'] / max(own, 1):.2f}% | {r['wall_s'] / stock['wall_s']:.2f} | "
            f"{r['peak_rss_mib'] / stock['peak_rss_mib']:.2f} |")
    return lines


def verdicts(rows: list[tuple]) -> list[str]:
    out = []
    for model, n, mode, r, stock in rows:
        if mode not in ("ucp", "ucp-no-conversion", "ucp-no-conversion-zero1"):
            continue
        own = r["bytes_read"] - r["check_bytes"] - r["again_bytes"]
        share = own / stock["bytes_read"]
        checks = r["check_bytes"] / max(own, 1)
        rss = r["peak_rss_mib"] / stock["peak_rss_mib"]
        out.append(f"{model} N={n} {mode}: load's own bytes / stock = {share:.3f} (target 1/{n} = {1 / n:.3f}: "
                   f"{'PASS' if share <= 1 / n * 1.05 else 'MISS'}); read only for checks {100 * checks:.2f}% of them "
                   f"(target <= 2%: {'PASS' if checks <= 0.02 else 'MISS'}); read again "
                   f"{r['again_bytes'] / 2**20:.0f} MiB; peak RSS / stock = {rss:.3f} (target <= 1: "
                   f"{'PASS' if rss <= 1 else 'MISS'}); wall / stock = {r['wall_s'] / stock['wall_s']:.2f}")
    return out


def load_average() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--model", nargs="+", default=["112m"], choices=("112m", "359m"),
                        help="benchmark Llama sizes (benchmarks/_train_llama.py MODELS); 359m for memory vs size")
    parser.add_argument("--modes", nargs="+", default=["stock", "ucp", "ucp-no-conversion"], choices=MODES,
                        help="loads to run (ucp-no-bypass: every rank reads every tensor whole, a control; "
                        "ucp-no-conversion-zero1: straight from a ZeRO-1 dp2 checkpoint of the same model)")
    parser.add_argument("--check-keep-bytes", type=int,
                        help="what ucp's check before the load keeps for the install (default: ucp's KEEP_BYTES)")
    parser.add_argument("--cache", type=Path, default=Path(os.path.expanduser("~/.cache/ucp-bench")))
    parser.add_argument("--markdown-out", type=Path)
    parser.add_argument("--splits", action="store_true",
                        help="instead, split-driven loading under layout changes (benchmarks/load_splits.py): bytes "
                        "and read calls of ucp.hmp.load_slices vs whole-tensor reads, as stock load_universal does")
    args = parser.parse_args()
    if args.splits:
        import load_splits

        sys.exit(load_splits.main(["--markdown-out", str(args.markdown_out)] if args.markdown_out else []))
    modes = ["stock", *(m for m in MODES if m in args.modes and m != "stock")]
    work = Path(tempfile.mkdtemp(prefix="ucp-load-bench-"))
    rows, sizes = [], {}
    started = load_average()
    for model in args.model:
        atomic, universal, source = build(args.cache, model)
        sizes[model] = sum(f.stat().st_size for f in atomic.glob("*.safetensors"))
        paths = {"stock": universal, "ucp-no-bypass": atomic, "ucp": atomic, "ucp-no-conversion": source}
        if "ucp-no-conversion-zero1" in modes:
            paths["ucp-no-conversion-zero1"] = zero1_source(args.cache, model)
        for n in args.ranks:
            results = {mode: summary(run(mode, paths[mode], n, model, work, args.check_keep_bytes)) for mode in modes}
            rows += [(model, n, mode, r, results["stock"]) for mode, r in results.items()]
    import deepspeed
    import torch

    text = "\n".join([
        f"Measured {time.strftime('%Y-%m-%d %H:%M')} on {os.cpu_count()} cores, {platform.machine()}, torch "
        f"{torch.__version__}, deepspeed {deepspeed.__version__}; ZeRO-3 target; checkpoints of "
        + ", ".join(f"{m}: {b / 2**30:.2f} GiB (atomic)" for m, b in sizes.items())
        + f"; page cache warm; 1/5/15-min load average {started} at the start, {load_average()} at the end.",
        "", *table(rows), "", *verdicts(rows)])
    print(text)
    print(f"(per-rank figures in {work})")
    if args.markdown_out:
        args.markdown_out.write_text(text + "\n")


if __name__ == "__main__":
    main()
