#!/usr/bin/env python
"""Export benchmark: `ucp export --to hf` against DeepSpeed's `zero_to_fp32.py` followed by `save_pretrained`.

    python benchmarks/export.py [--repeat 1] [--cache DIR] [--markdown-out FILE] [--tmp DIR]

1. Builds once (cached, shared with benchmarks/convert.py) the DeepSpeed ZeRO-1 fp32 checkpoint of a
   112M-parameter Llama (benchmarks/_train_llama.py) and writes its `config.json` (from the same LlamaConfig)
   into a scratch folder.
2. Times, one after the other, each in its own process, warm page cache:
   * `ucp export --input <save_dir> --output <tmp>/ucp_hf --to hf --config <tmp>/config.json`;
   * the DeepSpeed way, two commands: `python <save_dir>/zero_to_fp32.py <save_dir> <tmp>/fp32
     --safe_serialization` (the consolidated fp32 state dict), then `AutoModelForCausalLM.from_pretrained(
     <tmp>/fp32).save_pretrained(<tmp>/ds_hf)` (the transformers folder); its time is the sum, its peak the
     larger peak;
   * for information, `ucp export --to dcp` (weights and Adam moments, DCP);
   * for information, the floors under those peaks, measured the same way: ucp's architecture check alone
     (`model_keys` of the config: `import torch`, transformers' model class, the model built on the meta
     device), `import torch` alone, and the imports of `zero_to_fp32.py` (`import torch, deepspeed`).
3. Checks that every tensor of ucp's folder equals (`torch.equal`) the DeepSpeed way's, and prints time and
   peak RSS side by side with the ratios the project targets (faster; at most 1/4 of the peak memory).
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from convert import (  # noqa: E402
    RSS_NOTE,
    Sample,
    build_checkpoint,
    fmt_bytes,
    machine_info,
    measure,
    tree_size,
    ucp_command,
)

SAVE_PRETRAINED = ("import sys; from transformers import AutoModelForCausalLM; "
                   "AutoModelForCausalLM.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])")
ARCH_CHECK = ("import sys; from ucp.export.model_config import find_config, model_keys; "
              "model_keys(find_config(None, sys.argv[1]))")
HEADER = ["tool", "wall s", "wall+sync s", "CPU s", "peak RSS MiB", "peak anon MiB", "written", "files"]


def write_config(folder: Path) -> Path:
    """The benchmark model's config.json, as the HF Trainer would save it beside the checkpoint."""
    from transformers import LlamaConfig

    from _train_llama import MODEL

    LlamaConfig(**MODEL, architectures=["LlamaForCausalLM"]).save_pretrained(folder)
    return folder / "config.json"


def same_tensors(ours: Path, theirs: Path) -> tuple[int, list[str]]:
    """How many tensors both folders hold, and the names that differ or are missing (read one at a time)."""
    import json

    import torch
    from safetensors import safe_open

    def where(folder: Path) -> dict[str, Path]:
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            return {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
        with safe_open(folder / "model.safetensors", "pt") as f:
            return {k: folder / "model.safetensors" for k in f.keys()}

    a, b = where(ours), where(theirs)
    bad = sorted(set(a) ^ set(b))
    for name in sorted(set(a) & set(b)):
        with safe_open(a[name], "pt") as fa, safe_open(b[name], "pt") as fb:
            if not torch.equal(fa.get_tensor(name), fb.get_tensor(name)):
                bad.append(name)
    return len(set(a) & set(b)), bad


def row(label: str, s: Sample) -> list[str]:
    return [label, f"{s.wall:.2f}", f"{s.wall + s.sync:.2f}", f"{s.cpu:.2f}", f"{s.peak_rss / 2**20:,.0f}",
            f"{s.peak_anon / 2**20:,.0f}",
            fmt_bytes(s.bytes_written), str(s.files_written)]


def median(samples: list[Sample]) -> Sample:
    return Sample(*(statistics.median(getattr(x, f.name) for x in samples) for f in dataclasses.fields(Sample)))


def combined(a: Sample, b: Sample) -> Sample:
    """Two commands run one after the other: times add up, the peak is the larger one."""
    return Sample(a.wall + b.wall, a.sync + b.sync, a.cpu + b.cpu, max(a.peak_rss, b.peak_rss),
                  max(a.peak_anon, b.peak_anon), b.bytes_written, b.files_written)


def table(rows: list[list[str]], markdown: bool) -> str:
    if markdown:
        out = ["| " + " | ".join(HEADER) + " |", "|" + "|".join(["---"] + ["---:"] * (len(HEADER) - 1)) + "|"]
        return "\n".join(out + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(r[i]) for r in [HEADER] + rows) for i in range(len(HEADER))]
    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(HEADER), line(["-" * w for w in widths])] + [line(r) for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/ucp-bench"),
                    help="where the benchmark checkpoint is built once (default ~/.cache/ucp-bench)")
    ap.add_argument("--markdown-out", metavar="FILE", help="also write the results as markdown to FILE")
    ap.add_argument("--tmp", metavar="DIR", help="scratch directory for outputs (default: a new one under $TMPDIR)")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs of every command; the table shows medians")
    args = ap.parse_args(argv)

    save_dir = build_checkpoint(Path(args.cache).expanduser())
    load_before = os.getloadavg()[0]
    tmp = Path(tempfile.mkdtemp(prefix="ucp-bench-export-", dir=args.tmp))
    log = tmp / "commands.log"
    try:
        config = write_config(tmp / "model")
        src_bytes, src_files = tree_size(save_dir / (save_dir / "latest").read_text().strip())
        print(f"checkpoint: {save_dir} ({fmt_bytes(src_bytes)} in {src_files} files); config {config}", flush=True)
        shutil.copytree(save_dir, tmp / "warmup")  # untimed: every tool then reads from a warm page cache
        shutil.rmtree(tmp / "warmup")
        runs = {key: [] for key in ("ucp", "z2f", "spt", "dcp", "check", "torch", "dsimp")}
        for rep in range(args.repeat):
            for folder in ("ucp_hf", "ds_hf"):
                shutil.rmtree(tmp / folder, ignore_errors=True)
            commands = {
                "ucp": (ucp_command() + ["export", "--input", str(save_dir), "--output", str(tmp / "ucp_hf"), "--to",
                                         "hf", "--config", str(config), "--quiet"], tmp / "ucp_hf"),
                "z2f": ([sys.executable, str(save_dir / "zero_to_fp32.py"), str(save_dir), str(tmp / "fp32"),
                         "--safe_serialization"], tmp / "fp32"),
                "spt": ([sys.executable, "-c", SAVE_PRETRAINED, str(tmp / "fp32"), str(tmp / "ds_hf")], tmp / "ds_hf"),
                "dcp": (ucp_command() + ["export", "--input", str(save_dir), "--output", str(tmp / "ucp_dcp"), "--to",
                                         "dcp", "--config", str(config), "--quiet"], tmp / "ucp_dcp"),
                "check": ([sys.executable, "-c", ARCH_CHECK, str(config)], tmp / "nothing"),
                "torch": ([sys.executable, "-c", "import torch"], tmp / "nothing"),
                "dsimp": ([sys.executable, "-c", "import torch, deepspeed"], tmp / "nothing"),
            }
            for key, (cmd, out) in commands.items():
                sample = measure(cmd, out, log)
                runs[key].append(sample)
                print(f"[{rep + 1}/{args.repeat}] {key}: {sample.wall:7.2f} s (+{sample.sync:.2f} s sync, CPU "
                      f"{sample.cpu:.1f} s)  peak RSS {sample.peak_rss / 2**20:,.0f} MiB", flush=True)
                if key == "z2f":
                    shutil.copy(config, tmp / "fp32")  # untimed: from_pretrained reads the model's config
                if key in ("spt", "dcp"):
                    shutil.rmtree(tmp / ("fp32" if key == "spt" else "ucp_dcp"))
        ucp, z2f, spt, dcp, check, torch_only, ds_imports = (median(runs[key]) for key in runs)
        compared, differ = same_tensors(tmp / "ucp_hf", tmp / "ds_hf")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    deepspeed = combined(z2f, spt)
    rows = [row("ucp export --to hf", ucp), row("zero_to_fp32.py --safe_serialization", z2f),
            row("from_pretrained + save_pretrained", spt), row("DeepSpeed way (both)", deepspeed),
            row("(info) ucp export --to dcp", dcp), row("(floor) ucp's architecture check alone", check),
            row("(floor) import torch", torch_only), row("(floor) import torch, deepspeed", ds_imports)]
    # ucp fsyncs what it writes before the rename that commits it; zero_to_fp32.py and save_pretrained do not,
    # so their writeback shows only in wall+sync, the time until the folder is durable.
    speedup = (deepspeed.wall + deepspeed.sync) / (ucp.wall + ucp.sync)
    rss = ucp.peak_rss / deepspeed.peak_rss
    verdicts = [("speed-up vs the DeepSpeed way (wall+sync)", f"{speedup:.2f}x", "> 1x", speedup > 1),
                ("peak RSS / the DeepSpeed way's", f"{rss:.3f}", "<= 0.25", rss <= 0.25),
                ("(info) speed-up, wall time alone", f"{deepspeed.wall / ucp.wall:.2f}x", "", None),
                ("(info) speed-up, CPU time", f"{deepspeed.cpu / ucp.cpu:.2f}x", "", None),
                ("(info) peak anon / the DeepSpeed way's", f"{ucp.peak_anon / deepspeed.peak_anon:.3f}", "", None),
                ("(info) ucp's architecture check alone / the DeepSpeed way's peak",
                 f"{check.peak_rss / deepspeed.peak_rss:.3f}", "", None),
                ("(info) peak RSS above floors (ucp's check; DeepSpeed's imports)",
                 f"{(ucp.peak_rss - check.peak_rss) / (deepspeed.peak_rss - ds_imports.peak_rss):.3f}", "", None)]
    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    correct = (f"all {compared} tensors equal (torch.equal)" if not differ
               else f"MISMATCH in {len(differ)} tensors: {', '.join(differ[:5])}")
    print()
    print(table(rows, markdown=False))
    print()
    for label, value, goal, ok in verdicts:
        print(f"  {label:62s} {value:>8s}" + ("" if ok is None else f"   target {goal:8s} {'PASS' if ok else 'MISS'}"))
    print(f"\ncorrectness: ucp's folder vs the DeepSpeed way's: {correct}; 1-min load average {load}")
    if args.markdown_out:
        mach = machine_info()
        md = [f"Measured {mach['date']}: {mach['nproc']} CPUs ({mach['cpu']}), {mach['ram']} RAM; Python "
              f"{mach['python']}, torch {mach['torch']}, deepspeed {mach['deepspeed']}, ucp {mach['ucp']}. "
              f"Checkpoint: the 112M Llama of benchmarks/convert.py (ZeRO-1 fp32, DP 2; {fmt_bytes(src_bytes)} in "
              f"{src_files} files). Medians of {args.repeat} run(s); 1-min load average {load}.", "",
              table(rows, markdown=True), "",
              "| target | measured | goal | |", "|---|---:|---|---|"]
        md += [f"| {label} | {value} | {goal} | {'' if ok is None else 'PASS' if ok else 'MISS'} |"
               for label, value, goal, ok in verdicts]
        md += ["", f"Correctness: ucp's folder vs the DeepSpeed way's: {correct}.", "", "*peak RSS*: " + RSS_NOTE, ""]
        Path(args.markdown_out).write_text("\n".join(md))
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
