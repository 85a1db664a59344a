#!/usr/bin/env python
"""Conversion benchmark: `ucp convert` against DeepSpeed's ds_to_universal.py and a plain `cp -r`.

    python benchmarks/convert.py [--workers 2] [--cache DIR] [--repeat 1] [--markdown-out FILE]
    python benchmarks/convert.py --source zero2-bf16|zero3 [...]
    python benchmarks/convert.py --source autotp [--workers 2] [--cache DIR] [--markdown-out FILE]

`--source` picks the checkpoint: zero1 (default, ZeRO-1 fp32), zero2-bf16 (ZeRO-2, bf16 training with fp32
masters), zero3 (ZeRO-3 fp32), all the same ~112M-parameter Llama on 2 ranks; autotp is a ~125M-parameter
Llama saved with AutoTP=2 and ZeRO-1, measured the same way (benchmarks/convert_autotp.py, which this runs).

1. Builds once (cached under --cache, default ~/.cache/ucp-bench) a real DeepSpeed ZeRO-1 fp32 checkpoint of a
   ~112M-parameter Llama (transformers.LlamaConfig, random init, GQA, untied embeddings) trained one step on
   2 CPU processes (torchrun + gloo), see benchmarks/_train_llama.py.
2. Times on it, with the same worker count: `ucp convert`, ds_to_universal.py, `cp -r` of the tag folder
   (the copy limit: a converter reads every byte and writes about as many), and `ucp convert --format
   deepspeed` (for information). Reports wall time, peak RSS of the process tree, bytes and files written,
   the ratios the project targets, and checks ucp's tensors against ds_to_universal's.
3. With `--crc32 zlib,zlib-ng`, also `ucp convert` with each CRC-32 implementation named (`UCP_CRC32`), in the
   same rounds, checked to write the same bytes as the default one (the fastest installed).
"""
from __future__ import annotations

import argparse
import datetime
import filecmp
import json
import os
import platform
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ucp.format.crc import CRC32_ENV, crc32_implementation

HERE = Path(__file__).resolve().parent
TRAIN_SCRIPT = HERE / "_train_llama.py"
CKPT_NAME = "llama112m-zero1-fp32-dp2"
# --source: the cached checkpoint's folder name and how _train_llama.py trains it (all: the same Llama, DP 2)
SOURCES = {
    "zero1": (CKPT_NAME, []),
    "zero2-bf16": ("llama112m-zero2-bf16-dp2", ["--stage", "2", "--dtype", "bf16"]),
    "zero3": ("llama112m-zero3-fp32-dp2", ["--stage", "3"]),
}
DONE_MARKER = ".done"
POLL_S = 0.02
VERIFY_STATES = ("fp32", "exp_avg", "exp_avg_sq")

# The project's targets: (label, how to compute from the results, comparison, threshold, shown as)
TARGETS = [
    ("ucp speed-up vs ds_to_universal", "speedup", ">=", 3.0, "{:.2f}x", ">= 3x"),
    ("ucp time / (cp -r + sync) time", "vs_copy", "<=", 1.5, "{:.2f}x", "<= 1.5x"),
    ("ucp peak RSS / ds_to_universal peak RSS", "rss_ratio", "<=", 0.5, "{:.3f}", "<= 0.5"),
    ("ucp files / ds_to_universal files", "files_ratio", "<=", 1 / 20, "{:.4f}", "<= 1/20 (0.05)"),
]

RSS_NOTE = ("Peak RSS is the maximum over time of the summed RSS of the whole process tree (the command and "
            "all its descendants), sampled every 20 ms with psutil. Both converters fan out into worker "
            "processes, so the peak of any single process would hide most of their footprint; the sum is "
            "what the tool as a whole asks of the machine. It over-counts pages shared between processes "
            "(the Python/torch libraries mapped in every worker, copy-on-write pages after fork), so it is "
            "an upper bound, measured the same way for every tool. 'anon' is the same sum over RSS minus "
            "file-backed/shared pages (RssAnon): the private memory, without mapped libraries or files. "
            "Spikes shorter than 20 ms can be missed.")


# --------------------------------------------------------------------------------------------------------------
# Building the checkpoint (once)
# --------------------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def build_checkpoint(cache: Path, source: str = "zero1") -> Path:
    """The save_dir of the cached checkpoint of `source` (see SOURCES), training it first if no done-marker exists."""
    name, train_args = SOURCES[source]
    root = cache / name
    save_dir = root / "ckpt"
    if (root / DONE_MARKER).is_file():
        return save_dir
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    log = root / "train.log"
    print(f"building the checkpoint once: torchrun --nproc_per_node 2 {TRAIN_SCRIPT.name} (log: {log}) ...",
          flush=True)
    for attempt in range(3):
        port = free_port()
        env = base_env()
        env.update({"TORCH_EXTENSIONS_DIR": os.path.expanduser("~/.cache/ucp/torch_extensions"),
                    "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TOKENIZERS_PARALLELISM": "false"})
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
               "--master_addr", "127.0.0.1", "--master_port", str(port), str(TRAIN_SCRIPT), str(save_dir),
               "--info-out", str(root / "model_info.json"), *train_args]
        t0 = time.perf_counter()
        with open(log, "a") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=1800)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # the process group we created: torchrun and its ranks
                proc.wait()
                rc = -9
        text = log.read_text(errors="replace")
        if rc == 0:
            break
        if attempt < 2 and "address already in use" in text.lower():
            continue
        tail = "\n".join(text.splitlines()[-40:])
        sys.exit(f"building the checkpoint failed (exit {rc}); last lines of {log}:\n{tail}")
    size = tree_size(save_dir)
    info = json.loads((save_dir.parent / "model_info.json").read_text())
    print(f"built {info['params'] / 1e6:.1f}M params, {size[0] / 2**30:.2f} GiB in {size[1]} files, "
          f"in {time.perf_counter() - t0:.0f} s", flush=True)
    (root / DONE_MARKER).write_text(datetime.datetime.now().isoformat() + "\n")
    return save_dir


# --------------------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------------------

@dataclass
class Sample:
    wall: float
    sync: float            # time of the os.sync() right after the command (writeback of what it left dirty)
    cpu: float             # user+sys CPU seconds of the command and every descendant it waited for
    peak_rss: int
    peak_anon: int
    bytes_written: int
    files_written: int


@dataclass
class Tool:
    key: str
    label: str
    out: Path              # directory to walk for bytes/files, and to delete
    samples: list[Sample] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to the command's environment

    def median(self, attr: str) -> float:
        return statistics.median(getattr(s, attr) for s in self.samples)


def tree_size(path: Path) -> tuple[int, int]:
    total = files = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            p = os.path.join(dirpath, n)
            if os.path.isfile(p) and not os.path.islink(p):
                total += os.path.getsize(p)
                files += 1
    return total, files


def tree_rss(proc: psutil.Process) -> tuple[int, int]:
    rss = anon = 0
    try:
        procs = [proc] + proc.children(recursive=True)
    except psutil.NoSuchProcess:
        return 0, 0
    for p in procs:
        try:
            m = p.memory_info()
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
        rss += m.rss
        anon += m.rss - getattr(m, "shared", 0)
    return rss, anon


def measure(cmd: list[str], out: Path, log: Path, env: dict[str, str] | None = None) -> Sample:
    """Run `cmd` (with `env` added to the environment), polling the RSS of its process tree every POLL_S; then sync
    and walk `out`."""
    os.sync()  # start clean: no dirty pages left over from the previous run being written back meanwhile
    peak = [0, 0]
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(log, "a") as f:
        f.write(f"$ {' '.join(cmd)}\n")
        f.flush()
        t0 = time.perf_counter()
        proc = psutil.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**base_env(), **(env or {})})
        done = threading.Event()

        def poll() -> None:
            while not done.is_set():
                rss, anon = tree_rss(proc)
                peak[0], peak[1] = max(peak[0], rss), max(peak[1], anon)
                done.wait(POLL_S)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        rc = proc.wait()
        wall = time.perf_counter() - t0
        done.set()
        poller.join()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    t1 = time.perf_counter()
    os.sync()
    sync = time.perf_counter() - t1
    if rc != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        sys.exit(f"command failed (exit {rc}): {' '.join(cmd)}\n--- last lines of {log} ---\n{tail}")
    nbytes, nfiles = tree_size(out)
    return Sample(wall, sync, cpu, peak[0], peak[1], nbytes, nfiles)


def ucp_command() -> list[str]:
    exe = shutil.which("ucp")
    return [exe] if exe else [sys.executable, "-m", "ucp.cli.main"]


def ds_to_universal_script() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("deepspeed is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "checkpoint" / "ds_to_universal.py"


# --------------------------------------------------------------------------------------------------------------
# Correctness check
# --------------------------------------------------------------------------------------------------------------

def pick_params(save_dir: Path, tag: str) -> list[str]:
    """Three parameters worth checking: the embedding, a GQA k_proj, and the one straddling the ZeRO-1
    partition boundary between rank 0 and rank 1 (pieces from both ranks must be joined)."""
    names: list[str] = []
    try:
        from ucp.checkpoint import open_checkpoint

        planned = open_checkpoint(save_dir, tag)
        all_names = list(planned.names)
        for n in all_names:
            pattern = planned.info(n).pattern
            if planned.info(n).kind == "param" and "k_proj" not in n and pattern not in ("?", "", None) \
                    and _looks_split(planned, n):
                names.append(n)
                break
    except Exception:
        all_names = []
    for want in ("model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "lm_head.weight"):
        if len(names) >= 3:
            break
        if want not in names:
            names.append(want)
    return names[:3]


def _looks_split(planned, name: str) -> bool:
    """True when the planned parameter's fp32 state is read from more than one rank file."""
    try:
        p = planned._param(name)
        src = p.states["fp32"]
        return len({f.piece.path for f in src.fragments}) > 1
    except Exception:
        return False


def verify(ucp_out: Path, ds_tag_dir: Path, names: list[str], ucpds_tag_dir: Path | None) -> list[str]:
    """Lines of a report; each starts with OK or FAIL."""
    import torch

    try:
        from ucp import open_checkpoint  # the public spelling, if the package exports it
    except ImportError:
        from ucp.checkpoint import open_checkpoint
    ckpt = open_checkpoint(ucp_out)
    lines = []
    for name in names:
        for state in VERIFY_STATES:
            ref_path = ds_tag_dir / "zero" / name / f"{state}.pt"
            try:
                loaded = torch.load(ref_path, map_location="cpu", weights_only=False)
                got = ckpt.tensor(name, state)
                ref = loaded["param"] if isinstance(loaded, dict) else loaded.reshape(got.shape)  # ZeRO-3: flat
                ok = torch.equal(got, ref)
                detail = f"{tuple(got.shape)} {str(got.dtype).removeprefix('torch.')}"
                if not ok:
                    detail += (f"; shapes {tuple(got.shape)} vs {tuple(ref.shape)}" if got.shape != ref.shape
                               else f"; max |diff| {float((got.float() - ref.float()).abs().max()):.3g}")
                extra = ""
                if ucpds_tag_dir is not None:
                    other = torch.load(ucpds_tag_dir / "zero" / name / f"{state}.pt", map_location="cpu",
                                       weights_only=False)
                    other = other["param"] if isinstance(other, dict) else other.reshape(got.shape)
                    same = torch.equal(other, ref)
                    ok = ok and same
                    extra = f"; ucp --format deepspeed file {'identical' if same else 'DIFFERS'}"
                lines.append(f"{'OK  ' if ok else 'FAIL'} {name} {state}: {detail}{extra}")
            except Exception as exc:  # report, do not crash the benchmark
                lines.append(f"FAIL {name} {state}: {type(exc).__name__}: {exc}")
    return lines


# --------------------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------------------

def same_files(expected: Path, found: Path, crc_name: str) -> str:
    """'OK ...' when `found` holds the files of `expected`, byte for byte (the index records the same CRC-32s)."""
    names = sorted(p.relative_to(expected) for p in expected.rglob("*") if p.is_file())
    if names != sorted(p.relative_to(found) for p in found.rglob("*") if p.is_file()):
        return f"MISMATCH: with CRC-32 {crc_name}, ucp convert wrote other files"
    differ = [str(n) for n in names if not filecmp.cmp(expected / n, found / n, shallow=False)]
    return (f"MISMATCH: with CRC-32 {crc_name}, {', '.join(differ)} differ" if differ else
            f"OK ucp convert with CRC-32 {crc_name} wrote the same {len(names)} files, byte for byte")


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def table_rows(tools: list[Tool]) -> list[list[str]]:
    rows = []
    for t in tools:
        rows.append([t.label, f"{t.median('wall'):.2f}", f"{t.median('wall') + t.median('sync'):.2f}",
                     f"{t.median('cpu'):.2f}",
                     f"{t.median('peak_rss') / 2**20:,.0f}", f"{t.median('peak_anon') / 2**20:,.0f}",
                     fmt_bytes(t.median('bytes_written')), f"{int(t.median('files_written')):,}"])
    return rows


HEADER = ["tool", "wall s", "wall+sync s", "CPU s", "peak RSS MiB", "peak anon MiB", "written", "files"]


def ascii_table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [HEADER] + rows) for i in range(len(HEADER))]
    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    return "\n".join([line(HEADER), line(["-" * w for w in widths])] + [line(r) for r in rows])


def md_table(rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "|".join(["---"] + ["---:"] * (len(HEADER) - 1)) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(out)


def ratios(by: dict[str, Tool]) -> dict[str, float]:
    u, d, c = by["ucp"], by["ds"], by["copy"]
    return {"speedup_cpu": d.median("cpu") / u.median("cpu"),
            "vs_copy_cpu": u.median("cpu") / c.median("cpu"),
            "speedup": d.median("wall") / u.median("wall"),
            # ucp's wall includes its fsyncs, so the copy pays its writeback too: cp -r, then sync
            "vs_copy": u.median("wall") / statistics.median(s.wall + s.sync for s in c.samples),
            "rss_ratio": u.median("peak_rss") / d.median("peak_rss"),
            "files_ratio": u.median("files_written") / d.median("files_written")}


def target_lines(r: dict[str, float]) -> list[tuple[str, str, str, str]]:
    out = []
    for label, key, op, thr, shown, target in TARGETS:
        v = r[key]
        ok = v >= thr if op == ">=" else v <= thr
        out.append((label, shown.format(v), target, "PASS" if ok else "MISS"))
    # Not targets: the same comparisons by CPU time, which a busy machine disturbs much less than wall time.
    out.append(("(info) ucp speed-up vs ds_to_universal, CPU time", f"{r['speedup_cpu']:.2f}x", "", ""))
    out.append(("(info) ucp / copy, CPU time", f"{r['vs_copy_cpu']:.2f}x", "", ""))
    return out


def machine_info() -> dict[str, str]:
    import deepspeed
    import torch

    import ucp

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "nproc": str(os.cpu_count()), "ram": f"{psutil.virtual_memory().total / 2**30:.0f} GiB", "cpu": cpu,
            "python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "ucp": ucp.__version__}


# --------------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2, help="worker processes for both converters (default 2)")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/ucp-bench"),
                    help="where the benchmark checkpoint is built once (default ~/.cache/ucp-bench)")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per tool; the table shows medians")
    ap.add_argument("--markdown-out", metavar="FILE", help="also write the results as markdown to FILE")
    ap.add_argument("--tmp", metavar="DIR", help="scratch directory for outputs (default: a new one under $TMPDIR)")
    ap.add_argument("--source", choices=(*SOURCES, "autotp"), default="zero1",
                    help="zero1: the data-parallel ZeRO-1 fp32 Llama (default); zero2-bf16, zero3: the same Llama "
                    "under ZeRO-2 bf16 / ZeRO-3 fp32; autotp: a Llama saved with AutoTP=2 ZeRO-1 (--repeat and --tmp "
                    "do not apply)")
    ap.add_argument("--crc32", metavar="NAMES", default="",
                    help="also time ucp convert with each of these CRC-32 implementations (comma-separated: isal, "
                    "zlib-ng, zlib), in the same rounds")
    args = ap.parse_args(argv)
    if args.source == "autotp":
        from convert_autotp import main as autotp_main

        return autotp_main(["--workers", str(args.workers), "--cache", args.cache]
                           + (["--markdown-out", args.markdown_out] if args.markdown_out else []))

    save_dir = build_checkpoint(Path(args.cache).expanduser(), args.source)
    tag = (save_dir / "latest").read_text().strip()
    src = save_dir / tag
    info = json.loads((save_dir.parent / "model_info.json").read_text())
    src_bytes, src_files = tree_size(src)
    print(f"checkpoint: {src} ({info['params'] / 1e6:.1f}M params, ZeRO-{info['zero_stage']} {info['dtype']}, "
          f"DP {info['world_size']}; {fmt_bytes(src_bytes)} in {src_files} files)", flush=True)

    load_before = os.getloadavg()[0]
    if load_before > 0.5 * (os.cpu_count() or 1):
        print(f"warning: load average {load_before:.1f} on {os.cpu_count()} CPUs; other processes compete, "
              "expect noisy numbers (rerun when the machine is quiet)", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="ucp-bench-", dir=args.tmp))
    log = tmp / "commands.log"
    n = str(args.workers)
    ds_script = ds_to_universal_script()
    crc_default = crc32_implementation()
    crc_names = [name for name in args.crc32.split(",") if name]
    tools = [
        Tool("copy", "cp -r (copy limit)", tmp / "copy"),
        Tool("ds", "ds_to_universal.py", tmp / "ds_out"),
        Tool("ucp", f"ucp convert (CRC-32: {crc_default})", tmp / "ucp_out"),
        *(Tool(f"ucp-{name}", f"ucp convert (CRC-32: {name})", tmp / f"ucp_out_{name}", env={CRC32_ENV: name})
          for name in crc_names),
        Tool("ucpds", "ucp convert --format deepspeed", tmp / "ucpds_out"),
    ]
    by = {t.key: t for t in tools}
    commands = {
        "copy": ["cp", "-r", str(src), str(by["copy"].out)],
        "ds": [sys.executable, str(ds_script), "--input_folder", str(src), "--output_folder",
               str(by["ds"].out / tag), "--num_extract_workers", n, "--num_merge_workers", n,
               "--inject_missing_state"],
        "ucp": ucp_command() + ["convert", "--input", str(save_dir), "--output", str(by["ucp"].out),
                                "--workers", n, "--quiet"],
        "ucpds": ucp_command() + ["convert", "--input", str(save_dir), "--output", str(by["ucpds"].out / tag),
                                  "--workers", n, "--quiet", "--format", "deepspeed"],
    }
    for name in crc_names:
        commands[f"ucp-{name}"] = ucp_command() + ["convert", "--input", str(save_dir), "--output",
                                                   str(by[f"ucp-{name}"].out), "--workers", n, "--quiet"]
    verification: list[str] = []
    names = pick_params(save_dir, tag)
    try:
        # Warm-up: one untimed copy pulls the whole source into the page cache, so every tool reads warm.
        print("warm-up: untimed cp -r of the tag folder (source now in the page cache)", flush=True)
        subprocess.run(["cp", "-r", str(src), str(tmp / "warmup")], check=True)
        shutil.rmtree(tmp / "warmup")
        for rep in range(args.repeat):
            for t in tools:
                shutil.rmtree(t.out, ignore_errors=True)
                s = measure(commands[t.key], t.out, log, t.env)
                t.samples.append(s)
                print(f"[{rep + 1}/{args.repeat}] {t.label:32s} {s.wall:7.2f} s (+{s.sync:.2f} s sync, "
                      f"CPU {s.cpu:.1f} s)  "
                      f"peak RSS {s.peak_rss / 2**20:7,.0f} MiB (anon {s.peak_anon / 2**20:,.0f})  "
                      f"{fmt_bytes(s.bytes_written)} in {s.files_written} files", flush=True)
                if t.key == "copy":
                    shutil.rmtree(t.out)
            if rep == args.repeat - 1:
                verification = verify(by["ucp"].out, by["ds"].out / tag, names, by["ucpds"].out / tag)
                verification += [same_files(by["ucp"].out, by[f"ucp-{name}"].out, name) for name in crc_names]
            for t in tools:
                shutil.rmtree(t.out, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    load = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    rows = table_rows(tools)
    r = ratios(by)
    targets = target_lines(r)
    mach = machine_info()
    verified = all(v.startswith("OK") for v in verification)

    print()
    print(f"workers = {args.workers}; medians of {args.repeat} run(s); warm page cache (one untimed cp -r first); "
          f"outputs deleted and os.sync() between runs; 1-min load average {load}")
    print(ascii_table(rows))
    print()
    for label, value, target, verdict in targets:
        print(f"  {label:48s} {value:>9s}   " + (f"target {target:15s} {verdict}" if target else ""))
    print()
    print(f"correctness ({'all equal' if verified else 'MISMATCH'}): ucp's tensors vs ds_to_universal's "
          "zero/<name>/<state>.pt, torch.equal:")
    for v in verification:
        print("  " + v)
    print()
    print("notes: 'wall' is the command's run time; 'wall+sync' adds the os.sync() right after it. ucp fsyncs its "
          "data files before committing the index (so its writeback is inside 'wall'); ds_to_universal and cp do "
          "not fsync, so part of their writeback happens later and shows up only in 'wall+sync'. 'CPU' is user+sys "
          "time of the command and its descendants (less sensitive than wall time to other processes on the box).")
    print("peak RSS: " + RSS_NOTE)

    if args.markdown_out:
        md = [f"Measured {mach['date']} on this machine: {mach['nproc']} CPUs ({mach['cpu']}), {mach['ram']} RAM; "
              f"Python {mach['python']}, torch {mach['torch']}, deepspeed {mach['deepspeed']}, ucp {mach['ucp']}.",
              "",
              f"Checkpoint: {info['params'] / 1e6:.1f}M-parameter Llama (hidden {info['config']['hidden_size']}, "
              f"{info['config']['num_hidden_layers']} layers, {info['config']['num_attention_heads']} heads / "
              f"{info['config']['num_key_value_heads']} KV heads, vocab {info['config']['vocab_size']}, untied), "
              f"DeepSpeed ZeRO-{info['zero_stage']} {info['dtype']}, DP {info['world_size']}, AdamW; "
              f"{fmt_bytes(src_bytes)} in {src_files} files. Workers = {args.workers} for every tool; "
              f"medians of {args.repeat} run(s); warm page cache (one untimed `cp -r` first); outputs deleted "
              f"and `sync` between runs. 1-min load average {load}.",
              "",
              md_table(rows),
              "",
              "| target | measured | goal | |",
              "|---|---:|---|---|"]
        md += [f"| {label} | {value} | {target} | {verdict} |" for label, value, target, verdict in targets]
        md += ["",
               f"Correctness: all {len(verification) - len(crc_names)} tensors equal "
               f"(`torch.equal`) between `ucp.open_checkpoint(out).tensor(name, state)` and ds_to_universal's "
               f"`zero/<name>/<state>.pt` for {', '.join(f'`{n}`' for n in names)} × "
               f"{'/'.join(VERIFY_STATES)}; `ucp convert --format deepspeed` wrote identical files"
               + "".join(f"; with CRC-32 {name}, ucp convert wrote the same bytes as with {crc_default}"
                         for name in crc_names) + "."
               if verified else "Correctness: MISMATCH:\n\n" + "\n".join(f"    {v}" for v in verification),
               "",
               "*wall* is the command's run time; *wall+sync* adds a `sync` right after it. ucp fsyncs its data "
               "files before committing the index, so its writeback is inside *wall*; ds_to_universal and `cp` "
               "do not fsync. *CPU* is user+sys time of the command and its descendants, less sensitive than wall time "
               "to other processes competing for the cores.",
               "",
               "*peak RSS*: " + RSS_NOTE,
               ""]
        Path(args.markdown_out).write_text("\n".join(md))
        print(f"\nmarkdown written to {args.markdown_out}")
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())
