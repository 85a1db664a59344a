#!/usr/bin/env python
"""Ray backend benchmark: ucp on Ray against local ucp and ds_to_universal, for 1, 2 and 4 workers.

    python benchmarks/convert_ray.py [--workers 1,2,4] [--repeat 1] [--cache DIR] [--markdown-out FILE]

Uses the checkpoint of benchmarks/convert.py (a ~112M-parameter Llama, ZeRO-1 fp32, DP 2, built once
and cached), plus the tiny test model (tests/support) to isolate Ray's fixed cost. For every worker
count it times, with a warm page cache:

* `ucp convert` (the local process pool);
* `ucp convert --executor ray`, which starts and stops its own local Ray instance: what one machine
  without a cluster pays;
* `ucp convert --executor ray --ray-address ...` on a Ray cluster that is already running (started
  here with `ray start --head --num-cpus=<max workers>`): the mode of a training cluster;
* DeepSpeed's `ds_to_universal.py` with as many extract and merge workers.

Peak RSS sums the command's process tree, sampled every 20 ms; for the running cluster it adds the
cluster's processes, whose idle footprint is reported separately. Every Ray output is checked byte
for byte against the local one.

A last table separates Ray's fixed cost from its cost per byte: one driver converts the benchmark
checkpoint several times in a row on the running cluster (Ray workers stay warm after the first
round) and on the local pool, so the later rounds show the steady-state throughput.
"""
from __future__ import annotations

import argparse
import contextlib
import filecmp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # benchmarks/convert.py, beside this script

from convert import base_env, build_checkpoint, ds_to_universal_script, free_port, tree_size  # noqa: E402

TINY_TRAIN_SCRIPT = HERE.parent / "tests" / "support" / "train_tiny.py"  # run as a script, not imported

POLL_S = 0.02
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "DS_ACCELERATOR": "cpu"}


@dataclass
class Run:
    tool: str
    workers: int
    wall: float
    peak_rss: int
    out_bytes: int
    identical: bool | None = None


def env() -> dict[str, str]:
    return {**os.environ, **RAY_ENV}


def session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(p.pid) == sid:
                found.append(p)
    return found


def rss_of(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


def measure(cmd: list[str], out: Path, cluster_sid: int | None = None) -> tuple[float, int]:
    """Wall time and peak RSS of `cmd` (its process tree, plus the cluster's processes when given)."""
    os.sync()
    peak = 0
    t0 = time.perf_counter()
    proc = psutil.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    done = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.is_set():
            with contextlib.suppress(psutil.Error):
                procs = [proc] + proc.children(recursive=True)
                if cluster_sid is not None:
                    procs += session_processes(cluster_sid)
                peak = max(peak, rss_of(list({p.pid: p for p in procs}.values())))
            done.wait(POLL_S)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, err = proc.communicate()
    wall = time.perf_counter() - t0
    done.set()
    poller.join()
    if proc.returncode != 0:
        sys.exit(f"failed (exit {proc.returncode}): {' '.join(cmd)}\n{err.decode(errors='replace')[-3000:]}")
    return wall, peak


def same_tree(a: Path, b: Path) -> bool:
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


@contextlib.contextmanager
def ray_cluster(root: Path, cpus: int):
    """`ray start --head --block` in its own session; yields (address, session id); stops exactly it."""
    temp_dir = root / "ray"
    temp_dir.mkdir(parents=True)
    cmd = ["ray", "start", "--head", "--block", f"--port={free_port()}", f"--num-cpus={cpus}",
           "--disable-usage-stats", f"--temp-dir={temp_dir}", "--include-dashboard=false",
           f"--ray-client-server-port={free_port()}"]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        address_file = temp_dir / "ray_current_cluster"
        deadline = time.monotonic() + 120
        while not address_file.is_file() or not address_file.read_text().strip():
            if proc.poll() is not None or time.monotonic() > deadline:
                sys.exit("ray start failed")
            time.sleep(0.2)
        time.sleep(3)  # let the raylet and its agents settle before measuring the idle footprint
        yield address_file.read_text().strip(), proc.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=20)
        for p in session_processes(proc.pid):
            with contextlib.suppress(psutil.Error):
                p.kill()


def tiny_checkpoint(cache: Path) -> Path:
    """The tests' tiny model (ZeRO-1, fp32, 2 ranks, 3 steps), trained once into `cache/tiny`."""
    folder = cache / "tiny"
    if (folder / ".done").is_file():
        return folder / "ckpt"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(TINY_TRAIN_SCRIPT),
           "--stage", "1", "--steps", "3", "--save-dir", str(folder / "ckpt"),
           "--losses-out", str(folder / "losses.json")]
    with open(folder / "train.log", "w") as log:
        if subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=base_env()).returncode != 0:
            sys.exit(f"training the tiny checkpoint failed; see {folder / 'train.log'}")
    (folder / ".done").touch()
    return folder / "ckpt"


def ucp(*args: str) -> list[str]:
    exe = shutil.which("ucp")
    return ([exe] if exe else [sys.executable, "-m", "ucp.cli.main"]) + list(args)


def bench(source: Path, workers: list[int], repeat: int, tmp: Path, with_ds: bool) -> tuple[list[Run], int]:
    runs: list[Run] = []
    with ray_cluster(tmp, max(workers)) as (address, sid):
        idle = rss_of(session_processes(sid))
        for w in workers:
            n = str(w)
            local_out = tmp / f"local-{w}"
            commands = {
                "ucp (local)": (ucp("convert", "--input", str(source), "--output", str(local_out), "--workers", n,
                                    "--quiet"), local_out, None),
                "ucp --executor ray (own Ray)": (ucp("convert", "--input", str(source), "--output", str(tmp / "own"),
                                                     "--workers", n, "--quiet", "--executor", "ray"),
                                                 tmp / "own", None),
                "ucp --executor ray (running cluster)": (ucp("convert", "--input", str(source), "--output",
                                                             str(tmp / "cluster"), "--workers", n, "--quiet",
                                                             "--executor", "ray", "--ray-address", address),
                                                         tmp / "cluster", sid),
            }
            if with_ds:
                tag = (source / "latest").read_text().strip()
                commands["ds_to_universal.py"] = ([sys.executable, str(ds_to_universal_script()), "--input_folder",
                                                   str(source / tag), "--output_folder", str(tmp / "ds" / tag),
                                                   "--num_extract_workers", n, "--num_merge_workers", n,
                                                   "--inject_missing_state"], tmp / "ds", None)
            for tool, (cmd, out, cluster_sid) in commands.items():
                samples = []
                for _ in range(repeat):
                    shutil.rmtree(out, ignore_errors=True)
                    samples.append(measure(cmd, out, cluster_sid))
                wall, peak = min(samples)
                run = Run(tool, w, wall, peak, tree_size(out)[0])
                if "ray" in tool:
                    run.identical = same_tree(out, local_out)
                runs.append(run)
                print(f"  workers={w} {tool:38s} {wall:7.2f} s  peak RSS {peak / 2**20:7,.0f} MiB"
                      f"{'' if run.identical is None else '  identical' if run.identical else '  DIFFERENT'}",
                      flush=True)
                if out != local_out:
                    shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(local_out, ignore_errors=True)
    return runs, idle


def steady_state(source: Path, workers: list[int], address: str, tmp: Path, rounds: int) -> list[str]:
    """Markdown rows: the first and the fastest later round of `rounds` conversions in one driver."""
    from ucp.convert import convert
    from ucp.convert.executor import LocalExecutor
    from ucp.convert.ray_executor import RayExecutor

    rows = []
    for w in workers:
        for tool, executor in (("ucp (local)", contextlib.nullcontext(LocalExecutor(w, progress=False))),
                               ("ucp on Ray (running cluster)", RayExecutor(address, w, progress=False))):
            times = []
            with executor as ex:
                for i in range(rounds):
                    out = tmp / f"steady-{w}-{i}"
                    t0 = time.perf_counter()
                    result = convert(source, out, executor=ex)
                    times.append(time.perf_counter() - t0)
                    shutil.rmtree(out)
            best = min(times[1:])
            rows.append(f"| {w} | {tool} | {times[0]:.2f} | {best:.2f} | {result.bytes_written / best / 1e9:.3f} |")
            print(f"  steady state workers={w} {tool:30s} first {times[0]:6.2f} s, then {best:6.2f} s", flush=True)
    return ["| workers | executor | first round s | later rounds s (best) | output GB/s (later) |",
            "|---:|---|---:|---:|---:|"] + rows


def md_table(runs: list[Run]) -> str:
    rows = ["| workers | tool | wall s | peak RSS MiB | output GB/s | same bytes as local |",
            "|---:|---|---:|---:|---:|---|"]
    for r in runs:
        same = "" if r.identical is None else "yes" if r.identical else "**no**"
        rows.append(f"| {r.workers} | {r.tool} | {r.wall:.2f} | {r.peak_rss / 2**20:,.0f} | "
                    f"{r.out_bytes / r.wall / 1e9:.3f} | {same} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", default="1,2,4", help="comma-separated worker counts (default 1,2,4)")
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per cell; the table keeps the fastest")
    ap.add_argument("--cache", default=os.path.expanduser("~/.cache/ucp-bench"), help="checkpoint cache")
    ap.add_argument("--rounds", type=int, default=4, help="conversions per driver in the steady-state table")
    ap.add_argument("--markdown-out", metavar="FILE", help="also write the tables as markdown")
    args = ap.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    cache = Path(args.cache).expanduser()
    big, tiny = build_checkpoint(cache), tiny_checkpoint(cache)
    tmp = Path(tempfile.mkdtemp(prefix="ucp-bench-ray-"))
    try:
        subprocess.run(["cp", "-r", str(big), str(tmp / "warmup")], check=True)  # warm the page cache
        shutil.rmtree(tmp / "warmup")
        print(f"tiny checkpoint ({tree_size(tiny)[0] / 1e3:.0f} kB): Ray's fixed cost", flush=True)
        tiny_runs, _ = bench(tiny, workers[:1] + workers[-1:] if len(workers) > 1 else workers, args.repeat,
                             tmp / "tiny", with_ds=False)
        print(f"benchmark checkpoint ({tree_size(big)[0] / 1e9:.2f} GB)", flush=True)
        big_runs, idle = bench(big, workers, args.repeat, tmp / "big", with_ds=True)
        print("steady state (one driver, several rounds)", flush=True)
        with ray_cluster(tmp / "steady", max(workers)) as (address, _):
            steady = steady_state(big, workers, address, tmp / "steady", args.rounds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    load = os.getloadavg()[0]
    text = "\n".join([
        f"Benchmark checkpoint: {tree_size(big)[0] / 1e9:.2f} GB ({os.cpu_count()} CPUs, "
        f"1-min load average {load:.1f} at the end; fastest of {args.repeat} run(s) per cell; idle cluster "
        f"{idle / 2**20:,.0f} MiB RSS)", "", md_table(big_runs), "",
        f"Tiny checkpoint ({tree_size(tiny)[0] / 1e3:.0f} kB): what Ray costs when there is nothing to convert",
        "", md_table(tiny_runs), "",
        f"Steady state: one driver converts the benchmark checkpoint {args.rounds} times in a row", "",
        *steady, ""])
    print("\n" + text)
    if args.markdown_out:
        Path(args.markdown_out).write_text(text)
    return 0 if all(r.identical is not False for r in big_runs + tiny_runs) else 1


if __name__ == "__main__":
    sys.exit(main())
