#!/usr/bin/env python
"""AutoTP conversion benchmark: `ucp convert` against DeepSpeed's ds_to_universal.py.

    python benchmarks/convert_autotp.py [--workers 2] [--cache DIR] [--markdown-out FILE]

1. Builds once (cached under --cache, default ~/.cache/ucp-bench) a real DeepSpeed checkpoint of a
   ~125M-parameter Llama (transformers.LlamaConfig, random init, GQA, untied embeddings) trained one
   step with AutoTP=2 and ZeRO-1, fp32, on 2 CPU processes (torchrun + gloo), by
   tests/support/train_llama_tp.py.
2. Times on it, with the same worker count, `ucp convert` and ds_to_universal.py: wall time, peak
   RSS of the whole process tree (sampled every 20 ms with psutil), bytes and files written.
3. Checks every state of every parameter ucp wrote against ds_to_universal's output (torch.equal).

Run by `benchmarks/convert.py --source autotp`; it measures with convert.py's own `measure` (wall
time, peak RSS of the process tree, bytes and files written), so the two tables compare.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from convert import ds_to_universal_script, free_port, measure, ucp_command

ROOT = Path(__file__).resolve().parent.parent
TRAIN_SCRIPT = ROOT / "tests" / "support" / "train_llama_tp.py"
LLAMA = {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
         "num_attention_heads": 12, "num_key_value_heads": 4, "max_position_embeddings": 512}
CKPT_NAME = "llama125m-autotp2-zero1-fp32"


def env() -> dict[str, str]:
    out = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    out.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/ucp-tests/torch_extensions"))
    return out


def build_checkpoint(cache: Path) -> Path:
    """The save_dir of the benchmark checkpoint, trained once and kept under `cache`."""
    import json

    folder = cache / CKPT_NAME
    if (folder / ".done").is_file():
        return folder / "ckpt"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    runs = json.dumps([{"stage": 1, "save_dir": str(folder / "ckpt"), "llama": LLAMA}])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(TRAIN_SCRIPT), "--tp", "2", "--steps", "1", "--runs", runs]
    print(f"building {folder} (one training step of a ~125M Llama with AutoTP=2 on 2 CPU ranks)...", flush=True)
    with open(folder / "train.log", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env()).returncode != 0:
            sys.exit(f"training failed; see {folder / 'train.log'}")
    (folder / ".done").touch()
    return folder / "ckpt"


def verify(ucp_out: Path, ds_out: Path) -> int:
    """Every state ucp wrote equals ds_to_universal's; the number of tensors compared."""
    import torch

    import ucp

    ckpt = ucp.open_checkpoint(ucp_out)
    compared = 0
    for name in ckpt.names:
        if ckpt.info(name).kind != "param":
            continue
        for state in ("fp32", "exp_avg", "exp_avg_sq"):
            value = torch.load(ds_out / "zero" / name / f"{state}.pt", map_location="cpu", weights_only=False)
            value = value["param"] if isinstance(value, dict) else value
            if not torch.equal(ckpt.tensor(name, state), value.reshape(ckpt.shape(name))):
                sys.exit(f"MISMATCH: {name} {state} differs from ds_to_universal's")
            compared += 1
    return compared


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="worker processes for both converters (default 2)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/ucp-bench"), help="where the checkpoint is kept")
    ap.add_argument("--markdown-out", metavar="FILE", help="also write the results table as markdown to FILE")
    args = ap.parse_args(argv)
    save_dir = build_checkpoint(Path(args.cache))
    tag = (save_dir / "latest").read_text().strip()
    scratch = Path(tempfile.mkdtemp(prefix="ucp-bench-autotp-"))
    try:
        log = scratch / "bench.log"
        ucp_out, ds_out = scratch / "ucp", scratch / "ds" / tag
        ucp_cmd = [*ucp_command(), "convert", "--input", str(save_dir), "--output", str(ucp_out),
                   "--workers", str(args.workers), "--quiet"]
        ds_cmd = [sys.executable, str(ds_to_universal_script()), "--input_folder", str(save_dir / tag),
                  "--output_folder", str(ds_out), "--num_extract_workers", str(args.workers),
                  "--num_merge_workers", str(args.workers)]
        copy = scratch / "copy"
        subprocess.run(["cp", "-r", str(save_dir / tag), str(copy)], check=True)  # warm the page cache, untimed
        shutil.rmtree(copy)
        results = {"cp -r": measure(["cp", "-r", str(save_dir / tag), str(copy)], copy, log),
                   "ucp convert": measure(ucp_cmd, ucp_out, log), "ds_to_universal": measure(ds_cmd, ds_out, log)}
        compared = verify(ucp_out, ds_out)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    source = sum(p.stat().st_size for p in (save_dir / tag).iterdir())
    rows = [["tool", "wall s", "peak RSS", "written", "files"]]
    rows += [[k, f"{r.wall:.1f}", f"{r.peak_rss / 2**30:.2f} GiB", f"{r.bytes_written / 2**30:.2f} GiB",
              str(r.files_written)] for k, r in results.items()]
    u, d, c = results["ucp convert"], results["ds_to_universal"], results["cp -r"]
    lines = [f"AutoTP=2 ZeRO-1 fp32 Llama ~125M, checkpoint {source / 2**30:.2f} GiB, {args.workers} workers", ""]
    lines += ["| " + " | ".join(r) + " |" for r in rows[:1]] + ["|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
    lines += ["", f"ucp / (cp -r + sync) {u.wall / (c.wall + c.sync):.2f}x "
              f"(cp -r {c.wall:.2f} s + sync {c.sync:.2f} s), speed-up {d.wall / u.wall:.2f}x, "
              f"peak RSS ratio {u.peak_rss / d.peak_rss:.2f}, "
              f"files ratio {u.files_written / d.files_written:.4f}; {compared} tensors equal to ds_to_universal's"]
    print("\n".join(lines))
    if args.markdown_out:
        Path(args.markdown_out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
