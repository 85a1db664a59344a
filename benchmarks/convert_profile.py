#!/usr/bin/env python
"""Where `ucp convert`'s time goes: start-up, plan, read, union, checksum, write, fsync, per source family.

    python benchmarks/convert_profile.py [--source zero1 zero2-bf16 zero3 autotp] [--tree DIR] [--repeat 3]

For each source (the checkpoints of benchmarks/convert.py, built there once), it measures

* *start-up*: a fresh interpreter importing what `ucp convert` imports (the driver's cost before any work;
  forked workers inherit it);
* the phases of one conversion run in this process with ONE worker (`LocalExecutor(1)`) and one copy
  thread (so that they add up to the run), timed by wrapping ucp's functions: *plan* (reading the rank
  files' pickles), *read* (positional reads of tensor bytes), *union* (Union / StripPad / dtype casts),
  *checksum* (CRC-32 of the bytes written, and of source bytes not written as read), *write* (writes into
  the output files), *fsync* (the fsyncs of the data files);
* *wall*: the whole `ucp convert --workers 2` command, and `cp -r` + `sync` of the tag folder (medians of
  `--repeat`), and their ratio.

`--tree DIR` profiles another checkout of ucp (e.g. `git worktree add /tmp/before <commit>`) instead of the
installed one, so the same numbers can be taken before and after a change.
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

HERE = Path(__file__).resolve().parent
PHASES = ("plan", "read", "union", "checksum", "write", "fsync")
# Run in a fresh interpreter: makes `import ucp` resolve to the tree given (or the installed ucp), then runs.
PRELUDE = """
import sys
tree = {tree!r}
if tree:
    import os, tempfile
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
    pkg = tempfile.mkdtemp(prefix="ucp-tree-")
    os.mkdir(os.path.join(pkg, "ucp"))
    for name in os.listdir(os.path.join(tree, "ucp")):
        os.symlink(os.path.join(tree, "ucp", name), os.path.join(pkg, "ucp", name))
    for sub in ("converters", "patterns", "cli"):
        os.symlink(os.path.join(tree, sub), os.path.join(pkg, "ucp", sub))
    sys.path.insert(0, pkg)
"""
STARTUP = PRELUDE + """
import time
t = time.perf_counter()
import ucp.cli.commands, ucp.convert, ucp.converters
print(time.perf_counter() - t)
"""
PHASE_RUN = PRELUDE + """
import importlib, json, shutil, threading, time, zlib

def first(*names):  # this checkout's module, or its name before the package move (a --tree of an older commit)
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    raise ImportError(names)

zero = first("ucp.converters.dispatch", "ucp.converters.deepspeed_zero")
assemble = first("ucp.plan.assemble", "ucp.assemble")
st = first("ucp.format.safetensors_stream", "ucp.safetensors_stream")
crc = first("ucp.format.crc", "ucp.crc")
LocalExecutor = first("ucp.convert.executor", "ucp.executor").LocalExecutor
convert = first("ucp.convert.driver", "ucp.convert").convert
spent = {{}}
lock = threading.Lock()

def timed(owner, name, phase):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            with lock:
                spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - t
    setattr(owner, name, wrapper)

class Crc:  # zlib as the writers of earlier versions see it, with crc32 timed
    def __getattr__(self, name):
        return getattr(zlib, name)
    def crc32(self, *args):
        t = time.perf_counter()
        try:
            return zlib.crc32(*args)
        finally:
            with lock:
                spent["checksum"] = spent.get("checksum", 0.0) + time.perf_counter() - t

timed(zero, "plan_deepspeed", "plan")
timed(assemble, "pread_into", "read")
for name in ("union", "strip_pad"):
    timed(assemble, name, "union")
try:  # the copy path (ucp.convert.bin_copy)
    bc = first("ucp.convert.bin_copy", "ucp.bin_copy")
    bc.THREADS = 1  # one block at a time, so that the phases add up to the run
    if hasattr(bc, "zlib"):  # before ucp.format.crc.crc32
        bc.zlib = Crc()
    else:
        timed(bc, "crc32", "checksum")
    timed(bc.Sources, "read", "read")
    timed(bc, "cast", "union")
    timed(bc.BinFile, "write", "write")
    timed(bc.BinFile, "close", "fsync")
except ImportError:  # the streaming writer of earlier versions: write() includes its CRCs, subtracted below
    def _timed_crcs(data, begin, chunk_bytes, _f=crc.segment_crcs):
        t = time.perf_counter()
        try:
            return _f(data, begin, chunk_bytes)
        finally:
            with lock:
                spent["checksum"] = spent.get("checksum", 0.0) + time.perf_counter() - t
    st.segment_crcs = _timed_crcs
    timed(st.StreamingWriter, "write", "write+checksum")
    timed(st.StreamingWriter, "close", "fsync")
out = {output!r}
shutil.rmtree(out, ignore_errors=True)
t = time.perf_counter()
convert({source!r}, out, workers=1, executor=LocalExecutor(1, progress=False))
spent["run"] = time.perf_counter() - t
if "write+checksum" in spent:
    spent["write"] = spent.pop("write+checksum") - spent.get("checksum", 0.0)
shutil.rmtree(out, ignore_errors=True)
print(json.dumps(spent))
"""


def run_python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, cwd=tempfile.gettempdir())
    if done.returncode != 0:
        sys.exit(f"profiling run failed:\n{done.stderr[-3000:]}")
    return done.stdout.strip().splitlines()[-1]


def timed_command(cmd: list[str], env: dict[str, str] | None = None) -> float:
    os.sync()
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    return time.perf_counter() - t


def ucp_cli(tree: str | None) -> list[str]:
    return [sys.executable, "-c", PRELUDE.format(tree=tree) + "from ucp.cli.main import main\nsys.exit(main())"]


def profile(source: str, save_dir: Path, tree: str | None, repeat: int, scratch: Path) -> dict[str, float]:
    tag = (save_dir / "latest").read_text().strip()
    subprocess.run(["cp", "-r", str(save_dir / tag), str(scratch / "warm")], check=True)  # warm page cache
    shutil.rmtree(scratch / "warm")
    row: dict[str, float] = {}
    row["start-up"] = statistics.median(float(run_python(STARTUP.format(tree=tree))) for _ in range(repeat))
    phases = [__import__("json").loads(run_python(PHASE_RUN.format(tree=tree, source=str(save_dir),
                                                                   output=str(scratch / "phases"))))
              for _ in range(repeat)]
    for phase in (*PHASES, "run"):
        row[phase] = statistics.median(p.get(phase, 0.0) for p in phases)
    copies, converts = [], []
    for _ in range(repeat):
        copies.append(timed_command(["sh", "-c", f"cp -r '{save_dir / tag}' '{scratch / 'copy'}' && sync"]))
        shutil.rmtree(scratch / "copy")
        converts.append(timed_command([*ucp_cli(tree), "convert", "--input", str(save_dir), "--output",
                                       str(scratch / "out"), "--workers", "2", "--quiet"],
                                      env={**os.environ, "DS_ACCELERATOR": "cpu"}))
        shutil.rmtree(scratch / "out")
    row["cp+sync"] = statistics.median(copies)
    row["wall"] = statistics.median(converts)
    row["ratio"] = row["wall"] / row["cp+sync"]
    return row


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from convert import SOURCES, build_checkpoint
    from convert_autotp import build_checkpoint as build_autotp

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", nargs="+", choices=(*SOURCES, "autotp"), default=[*SOURCES, "autotp"])
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/ucp-bench"),
                    help="where benchmarks/convert.py keeps its checkpoints")
    ap.add_argument("--tree", help="profile the ucp checkout at DIR instead of the installed one")
    ap.add_argument("--repeat", type=int, default=3, help="runs per measurement; medians are shown")
    args = ap.parse_args(argv)
    cache = Path(args.cache).expanduser()
    tree = str(Path(args.tree).resolve()) if args.tree else None
    head = ["source", "start-up", *PHASES, "run (1 worker)", "wall (2 workers)", "cp -r + sync", "ratio"]
    print("| " + " | ".join(head) + " |\n|" + "---|" + "---:|" * (len(head) - 1), flush=True)
    for source in args.source:
        save_dir = build_autotp(cache) if source == "autotp" else build_checkpoint(cache, source)
        scratch = Path(tempfile.mkdtemp(prefix="ucp-profile-"))
        try:
            row = profile(source, save_dir, tree, args.repeat, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        cells = [f"{row[k]:.2f}" for k in ("start-up", *PHASES, "run", "wall", "cp+sync")] + [f"{row['ratio']:.2f}x"]
        print(f"| {source} | " + " | ".join(cells) + " |", flush=True)
    print(f"\n1-min load average {os.getloadavg()[0]:.1f}; seconds; phases of one worker with one copy thread")
    return 0


if __name__ == "__main__":
    sys.exit(main())
