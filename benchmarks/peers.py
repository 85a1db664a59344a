#!/usr/bin/env python
"""Benchmark: ucp side by side with the tools people would pick instead, on the same DeepSpeed job (issue #31).

    python benchmarks/peers.py [--quick] [--json-out FILE] [--markdown-out FILE] [--work DIR] [--worlds N ...]
                               [--new-size-from N] [--new-size-model {20m,112m}] [--only recoveries]

The ~112M-parameter benchmark Llama (`--quick`: the 19.8M one, 2 ranks only), ZeRO-1 fp32, on CPU ranks
(`benchmarks/_peers_llama.py`), each tool under its own launcher and through its own API:

* ucp: `ucp.deepspeed.save` (asynchronous, to disk) and the memory tier (`"save": {"memory": ...}`), restarts by
  torchrun with `"load": "auto"`; DeepSpeed: `engine.save_checkpoint`. One torchrun job per world size holds
  the three, one after the other on the same engine.
* DLRover (pip `dlrover`): Flash Checkpoint's DeepSpeed API, `DeepSpeedCheckpointer.save_checkpoint` with
  `StorageType.MEMORY` (dlrover) and `StorageType.DISK` (dlrover_disk), under `dlrover-run`, whose agent holds
  the shared memory and persists it. dlrover-run's own local master (`--standalone`) does not start under torch
  2.13, so the benchmark starts DLRover's master itself (`python -m dlrover.python.master.main --platform local`)
  and points dlrover-run at it, as for a multi-node job; DLRover 0.6.1's save and load also need a shim for
  DeepSpeed 0.19 (`_peers_llama.accept_torch_keywords`). Both are in the report.
* PyTorch DCP (dcp), the reference for save stalls: `dcp.async_save` with a process-based checkpointer and
  DefaultStager on the FSDP2 equivalent of the job (`benchmarks/_peers_dcp.py`), under torchrun; saves only.

Measured:

1. **Save**, per tool (slowest rank): *blocked*, the save call (training is held that long); *durable*, from the
   call until the checkpoint is on disk and synced (ucp: fsynced, index committed; DeepSpeed and DLRover's agent
   do not fsync their data, so theirs ends with `sync`); memory tiers have no durable time (null, with why);
   *overhead*, the mean step time with a save after every step and after every 4th against plain steps; bytes
   one save puts where it goes; peak RSS per rank (VmHWM, reset before each tool) and of the launcher.
2. **Recovery at the same size**: memory saves after every step; after step K one worker is SIGKILLed; the
   launcher restarts the workers, which load from memory. Fault → end of the first step after it, split as
   benchmarks/elastic.py does: detection + relaunch (until the new worker's main), start-up, load, first step;
   and the start-up in its parts: relaunch (fault → the new worker process), imports, rendezvous (the process
   group), model, engine init (ucp's load, which runs inside `initialize`, taken out), load, first step.
3. **Recovery at a new size** (N → N−1 ranks): a job of N ranks trains K steps with memory saves and ends, and
   a job of N−1 starts. ucp: `"load": "auto"` (from memory). DLRover: its `load_checkpoint` at the new size
   (DeepSpeed refuses a ZeRO checkpoint of another data-parallel size; the refusal is recorded), then the path
   DLRover documents for DeepSpeed at a new world size, DeepSpeed's universal checkpoint: `ds_to_universal.py` on
   DLRover's disk checkpoint and a job with `"load_universal": true`. Relaunch → first step (no fault detection:
   both jobs are started by the benchmark). `--new-size-from` and `--new-size-model` run it at another size than
   the saves (when the machine cannot hold the full run in time).

`--only recoveries` skips the saves and runs items 2 and 3 alone (at the largest of `--worlds`): the table and
the JSON then carry only the recovery columns and keys.

`--json-out` writes `{tool: {"blocked_s", "durable_s", "overhead_every1", "recovery_same_size_s",
"recovery_new_size_s", ..., "why": {key: reason}}}` for ucp, ucp_memory, dlrover, dlrover_disk, deepspeed, dcp;
null where a tool cannot do a thing.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from elastic import env, free_port, kill_tree, records, to_universal, wait_until  # noqa: E402

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_peers_llama.py"
WORKERS = {"dcp": HERE / "_peers_dcp.py"}  # by family; the others run WORKER
TOOLS = ("ucp", "ucp_memory", "dlrover", "dlrover_disk", "deepspeed", "dcp")
KEYS = ("blocked_s", "durable_s", "overhead_every1", "recovery_same_size_s", "recovery_new_size_s")
SAVE_KEYS = ("blocked_s", "durable_s", "overhead_every1", "overhead_every4", "bytes_per_save", "peak_rss_per_rank",
             "by_world")
MEMORY_ONLY = "saves to host memory only; nothing is on disk until another save writes it"
NOT_A_RECOVERY_TIER = "recovery is measured from memory (ucp_memory, dlrover), as the issue asks"
NO_RESTORE = "DeepSpeed alone restarts nothing and has no memory tier: its restart is a new job from disk"
DCP_SAVES_ONLY = ("DCP's async save is the reference for save stalls only (the issue's item 1); it runs on an FSDP2 "
                  "job, not the DeepSpeed one, so no DeepSpeed recovery is measured with it")
START_PARTS = ("relaunch_s", "imports_s", "rendezvous_s", "model_s", "engine_init_s", "load_s", "first_step_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="the 19.8M Llama on 2 ranks (new size: 2 -> 1), fewer steps")
    p.add_argument("--json-out", help="write {tool: {blocked_s, durable_s, ...}} here")
    p.add_argument("--markdown-out", help="write the table here")
    p.add_argument("--work", help="working folder (default: a temporary one, removed)")
    p.add_argument("--worlds", type=int, nargs="+", help="world sizes of the saves (default: 2 4; --quick: 2); "
                   "the recoveries run at the largest")
    p.add_argument("--new-size-from", type=int, help="the new-size recovery goes from this many ranks to one fewer "
                   "(default: the largest of --worlds)")
    p.add_argument("--new-size-model", choices=("20m", "112m"), help="the model of the new-size recovery (default: "
                   "the run's)")
    p.add_argument("--only", choices=("recoveries",), help="run only the recoveries (no saves); the table and the "
                   "JSON carry only their columns")
    args = p.parse_args(argv)
    args.model = "20m" if args.quick else "112m"
    args.worlds = args.worlds or ([2] if args.quick else [2, 4])
    args.new_size_from = args.new_size_from or max(args.worlds)
    args.new_size_model = args.new_size_model or args.model
    # saves: plain steps, saves one by one, steps with a save after each, steps with a save after every 4th
    args.counts = ["--plain", "2", "--rounds", "2", "--every1", "3", "--every4", "4"] if args.quick else \
        ["--plain", "3", "--rounds", "3", "--every1", "4", "--every4", "8"]
    args.kill_after, args.steps = (3, 5) if args.quick else (4, 7)
    return args


class Launch:
    """One job under a family's own launcher: torchrun (ucp and DeepSpeed; DCP's FSDP2 job) or dlrover-run
    (DLRover), which gets a DLRover master of its own."""

    def __init__(self, family: str, nproc: int, worker_args: list[str], log: Path, max_restarts: int = 0):
        self.master: subprocess.Popen | None = None
        self.job = ""
        extra = {}
        if family == "dlrover":
            port = free_port()
            self.job = job = f"peers-{port}"
            self.master, port = dlrover_master(port, job, log.with_suffix(".master.log"))
            extra = {"DLROVER_MASTER_ADDR": f"127.0.0.1:{port}", "ELASTIC_JOB_NAME": job}
            cmd = [str(Path(sys.executable).parent / "dlrover-run"), "--nnodes=1", f"--nproc_per_node={nproc}",
                   f"--max-restarts={max_restarts}"]
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
                   f"--max-restarts={max_restarts}", "--monitor-interval=0.5"]
        self.log = log
        self.began = time.time()
        worker = WORKERS.get(family, WORKER)
        with open(log, "w") as f:
            self.proc = subprocess.Popen([*cmd, str(worker), *worker_args], env={**env(), **extra}, stdout=f,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def kill_worker(self, local_rank: int = 1) -> float:
        def worker():
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    if str(WORKER) in " ".join(p.cmdline()) and p.environ().get("LOCAL_RANK") == str(local_rank):
                        return p
                except psutil.Error:
                    pass
            return None

        victim = wait_until(worker, 120, f"worker {local_rank}")
        at = time.time()
        victim.kill()
        return at

    def failed(self) -> bool:
        return self.proc.poll() not in (None, 0)

    def wait(self, timeout: float = 3600) -> None:
        try:
            code = self.proc.wait(timeout=timeout)
        finally:
            self.stop()
        if code != 0:
            raise SystemExit(f"{self.log}: the job failed (exit {code})")

    def stop(self) -> None:
        kill_tree(self.proc.pid)
        if self.master is not None:
            kill_tree(self.master.pid)
            for segment in Path("/dev/shm").glob(f"{self.job}_ckpt_shm_*"):  # DLRover's agent leaves them behind
                segment.unlink(missing_ok=True)


def dlrover_master(port: int, job: str, log: Path) -> tuple[subprocess.Popen, int]:
    """DLRover's master for one job, serving on `port` (another port when that one was taken meanwhile)."""
    for _ in range(3):
        master = subprocess.Popen([sys.executable, "-u", "-m", "dlrover.python.master.main", "--port", str(port),
                                   "--node_num", "1", "--job_name", job, "--platform", "local"], env=env(),
                                  stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: master.poll() is not None or "grpc server started" in log.read_text().lower(), 300,
                   "DLRover's master")
        if master.poll() is None:
            return master, port
        port = free_port()  # its port was taken between free_port() and the bind
    raise SystemExit(f"{log}: DLRover's master did not start")


def fresh(folder: Path) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return folder


def memory_folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="ucp-peers-", dir="/dev/shm"))


FAMILIES = {"torchrun": ["ucp", "ucp_memory", "deepspeed"], "dlrover": ["dlrover", "dlrover_disk"], "dcp": ["dcp"]}


def run_saves(args: argparse.Namespace, world: int, work: Path, families: tuple[str, ...] = tuple(FAMILIES)
              ) -> list[dict]:
    """Each family's save measurements on `world` ranks: one record per tool."""
    out = []
    for family in families:
        tools = FAMILIES[family]
        folder = fresh(work / f"save-{family}-{world}")
        memory = memory_folder()
        recs = folder / "records.jsonl"
        print(f"saves on {world} ranks: {', '.join(tools)} ...", flush=True)
        try:
            Launch(family, world, ["--tools", *tools, "--phase", "save", "--model", args.model, "--save-dir",
                                   str(folder / "ckpt"), "--memory-dir", str(memory), "--records", str(recs),
                                   *args.counts], folder / "job.log").wait()
        finally:
            shutil.rmtree(memory, ignore_errors=True)
        out += records(recs)
        shutil.rmtree(folder / "ckpt", ignore_errors=True)
    return out


def run_same_size(args: argparse.Namespace, world: int, work: Path, families: tuple[str, ...] = tuple(FAMILIES)
                  ) -> dict:
    """Kill worker 1 after step K; each launcher restarts the workers, which load from memory."""
    out = {}
    for family, tool in (("torchrun", "ucp"), ("dlrover", "dlrover")):
        if family not in families:
            continue
        folder = fresh(work / f"same-{family}-{world}")
        memory = memory_folder()
        recs = folder / "records.jsonl"
        print(f"recovery at the same size ({world} ranks): {tool} ...", flush=True)
        job = Launch(family, world, ["--tools", tool, "--phase", "recover", "--model", args.model, "--save-dir",
                                     str(folder / "ckpt"), "--memory-dir", str(memory), "--records", str(recs),
                                     "--steps", str(args.steps)], folder / "job.log", max_restarts=1)
        try:
            wait_until(lambda: job.failed() or any(r.get("step", 0) >= args.kill_after for r in records(recs)),
                       3600, f"step {args.kill_after}")
            if job.failed():
                raise SystemExit(f"{job.log}: the job failed (exit {job.proc.returncode})")
            fault = job.kill_worker()
            try:
                job.wait()
                after = None
            except SystemExit:  # the restart is measured at its first step; a failure after it is reported
                after = first_error(job.log)
        finally:
            job.stop()
            shutil.rmtree(memory, ignore_errors=True)
        restart = next((r["restart"] for r in records(recs) if "restart" in r), None)
        out["ucp_memory" if tool == "ucp" else tool] = split(restart, fault, world, world)
        if after is not None:
            out["ucp_memory" if tool == "ucp" else tool]["failed_after"] = after
        shutil.rmtree(folder / "ckpt", ignore_errors=True)
    return out


def first_error(log: Path) -> str:
    """The first exception a worker raised, from its launcher's log: `[rankN]: KeyError: 'model_states'`."""
    for line in log.read_text(errors="replace").splitlines():
        if re.match(r"\[rank\d+\]: \w+(Error|Exception): ", line):
            return line
    return f"{log}: the job failed after the restart"


def split(restart: dict | None, fault: float, old: int, new: int) -> dict:
    """A restart record, as benchmarks/elastic.py reports one: fault (or relaunch) -> first step, and its parts."""
    if restart is None:
        return {"failed": "no restart record: the restarted job did not load a checkpoint"}
    split = {"old_world": old, "new_world": new, "total_s": restart["first_step_at"] - fault,
             "detection_s": restart["called"] - fault, "startup_s": restart["startup_s"], "load_s": restart["load_s"],
             "first_step_s": restart["first_step_s"], "checkpoint_step": restart.get("checkpoint_step")}
    for key in ("params", "sections"):  # the model's size; where ucp's engine init, load and first step go
        if key in restart:
            split[key] = restart[key]
    if "process_at" in restart:  # the start-up's parts (_peers_llama.StartMarks)
        split["parts"] = {"relaunch_s": restart["process_at"] - fault,
                          **{k: restart[k] for k in START_PARTS if k in restart and k != "relaunch_s"}}
    return split


def run_new_size(args: argparse.Namespace, world: int, work: Path) -> dict:
    """N ranks train and end; N-1 ranks start from what they left: ucp's "auto", DLRover's load and its
    universal-checkpoint path. On --new-size-model."""
    out: dict = {"model": args.new_size_model}
    model = args.new_size_model
    common = ["--model", model, "--steps", str(args.kill_after)]
    # ucp
    folder = fresh(work / f"new-ucp-{world}")
    memory = memory_folder()
    recs = folder / "records.jsonl"
    ckpt = ["--save-dir", str(folder / "ckpt"), "--memory-dir", str(memory), "--records", str(recs)]
    print(f"recovery at a new size ({world} -> {world - 1} ranks): ucp ...", flush=True)
    try:
        Launch("torchrun", world, ["--tools", "ucp", "--phase", "recover", *common, *ckpt], folder / "a.log").wait()
        job = Launch("torchrun", world - 1, ["--tools", "ucp", "--phase", "recover", "--model", model,
                                             "--steps", str(args.kill_after + 1), *ckpt], folder / "b.log")
        job.wait()
    finally:
        shutil.rmtree(memory, ignore_errors=True)
    restart = next((r["restart"] for r in records(recs) if "restart" in r), None)
    out["ucp_memory"] = split(restart, job.began, world, world - 1)
    # DLRover
    folder = fresh(work / f"new-dlrover-{world}")
    recs = folder / "records.jsonl"
    ckpt = ["--save-dir", str(folder / "ckpt"), "--records", str(recs)]
    print(f"recovery at a new size ({world} -> {world - 1} ranks): dlrover ...", flush=True)
    Launch("dlrover", world, ["--tools", "dlrover", "--phase", "recover", *common, *ckpt], folder / "a.log").wait()
    direct = Launch("dlrover", world - 1, ["--tools", "dlrover", "--phase", "resize", "--model", model,
                                           "--save-dir", str(folder / "ckpt"), "--records", str(folder / "b.jsonl")],
                    folder / "b.log")
    direct.wait()
    refused = next((r["refused"] for r in records(folder / "b.jsonl") if "refused" in r), None)
    loaded = next((r["resized"] for r in records(folder / "b.jsonl") if "resized" in r), None)
    tag = (folder / "ckpt" / "latest").read_text().strip()
    convert_s = to_universal(folder / "ckpt" / tag, folder / "universal" / tag)
    job = Launch("dlrover", world - 1, ["--tools", "dlrover", "--phase", "resize", "--model", model, *ckpt,
                                        "--load-universal", str(folder / "universal" / tag)], folder / "c.log")
    job.wait()
    resized = next((r["resized"] for r in records(recs) if "resized" in r), None)
    universal = split(resized, job.began, world, world - 1)
    universal["convert_s"] = convert_s
    universal["checkpoint_step"] = int(tag) if tag.isdigit() else tag  # DLRover's last disk save: its memory is gone
    if "total_s" in universal:
        universal["total_s"] += convert_s
    out["dlrover"] = {"load_checkpoint": {"refused": refused} if refused else split(loaded, direct.began, world,
                                                                                    world - 1),
                      "universal": universal, "tag_converted": tag}
    return out


def summarize(saves: list[dict], same: dict, new: dict, recoveries_only: bool = False) -> dict:
    """The JSON of --json-out from the measured records (pure): per tool the issue's keys, null with a reason
    under "why" where the tool cannot do the thing, and the details; `recoveries_only` (no saves were run): the
    recovery keys alone."""
    by_world: dict[str, dict[int, dict]] = {}
    for r in saves:
        by_world.setdefault(r["tool"], {})[r["world"]] = r
    result = {}
    for tool in TOOLS:
        worlds = by_world.get(tool, {})
        entry: dict = {key: None for key in KEYS}
        why: dict[str, str] = {}
        details = {}
        for world, r in sorted(worlds.items()):
            details[str(world)] = save_figures(r)
        if details:
            top = details[str(max(worlds))]
            entry.update(blocked_s=top["blocked_s"], durable_s=top["durable_s"],
                         overhead_every1=top["overhead_every1"], overhead_every4=top["overhead_every4"],
                         bytes_per_save=top["bytes_per_save"], peak_rss_per_rank=top["peak_rss_per_rank"])
        else:
            why["blocked_s"] = why["overhead_every1"] = "not measured"
        if tool in ("ucp_memory", "dlrover"):
            why["durable_s"] = MEMORY_ONLY
        recovery_tool = tool
        if tool in ("ucp", "dlrover_disk"):
            why["recovery_same_size_s"] = why["recovery_new_size_s"] = NOT_A_RECOVERY_TIER
            recovery_tool = ""
        if tool == "deepspeed":
            why["recovery_same_size_s"] = why["recovery_new_size_s"] = NO_RESTORE
            recovery_tool = ""
        if tool == "dcp":
            why["recovery_same_size_s"] = why["recovery_new_size_s"] = DCP_SAVES_ONLY
            recovery_tool = ""
            for world, r in sorted(worlds.items()):
                if "pinned_refused" in r:
                    why["pinned_staging"] = f"asked for; on {world} ranks DCP said: {r['pinned_refused']}"
        if recovery_tool:
            s = same.get(recovery_tool)
            if s and "total_s" in s:
                entry["recovery_same_size_s"] = s["total_s"]
            elif s:
                why["recovery_same_size_s"] = s.get("failed", "not measured")
            n = new.get(recovery_tool)
            if tool == "ucp_memory" and n and "total_s" in n:
                entry["recovery_new_size_s"] = n["total_s"]
            elif tool == "dlrover" and n:
                paths = [r["total_s"] for r in (n["load_checkpoint"], n["universal"]) if "total_s" in r]
                entry["recovery_new_size_s"] = min(paths, default=None)  # the best peer path that ran
                refused = n["load_checkpoint"].get("refused")
                why["recovery_new_size_s"] = (
                    "DLRover's load_checkpoint at the new size: " + (f"refused: {refused}" if refused else "loaded")
                    + "; the other path, the one DLRover documents for DeepSpeed at a new world size: "
                    "ds_to_universal.py on its disk checkpoint + a job with load_universal; the figure is the "
                    "faster of those that ran")
        entry["by_world"] = details
        entry["recovery_same_size"] = same.get(recovery_tool) if recovery_tool else None
        entry["recovery_new_size"] = new.get(recovery_tool) if recovery_tool else None
        entry["why"] = {key: reason for key, reason in why.items()
                        if entry.get(key) is None or "DLRover" in reason or key not in entry}
        if recoveries_only:
            entry = {key: value for key, value in entry.items() if key not in SAVE_KEYS}
            entry["why"] = {key: reason for key, reason in entry["why"].items() if key not in SAVE_KEYS}
        result[tool] = entry
    return result


def save_figures(r: dict) -> dict:
    """One tool's save record -> medians and overheads (pure)."""
    plain = statistics.mean(r["plain_s"])
    durable = [d for d in r["durable_s"] if d is not None]
    return {"blocked_s": statistics.median(r["blocked_s"]),
            "durable_s": statistics.median(durable) if durable else None,
            "committed_s": statistics.median(r["committed_s"]),
            "plain_step_s": plain,
            "overhead_every1": statistics.mean(r["every1_s"]) / plain - 1,
            "overhead_every4": statistics.mean(r["every4_s"]) / plain - 1,
            "bytes_per_save": r["bytes_per_save"], "peak_rss_per_rank": r["peak_rss_per_rank"],
            "launcher_peak_rss": r["launcher_peak_rss"], "params": r["params"],
            **({"staging": r["staging"]} if "staging" in r else {})}


def seconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f} s"


def ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}×"


def markdown(result: dict, meta: dict, recoveries_only: bool = False) -> str:
    """The table of benchmarks/README.md (Peers) from --json-out's result (pure); `recoveries_only`: the recovery
    columns alone."""
    before = meta.get("load_before_recoveries")
    lines = [f"{meta['machine']}; {meta['model']}, ZeRO-1 fp32, {meta['ranks']}; {meta['versions']}; "
             + (f"load average (1/5/15 min) as the recoveries began {before[0]:.1f}/{before[1]:.1f}/{before[2]:.1f}, "
                if before else "") + f"15-min load average at the end {meta['load_15min']:.1f}.", ""]
    if recoveries_only:
        return "\n".join(lines + recovery_lines(result) + ["", "Ratios ucp / peer: " + recovery_ratios(result) + ".",
                                                           "", "Targets: " + "; ".join(targets(result)[1:])])
    lines += ["| tool | blocked per save | durable | overhead every 1 / every 4 | bytes per save | peak RSS per rank | "
             "same-size recovery (memory) | new-size recovery |",
             "|---|---|---|---|---|---|---|---|"]
    for tool in TOOLS:
        e = result[tool]
        every = "–" if e["overhead_every1"] is None else f"{e['overhead_every1']:+.0%} / {e['overhead_every4']:+.0%}"
        size = "–" if e.get("bytes_per_save") is None else f"{e['bytes_per_save'] / 1e6:.0f} MB"
        rss = "–" if e.get("peak_rss_per_rank") is None else ", ".join(
            f"{b / 2**30:.2f}" for b in e["peak_rss_per_rank"]) + " GiB"
        lines.append(f"| {tool} | {seconds(e['blocked_s'])} | {seconds(e['durable_s'])} | {every} | {size} | {rss} | "
                     f"{seconds(e['recovery_same_size_s'])} | {seconds(e['recovery_new_size_s'])} |")
    lines += ["", *recovery_lines(result)]
    u, d = result["ucp"], result["dlrover"]
    um = result["ucp_memory"]
    lines += ["", "Ratios ucp / peer: blocked, ucp async disk save / DLRover memory save "
              f"{ratio(u['blocked_s'], d['blocked_s'])}, ucp memory tier / DLRover memory save "
              f"{ratio(um['blocked_s'], d['blocked_s'])}; durable, ucp / DLRover disk "
              f"{ratio(u['durable_s'], result['dlrover_disk']['durable_s'])}, ucp / DeepSpeed "
              f"{ratio(u['durable_s'], result['deepspeed']['durable_s'])}; against DCP's async save (FSDP2): blocked "
              f"{ratio(u['blocked_s'], result['dcp']['blocked_s'])}, durable "
              f"{ratio(u['durable_s'], result['dcp']['durable_s'])}; " + recovery_ratios(result) + "."]
    lines += ["", "Targets: " + "; ".join(targets(result))]
    return "\n".join(lines)


def recovery_ratios(result: dict) -> str:
    um, d = result["ucp_memory"], result["dlrover"]
    return (f"same-size recovery {ratio(um['recovery_same_size_s'], d['recovery_same_size_s'])}; new-size recovery "
            f"{ratio(um['recovery_new_size_s'], d['recovery_new_size_s'])}")


def recovery_lines(result: dict) -> list[str]:
    """Each recovery in one line, then where their time goes (pure)."""
    lines = ["Recoveries (fault or relaunch → first step = detection + relaunch, start-up, load, first step):", ""]
    for tool in ("ucp_memory", "dlrover"):
        for kind in ("recovery_same_size", "recovery_new_size"):
            r = result[tool][kind]
            if r and tool == "dlrover" and kind == "recovery_new_size":
                refused = r["load_checkpoint"].get("refused")
                lines.append("* dlrover, new size: `load_checkpoint` "
                             + (f"refused: `{refused}`" if refused else "loaded: " + parts(r["load_checkpoint"]))
                             + f"; universal path: convert {r['universal'].get('convert_s', 0):.1f} s + "
                             + parts(r["universal"]))
            elif r:
                lines.append(f"* {tool}, {kind.split('_', 1)[1].replace('_', ' ')}: " + parts(r))
    return lines + ["", *startup_table(result), "", *sections_table(result)]


def sections_table(result: dict) -> list[str]:
    """The why (pure): each restart's engine init, load and first step in their parts, rank 0's wall-clock seconds
    in each section of `_peers_llama.UCP_SECTIONS` / `DLROVER_SECTIONS` (nested ones are inside the one above)."""
    runs = [(f"{tool}, {kind.split('_', 1)[1].replace('_', ' ')}", result[tool].get(kind) or {})
            for tool in ("ucp_memory", "dlrover") for kind in ("recovery_same_size", "recovery_new_size")]
    runs = [(title, r.get("universal", r)) for title, r in runs]  # DLRover's new size: its universal path
    columns = [(title, r["sections"]) for title, r in runs if "sections" in r]
    if not columns:
        return []
    names = list(dict.fromkeys(name for _, sections in columns for name in sections))
    names.sort(key=lambda n: ("engine init", "load", "first step").index(n.split(":")[0]))  # stable: order kept
    rows = [f"| {name} | " + " | ".join(
        f"{sections[name]['s']:.2f} s" + (f" ({sections[name]['calls']}×)" if sections[name]["calls"] > 1 else "")
        if name in sections else "–" for _, sections in columns) + " |" for name in names]
    return ["Where the restart's time goes (rank 0; a nested part is inside the part above it):", "",
            "| part | " + " | ".join(title for title, _ in columns) + " |", "|---" * (len(columns) + 1) + "|", *rows]


def startup_table(result: dict) -> list[str]:
    """Where each recovery's time goes (pure): fault (or relaunch) → the new worker's process (detection and the
    launcher's restart), its imports, the process group's rendezvous, the model, the engine's init (ucp's load taken
    out), the load, the first step."""
    rows = []
    for tool in ("ucp_memory", "dlrover"):
        for kind in ("recovery_same_size", "recovery_new_size"):
            r = result[tool][kind]
            if r and tool == "dlrover" and kind == "recovery_new_size":
                r = r["universal"]
            if not r or "parts" not in r:
                continue
            cells = " | ".join(seconds(r["parts"].get(k)) for k in START_PARTS)
            rows.append(f"| {tool} | {kind.split('_', 1)[1].replace('_', ' ')} ({r['old_world']} → {r['new_world']}) "
                        f"| {seconds(r['total_s'])} | {cells} |")
    if not rows:
        return []
    return ["| tool | recovery | total | relaunch (to the new process) | imports | rendezvous | model | engine init | "
            "load | first step |", "|---|---|---|---|---|---|---|---|---|---|", *rows]


def parts(r: dict) -> str:
    if "total_s" not in r:
        return r.get("failed", "not measured")
    return (f"{r['total_s']:.1f} s ({r['old_world']} → {r['new_world']} ranks; {r['detection_s']:.1f} + "
            f"{r['startup_s']:.1f} + {r['load_s']:.2f} + {r['first_step_s']:.1f} s; step {r.get('checkpoint_step')})")


def targets(result: dict) -> list[str]:
    """The issue's targets, judged (pure)."""
    u, um, d = result["ucp"], result["ucp_memory"], result["dlrover"]

    def judge(name: str, value: float | None, bound: float | None, factor: float) -> str:
        if value is None or bound is None:
            return f"{name}: not measured"
        ok = value <= factor * bound
        return f"{name}: **{'PASS' if ok else 'MISS'}** ({value:.2f} vs {factor:.3g} × {bound:.2f})"

    blocked = max((b for b in (u.get("blocked_s"), um.get("blocked_s")) if b is not None), default=None)
    return [judge("ucp blocked per save ≤ DLRover's memory save", blocked, d.get("blocked_s"), 1),
            judge("new-size recovery ≤ ⅓ of the best peer path", um["recovery_new_size_s"],
                  d["recovery_new_size_s"], 1 / 3),
            judge("same-size recovery from memory ≤ 1.1× DLRover's", um["recovery_same_size_s"],
                  d["recovery_same_size_s"], 1.1)]


def versions() -> str:
    from importlib.metadata import version

    # ucp's distribution is `ucp-checkpoint` (setup.cfg); the others' are their import names
    dists = {"torch": "torch", "deepspeed": "deepspeed", "dlrover": "dlrover", "ucp": "ucp-checkpoint"}
    return ", ".join(f"{name} {version(dist)}" for name, dist in dists.items())


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="ucp-peers-bench-"))
    began = time.time()
    saves: list[dict] = []
    only = args.only == "recoveries"
    for world in [] if only else args.worlds:
        saves += run_saves(args, world, work)
    load_before = os.getloadavg()  # the machine's load as the recoveries start
    same = run_same_size(args, max(args.worlds), work)
    new = run_new_size(args, args.new_size_from, work)
    result = summarize(saves, same, new, only)
    params = saves[0]["params"] if saves else next(r["params"] for r in same.values() if "params" in r)
    meta = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
                       f"{psutil.virtual_memory().total / 2**30:.0f} GiB",
            "model": f"{params / 1e6:.1f}M-parameter Llama", "versions": versions(),
            "ranks": ("recoveries only: same size on " + str(max(args.worlds)) if only else
                      " and ".join(str(w) for w in args.worlds)) + " CPU ranks; new size "
                     f"{args.new_size_from} → {args.new_size_from - 1} ranks on the {args.new_size_model} model",
            "load_15min": os.getloadavg()[2], "load_before_recoveries": load_before, "wall_s": time.time() - began}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    text = markdown(result, meta, only)
    print(text)
    if args.markdown_out:
        Path(args.markdown_out).write_text(text + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{meta['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
