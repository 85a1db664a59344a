#!/usr/bin/env python
"""Benchmark: elastic training under Elastor-style failure traces, against stock DeepSpeed's path to a new size.

    python benchmarks/elastic.py [--steps 12] [--every 4] [--traces B C D E T] [--markdown-out FILE]
    python benchmarks/elastic.py --traces P --no-plain [--mpu-model 100m|16m]
    python benchmarks/elastic.py --trainer [--model 112m|20m] [--steps 12] [--every 4]

The ~112M-parameter benchmark Llama (ZeRO-1, fp32, global batch 12, micro-batch 1) trains for --steps optimizer
steps on 4 CPU ranks under torchrun's own elastic agents (each agent a "node"), with `"load": "auto"`,
`"save": {"every": K, "keep": 2}` and `"elastic"` (benchmarks/_elastic_llama.py). Traces, scaled from Elastor's
Cases to 4 ranks on one machine:

    B  one rank lost                 4 agents x 1 rank: one agent killed (3 ranks go on)
    C  two ranks of one node lost    2 agents x 2 ranks: one agent killed (2 ranks go on)
    D  a node lost, then back        4 x 1: one agent killed, a new agent joins (4 ranks again)
    E  mixed                         4 x 1: a worker killed (4 ranks restart), an agent killed, one joins
    M  C with the host-memory tier   2 x 2: memory every step, one peer copy (each agent its own folder in
                                     /dev/shm); the survivors resume from memory, newer than the disk tier
    S  C saving to s3://             2 x 2: the save folder is s3://bench/S on moto's S3 server, started here
                                     on 127.0.0.1 (parts of 64 MiB: moto reads a whole object for each
                                     ranged GET, so fewer, larger requests; see benchmarks/README.md, Tiers)
    T  3D: B with AutoTP             4 x 1, "elastic": {"tensor_parallel": [2, 1]}: T=2 x D=2 on 4 ranks; one
                                     agent killed, the 3 left take T=1 x D=3 (ucp.elastic.layout)
    P  3D: an mpu TP x PP model      4 x 1, tests/support/train_megatron.py's Megatron-style GPT (an mpu for TP in
                                     a PipelineModule) at 100.2M parameters (benchmarks/_elastic_megatron.py),
                                     global batch 8, "elastic": {"tensor_parallel": [2, 1], "pipeline_parallel":
                                     [2, 1]} and its shape for the cost model: T=2 x P=2 on 4 ranks; one agent
                                     killed after step 10 (saves at 4 and 8 before it), the 3 left take T=2 x P=1
                                     and a spare (8 samples do not split evenly over D=3)

Reported per trace: total wall to finish, against the same run without failures; per event the time from the
fault (the kill; for a join, the new agent's start) to the first step after it, split into detection and
relaunch (to `ucp.deepspeed.initialize`), engine start-up, load and the first step, and the steps redone.

`--memory` adds trace M and, for the overhead per memory save, the run without failures with memory saves every
step (disk saves never) against the one without saves. Traces C, M and S are the same failure recovered from
local disk, from host memory and from s3://: the recovery times of the three tiers side by side.

Stock DeepSpeed's only path to a new world size, run by hand on the same model: `engine.save_checkpoint` ->
`ds_to_universal.py` -> a new job with `{"checkpoint": {"load_universal": true}}`; its convert + load time is
measured for 3 and 2 ranks. For trace T the stock job trains with AutoTP 2 on 4 ranks
(`"tensor_parallel": {"autotp_size": 2}`) and loads on 3 ranks (T=1, the layout ucp takes there); the stall of
each save under AutoTP, ucp's asynchronous one (its snapshot) against `engine.save_checkpoint`, is reported as a
share of a step at the same layout (target <= 10% at every 4). For trace P the stock job trains the same GPT at
T=2 x P=2 on 4 ranks, saves at steps 4 and 8, runs `ds_to_universal` on step 8 (the model declares
`universal_checkpoint_info`, as Megatron-DeepSpeed's GPTModelPipe does) and loads at T=2 x P=1 on 2 ranks (the
training ranks of ucp's layout); the stalls, ucp's against stock's, at T=2 x P=2, the first save and the steady
one apart.

`--trainer`: trace B with the Hugging Face Trainer instead (benchmarks/_elastic_trainer.py): 4 agents x 1 rank run
`ucp.transformers.train(trainer)` with `"ucp": {"load": "auto", "elastic": {"global_batch": 12, "micro_batch": 1}}`
(checkpoint-N every --every steps), one agent is killed after step 6 and 3 ranks finish; the fault -> first step
split as above (start-up: from the process start to the engine's load). Against the stock path a person runs:
checkpoint-K saved by the Trainer on 4 ranks, `ds_to_universal.py` of its global_stepK into global_stepK_universal
beside it, and the Trainer's `resume_from_checkpoint` with `{"checkpoint": {"load_universal": true}}` on 3 ranks
(per-device batch 12 / 3), timed to its first step. Targets: ucp's load on a restart <= 1/3 of
stock's convert + load; steps redone <= every; with "every": 1, the saves slow training by at most 10% (same run
without saves, in the same run).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_elastic_llama.py"
MEGATRON_WORKER = HERE / "_elastic_megatron.py"
NO_SAVES = 10 ** 9


@dataclass(frozen=True)
class ThreeD:
    """A 3D trace: what its ucp job adds, and its stock path (the same model at DeepSpeed's fixed layouts)."""

    label: str                          # the model and the layout it starts at, as the report names them
    worker: Path
    ucp_args: tuple[str, ...]           # added to the ucp job's arguments
    stock_args: tuple[str, ...]         # the stock job's layout on 4 ranks
    loads: dict[int, tuple[str, ...]]   # ranks of a stock load_universal -> its layout arguments
    saved_at: dict[str, int]            # the start layout (keys of the step records) whose saves are reported
    stock_saves: int                    # engine.save_checkpoint calls in the stock run, every `every` steps
    plain: bool                         # a run without failures gives steady saves (the trace's only one is its first)


THREE_D = {
    # ucp allows T in [2, 1]; the stock path trains at exactly T=2 and loads at T=1 on 3 ranks, the layout ucp takes
    "T": ThreeD("AutoTP 2", WORKER, ("--tp", "2"), ("--tp", "2"), {3: ()}, {"tp": 2}, 1, True),
    # ucp allows T, P in [2, 1] (the worker's "elastic"); 3 ranks take T=2 x P=1 and a spare: stock loads on 2
    "P": ThreeD("mpu TP 2 x PipelineModule PP 2", MEGATRON_WORKER, (), ("--tp", "2", "--pp", "2"),
                {2: ("--tp", "2", "--pp", "1")}, {"tp": 2, "pp": 2}, 2, False),
}


def env() -> dict:
    e = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    e.setdefault("TORCH_EXTENSIONS_DIR", os.path.expanduser("~/.cache/ucp/torch_extensions"))
    return e


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def records(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")


def kill_tree(pid: int) -> None:
    try:
        root = psutil.Process(pid)
        victims = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=30)


class Agents:
    """torchrun elastic agents on this machine against one rendezvous store hosted here (so any may go)."""

    def __init__(self, work: Path, args: list[str], per_node: int, node_env: str | None = None,
                 extra_env: dict | None = None, worker: Path = WORKER):
        from torch.distributed import TCPStore

        self.work, self.args, self.per_node, self.node_env, self.worker = work, args, per_node, node_env, worker
        self.extra_env = extra_env or {}
        self.port = free_port()
        self.store = TCPStore("127.0.0.1", self.port, is_master=True, multi_tenant=True, wait_for_workers=False)
        self.procs: list[subprocess.Popen] = []

    def start(self) -> int:
        i = len(self.procs)
        cmd = [sys.executable, "-m", "ucp.elastic.torchrun", "--nnodes=1:4", f"--nproc-per-node={self.per_node}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", "--rdzv-id=bench",
               "--rdzv-conf=is_host=false,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
               "--max-restarts=10", "--monitor-interval=0.5", str(self.worker), *self.args]
        with open(self.work / f"agent{i}.log", "w") as log:
            extra = {self.node_env: str(i)} if self.node_env else {}  # the agent's "node", for its memory folder
            self.procs.append(subprocess.Popen(cmd, env={**env(), **self.extra_env, **extra}, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True))
        return i

    def lose_node(self, i: int) -> float:
        at = time.time()
        kill_tree(self.procs[i].pid)
        return at

    def lose_worker(self, i: int) -> float:
        workers = wait_until(lambda: [p for p in psutil.Process(self.procs[i].pid).children(recursive=True)
                                      if str(self.worker) in " ".join(p.cmdline())], 60, "a worker")
        at = time.time()
        workers[0].kill()
        return at

    def wait(self) -> None:
        for p in self.procs:
            if p.poll() is None and p.wait(timeout=3600) != 0:
                raise SystemExit(f"an agent failed (exit {p.returncode}); see {self.work}")

    def stop(self) -> None:
        for p in self.procs:
            kill_tree(p.pid)


TRACES = {
    # name: (ranks per agent, agents, events: (after step, "node" i | "worker" i | "join"))
    # Faults fall between saves (every 4 by default), as they do in a real run: a fault right at a save step
    # finds that save still being written and measures a fresh start instead of a load.
    "B": (1, 4, [(6, "node", 3)]),
    "C": (2, 2, [(6, "node", 1)]),
    "D": (1, 4, [(6, "node", 3), (10, "join", None)]),
    "E": (1, 4, [(5, "worker", 1), (7, "node", 3), (10, "join", None)]),
    "M": (2, 2, [(6, "node", 1)]),
    "S": (2, 2, [(6, "node", 1)]),
    "T": (1, 4, [(6, "node", 3)]),
    # after the saves at 4 and 8 (the first and a steady one at T=2 x P=2), so that needs --steps 11 or more
    "P": (1, 4, [(10, "node", 3)]),
}
MEMORY_TRACES = {"M"}
S3_TRACES = {"S"}
NODE_ENV = "UCP_BENCH_NODE"
S3_PART_BYTES = 64 << 20


def s3_server() -> tuple[object, dict]:
    """moto's S3 server on 127.0.0.1 with bucket `bench`, and the environment that points clients at it."""
    import logging

    import boto3
    import moto.server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request otherwise
    server = moto.server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    client_env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "bench",
                  "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
                  "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                  "UCP_S3_PART_BYTES": str(S3_PART_BYTES)}
    boto3.client("s3", endpoint_url=client_env["AWS_ENDPOINT_URL"], aws_access_key_id="bench",
                 aws_secret_access_key="bench", region_name="us-east-1").create_bucket(Bucket="bench")
    return server, client_env


def run_trace(name: str, steps: int, every: int, work: Path, extra: tuple[str, ...] = ()) -> dict:
    """Trace `name` (TRACES) on torchrun's agents, `extra` added to the worker's arguments."""
    per_node, agents_n, events = TRACES[name]
    spec = THREE_D.get(name)
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    recs = out / "records.jsonl"
    server, client_env = s3_server() if name in S3_TRACES else (None, {})
    save_dir = f"s3://bench/{name}" if server is not None else str(out / "ckpt")
    args = ["--mode", "ucp", "--save-dir", save_dir, "--steps", str(steps), "--every", str(every),
            "--records", str(recs), *extra]
    memory = None
    if name in MEMORY_TRACES:
        memory = Path(tempfile.mkdtemp(prefix="ucp-bench-", dir="/dev/shm"))
        args += ["--memory-every", "1", "--memory-dir", f"{memory}/node${NODE_ENV}"]
    if spec is not None:
        args += spec.ucp_args
    agents = Agents(out, args, per_node, NODE_ENV if memory else None, client_env,
                    spec.worker if spec is not None else WORKER)
    began = time.time()
    faults = []
    try:
        for _ in range(agents_n):
            agents.start()
        for after, kind, which in events:
            wait_until(lambda: any(r.get("step", 0) >= after for r in records(recs)), 3600, f"step {after}")
            if kind == "node":
                faults.append((kind, agents.lose_node(which)))
                if memory is not None:  # the node's memory goes with it
                    shutil.rmtree(memory / f"node{which}", ignore_errors=True)
            elif kind == "worker":
                faults.append((kind, agents.lose_worker(which)))
            else:
                faults.append((kind, time.time()))
                agents.start()
            seen = len([r for r in records(recs) if "restart" in r])
            wait_until(lambda: len([r for r in records(recs) if "restart" in r]) > seen, 3600, "the restart")
        agents.wait()
    finally:
        agents.stop()
        if memory is not None:
            shutil.rmtree(memory, ignore_errors=True)
        if server is not None:
            server.stop()
    wall = time.time() - began
    restarts = [r for r in records(recs) if "restart" in r]
    steps = [r for r in records(recs) if "step" in r]
    events_out = []
    for (kind, at), rec in zip(faults, restarts):
        report = rec["restart"]
        called = rec["initialize_called"]
        load_began = called + report["startup_s"]
        first = load_began + report["load_s"] + report["first_step_s"]
        # the job's ranks and layouts from the step records (a restart report counts a layout's training ranks)
        old = next(r for r in reversed(steps) if r["time"] < at)
        new = next(r for r in steps if r["time"] > first - 1)
        events_out.append({"event": kind, "old_world": old["world"], "new_world": new["world"],
                           "old_layout": layout_text(old), "new_layout": layout_text(new),
                           "new_training": training(new),
                           "fault_to_first_step_s": first - at, "detection_s": called - at,
                           "startup_s": report["startup_s"], "load_s": report["load_s"],
                           "first_step_s": report["first_step_s"], "steps_redone": report["steps_redone"],
                           "checkpoint_step": report["checkpoint_step"],
                           "tier": tier(str(report["checkpoint"]), memory)})
    out_ = {"trace": name, "wall_s": wall, "events": events_out}
    if spec is not None:
        out_["saves"] = save_stalls(steps, every, spec.saved_at)
        out_["saves_after"] = save_stalls(steps, every, {key: steps[-1][key] for key in spec.saved_at})
    return out_


def training(record: dict) -> int:
    """The training ranks of a step record's layout (its world less the spares)."""
    return record.get("tp", 1) * record.get("pp", 1) * record.get("dp", record["world"] // record.get("tp", 1))


def layout_text(record: dict) -> str:
    """A step record's layout: T2×P2×D1, T2×D2, T2×D1 + 1 spare."""
    pp = record.get("pp", 1)
    dp = training(record) // (record.get("tp", 1) * pp)
    spares = record["world"] - training(record)
    return (f"T{record.get('tp', 1)}×" + (f"P{pp}×" if pp > 1 else "") + f"D{dp}"
            + (f" + {spares} spare" if spares else ""))


def save_stalls(steps: list[dict], every: int, layout: dict[str, int]) -> dict:
    """The slowest rank's stall of each save made at `layout` (the step records' "tp", "pp"), and the median step
    there (steps after the first, neither a save step nor the one after it, nor a step right after a restart)."""
    def there(record: dict) -> bool:
        return all(record.get(key) == value for key, value in layout.items())

    stalls = [r["save_stall_s"] for r in steps if there(r) and "save_stall_s" in r]
    plain = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])
             if b["step"] == a["step"] + 1 and a["step"] > 1 and there(a) and there(b)
             and a["step"] % every and b["step"] % every]
    return {"layout": layout, "stall_s": stalls, "step_s": statistics.median(plain) if plain else None}


def tier(checkpoint: str, memory: Path | None) -> str:
    """Which tier the restart loaded `checkpoint` from."""
    if checkpoint.startswith("s3://"):
        return "s3"
    return "memory" if memory is not None and checkpoint.startswith(str(memory)) else "disk"


def run_plain(every: int, steps: int, work: Path, tag: str, memory_every: int | None = None,
              tp: int | None = None) -> dict:
    """The same job without failures on 4 ranks (plain torchrun): wall, and the mean step time past the first; with
    AutoTP `tp`, the saves' stalls too (`save_stalls`)."""
    out = work / tag
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    recs = out / "records.jsonl"
    began = time.time()
    memory = []
    if memory_every:
        folder = Path(tempfile.mkdtemp(prefix="ucp-bench-", dir="/dev/shm"))
        memory = ["--memory-every", str(memory_every), "--memory-dir", str(folder)]
    try:
        torchrun(["--mode", "ucp", "--save-dir", str(out / "ckpt"), "--steps", str(steps), "--every", str(every),
                  "--records", str(recs), *memory, *(["--tp", str(tp)] if tp else [])], 4, out / "log")
    finally:
        if memory:
            shutil.rmtree(memory[-1], ignore_errors=True)
    steps_done = [r for r in records(recs) if "step" in r]
    times = [r["time"] for r in steps_done]
    result = {"wall_s": time.time() - began, "step_s": (times[-1] - times[1]) / (len(times) - 2)}
    if tp:
        result["saves"] = save_stalls(steps_done, every, {"tp": tp})
    return result


def torchrun(args: list[str], nproc: int, log: Path, worker: Path = WORKER) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(free_port()), str(worker), *args]
    with open(log, "w") as f:
        if subprocess.run(cmd, env=env(), stdout=f, stderr=subprocess.STDOUT).returncode != 0:
            raise SystemExit(f"failed; see {log}")


def stock_path(every: int, work: Path, trace: str | None = None, extra: tuple[str, ...] = ()) -> dict:
    """save_checkpoint every `every` steps on 4 ranks, ds_to_universal of the last save, then load_universal on 3, 2
    and 4 ranks (data parallel); for a 3D `trace`, its worker at its layouts (THREE_D), `extra` added to the worker's
    arguments, and the saves' stalls."""
    spec = THREE_D.get(trace) if trace else None
    worker = spec.worker if spec else WORKER
    out = work / ("stock" if spec is None else f"stock-{trace}")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    steps = every * (spec.stock_saves if spec else 1)
    torchrun(["--mode", "stock", "--save-dir", str(out / "ds"), "--steps", str(steps), "--every", str(every),
              "--records", str(out / "train.jsonl"), *extra, *(spec.stock_args if spec else ())], 4,
             out / "train.log", worker)
    tag = (out / "ds" / "latest").read_text().strip()
    convert_s = to_universal(out / "ds" / tag, out / "universal" / tag)
    loads, layouts = {}, {}
    for world, layout in (spec.loads if spec else {3: (), 2: (), 4: ()}).items():
        recs = out / f"load{world}.jsonl"
        torchrun(["--mode", "stock", "--save-dir", str(out / f"after{world}"), "--steps", str(steps + 1),
                  "--every", str(NO_SAVES), "--records", str(recs), "--load-universal",
                  str(out / "universal" / tag), *extra, *layout], world, out / f"load{world}.log", worker)
        loads[str(world)] = next(r["load_universal_s"] for r in records(recs) if "load_universal_s" in r)
        layouts[str(world)] = layout_text(next(r for r in records(recs) if "step" in r))
    result = {"convert_s": convert_s, "load_s": loads, "layouts": layouts, "steps": steps}
    if spec:
        result["saves"] = save_stalls([r for r in records(out / "train.jsonl") if "step" in r], every, spec.saved_at)
    return result


def to_universal(tag_folder: Path, output: Path) -> float:
    """DeepSpeed's `ds_to_universal.py` on one checkpoint tag folder, 2 workers each way; its seconds."""
    import deepspeed

    script = Path(deepspeed.__file__).parent / "checkpoint" / "ds_to_universal.py"
    began = time.perf_counter()
    subprocess.run([sys.executable, str(script), "--input_folder", str(tag_folder), "--output_folder", str(output),
                    "--num_extract_workers", "2", "--num_merge_workers", "2",
                    # a plain model carries no universal_checkpoint_info; DeepSpeed's converter then needs this
                    "--inject_missing_state"],
                   check=True, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - began


TRAINER_WORKER = HERE / "_elastic_trainer.py"
TRAINER_FAULT_AFTER = 6  # trace B: the step after which an agent is lost (between saves at the default every 4)


def trainer_trace(steps: int, every: int, model: str, work: Path) -> dict:
    """Trace B with the Hugging Face Trainer: 4 agents x 1 rank run `ucp.transformers.train` (one command, "auto"
    and "elastic"); one agent is killed after step TRAINER_FAULT_AFTER and 3 ranks finish. The fault -> first
    step split as for the engine loop, from the worker's records (rank 0)."""
    out = work / "trainer-B"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    recs = out / "records.jsonl"
    agents = Agents(out, ["--mode", "ucp", "--output-dir", str(out / "run"), "--steps", str(steps), "--every",
                          str(every), "--model", model, "--records", str(recs)], 1, worker=TRAINER_WORKER)
    began = time.time()
    try:
        for _ in range(4):
            agents.start()
        wait_until(lambda: any(r.get("step", 0) >= TRAINER_FAULT_AFTER for r in records(recs)), 3600,
                   f"step {TRAINER_FAULT_AFTER}")
        at = agents.lose_node(3)
        wait_until(lambda: any(r.get("time", 0) > at and r.get("world") == 3 for r in records(recs)), 3600,
                   "the first step on 3 ranks")
        agents.wait()
    finally:
        agents.stop()
    wall = time.time() - began
    rs = records(recs)
    before = max(r["step"] for r in rs if "step" in r and r["time"] < at)
    start = next(r["start"] for r in rs if r.get("start", 0) > at)
    load = next(r for r in rs if r.get("load_began", 0) > at)
    first = next(r for r in rs if r.get("time", 0) > at and r.get("world") == 3)
    loaded = load["load_began"] + load["load_s"]
    event = {"event": "node", "old_world": 4, "new_world": 3, "fault_to_first_step_s": first["time"] - at,
             "detection_s": start - at, "startup_s": load["load_began"] - start, "load_s": load["load_s"],
             "first_step_s": first["time"] - loaded, "checkpoint_step": first["step"] - 1,
             "steps_redone": before - (first["step"] - 1), "tier": "disk"}
    return {"trace": "B (Trainer)", "wall_s": wall, "events": [event]}


def trainer_stock_path(every: int, model: str, work: Path, world: int = 3) -> dict:
    """The path a person runs with the Trainer: checkpoint-K saved on 4 ranks, `ds_to_universal` of its
    global_stepK (into global_stepK_universal, beside it, with `latest_universal`), then the Trainer's
    `resume_from_checkpoint` with `load_universal` on `world` ranks for one step; convert, load, first step."""
    out = work / "trainer-stock"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    common = ["--mode", "stock", "--every", str(every), "--model", model]
    torchrun([*common, "--output-dir", str(out / "run"), "--steps", str(every), "--records",
              str(out / "train.jsonl")], 4, out / "train.log", worker=TRAINER_WORKER)
    checkpoint = out / "run" / f"checkpoint-{every}"
    convert_s = to_universal(checkpoint / f"global_step{every}", checkpoint / f"global_step{every}_universal")
    recs = out / f"load{world}.jsonl"
    torchrun([*common, "--output-dir", str(out / f"after{world}"), "--steps", str(every + 1), "--resume",
              str(checkpoint), "--records", str(recs)], world, out / f"load{world}.log", worker=TRAINER_WORKER)
    rs = records(recs)
    load = next(r for r in rs if "load_s" in r)
    first = next(r for r in rs if "step" in r)
    return {"convert_s": convert_s, "load_s": {str(world): load["load_s"]},
            "first_step_s": first["time"] - load["load_began"] - load["load_s"]}


def trainer_markdown(results: dict) -> str:
    t, stock = results["trainer"], results.get("trainer_stock")
    e = t["events"][0]
    lines = [f"{results['machine']} (15-min load average at the end {results['load_15min']:.1f}); "
             f"Hugging Face Trainer, {results['model']} Llama, ZeRO-1 fp32, global batch 12, {results['steps']} "
             f"steps, save every {results['every']}.", "",
             "| trace | wall | ranks | fault → first step | detection + relaunch | start-up | load | first step | "
             "steps redone | stock: ds_to_universal + load_universal + first step |", "|---" * 10 + "|"]
    stock_text = "–"
    if stock:
        loaded = stock["load_s"][str(e["new_world"])]
        stock_text = (f"{stock['convert_s']:.1f} + {loaded:.2f} + {stock['first_step_s']:.1f} s (ucp's load "
                      f"{e['load_s'] / (stock['convert_s'] + loaded):.3f} of convert + load)")
    lines.append(f"| {t['trace']} | {t['wall_s']:.0f} s | {e['old_world']} → {e['new_world']} | "
                 f"{e['fault_to_first_step_s']:.1f} s | {e['detection_s']:.1f} s | {e['startup_s']:.1f} s | "
                 f"{e['load_s']:.2f} s (step {e['checkpoint_step']}) | {e['first_step_s']:.1f} s | "
                 f"{e['steps_redone']} | {stock_text} |")
    return "\n".join(lines)


def markdown(results: dict) -> str:
    stock, plain = results["stock"], results["plain"]
    models = (["~112M-parameter Llama, global batch 12"] if {t["trace"] for t in results["traces"]} - {"P"} else []) + (
        [f"trace P: {results['mpu_model']}"] if "mpu_model" in results else [])
    lines = [f"{results['machine']} (15-min load average at the end {results['load_15min']:.1f}); "
             f"{'; '.join(models)}; ZeRO-1 fp32, {results['steps']} steps, save every {results['every']}.", "",
             "| trace | wall | vs no failure | event | ranks | fault → first step | detection + relaunch | "
             "start-up | load (tier) | first step | steps redone | load vs stock convert+load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    stock_3d = results.get("stock_3d", {})
    for t in results["traces"]:
        against = stock_3d.get(t["trace"]) if t["trace"] in THREE_D else stock
        for i, e in enumerate(t["events"]):
            loaded = against and against["load_s"].get(str(e["new_training"]))
            vs_stock = f"{e['load_s'] / (against['convert_s'] + loaded):.3f}" if loaded else "–"
            ranks = f"{e['old_world']} → {e['new_world']}"
            if t["trace"] in THREE_D:
                ranks = f"{e['old_world']} ({e['old_layout']}) → {e['new_world']} ({e['new_layout']})"
            vs_plain = f"{t['wall_s'] / plain['every']['wall_s']:.2f}×" if plain else "–"
            head = f"{t['trace']} | {t['wall_s']:.0f} s | {vs_plain}" if i == 0 else " | | "
            lines.append(f"| {head} | {e['event']} | {ranks} | "
                         f"{e['fault_to_first_step_s']:.1f} s | {e['detection_s']:.1f} s | {e['startup_s']:.1f} s | "
                         f"{e['load_s']:.2f} s ({e.get('tier', 'disk')}, step {e['checkpoint_step']}) | "
                         f"{e['first_step_s']:.1f} s | {e['steps_redone']} | "
                         f"{vs_stock} |")
    if stock:
        lines += ["", f"Stock path: ds_to_universal {stock['convert_s']:.1f} s; load_universal "
                  + ", ".join(f"{w} ranks {s:.1f} s" for w, s in stock["load_s"].items()) + "."]
    for name, against in stock_3d.items():
        lines += ["", f"Stock path with {THREE_D[name].label} (trace {name}): ds_to_universal "
                  f"{against['convert_s']:.1f} s; load_universal "
                  + ", ".join(f"{w} ranks ({against['layouts'][w]}) {s:.1f} s" for w, s in against["load_s"].items())
                  + "."]
    if lines[-1].startswith("|") and ("plain_tp" in results or stock_3d):
        lines.append("")  # the table ends here
    for t in results["traces"]:
        if "saves" in t and t["trace"] in stock_3d:
            lines.append(f"Save stall under {THREE_D[t['trace']].label} (slowest rank, every {results['every']}), "
                         f"trace {t['trace']}: {stall_text(t['saves'], 'ucp async save')}; "
                         f"{stall_text(stock_3d[t['trace']]['saves'], 'stock engine.save_checkpoint')}. After the "
                         f"restart ({t['events'][-1]['new_layout']}): {stall_text(t['saves_after'], 'ucp')}.")
    if "plain_tp" in results:
        lines.append(f"No failure at T=2 x D=2 ({2 * results['every'] + 1} steps; the first save also sets up the "
                     f"snapshot buffer): {stall_text(results['plain_tp']['saves'], 'ucp async save')}.")
    if not plain:
        return "\n".join(lines)
    lines += ["", f"No failure, 4 ranks: every {results['every']}: {plain['every']['wall_s']:.0f} s "
              f"({plain['every']['step_s']:.2f} s/step); every 1: {plain['every1']['step_s']:.2f} s/step; no saves: "
              f"{plain['none']['step_s']:.2f} s/step; saving every step slows training by "
              f"{plain['every1']['step_s'] / plain['none']['step_s'] - 1:+.1%}."]
    if "memory1" in plain:
        lines.append(f"Memory tier every step (one peer copy, no disk saves): {plain['memory1']['step_s']:.2f} s/step, "
                     f"{plain['memory1']['step_s'] / plain['none']['step_s'] - 1:+.1%} against no saves (the disk save "
                     f"every step: {plain['every1']['step_s'] / plain['none']['step_s'] - 1:+.1%}).")
    return "\n".join(lines)


def stall_text(saves: dict, what: str) -> str:
    """Each save's stall (the first, which also sets up what later saves reuse, then the steady ones), and its
    share of a step at the same layout."""
    step = saves["step_s"]
    stalls = [f"{s:.2f} s" + (f" ({s / step:.1%} of a step)" if step else "") for s in saves["stall_s"]]
    said = f"first {stalls[0]}" + (f", then {', '.join(stalls[1:])}" if stalls[1:] else "") if stalls else "none"
    return f"{what} {said}" + (f"; a step there {step:.2f} s" if step else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--traces", nargs="+", default=list(TRACES), choices=list(TRACES),
                        help="B C D E M S: ZeRO-1 data parallel; T: AutoTP 2 (3D), P: mpu TP 2 x PipelineModule "
                             "PP 2 (3D), each against stock's path at its layouts (module docstring)")
    parser.add_argument("--memory", action="store_true",
                        help="also trace M (host-memory tier) and the cost of a memory save every step")
    parser.add_argument("--no-stock", action="store_true", help="skip the stock path (its column shows –)")
    parser.add_argument("--no-plain", action="store_true",
                        help="skip the runs without failures (the traces' 'vs no failure' column shows –)")
    parser.add_argument("--work", help="working folder (default: a temporary one, removed)")
    parser.add_argument("--json-out")
    parser.add_argument("--markdown-out")
    parser.add_argument("--trainer", action="store_true",
                        help="trace B with the Hugging Face Trainer (ucp.transformers.train) against the stock "
                             "Trainer path (ds_to_universal + resume_from_checkpoint with load_universal), only")
    parser.add_argument("--model", choices=("112m", "20m"), default="112m",
                        help="--trainer: the benchmark Llama's size (20m for a quick run)")
    parser.add_argument("--mpu-model", choices=("100m", "16m"), default="100m",
                        help="trace P: the mpu GPT's size (benchmarks/_elastic_megatron.py; 16m for a quick run)")
    args = parser.parse_args()
    if "P" in args.traces and args.steps <= TRACES["P"][2][-1][0]:
        parser.error(f"trace P loses a node after step {TRACES['P'][2][-1][0]}: --steps must be larger")
    work = Path(args.work or tempfile.mkdtemp(prefix="ucp-elastic-bench-"))
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores", "steps": args.steps,
               "every": args.every}
    if args.trainer:
        return run_trainer(args, work, results)
    extra = {"P": ("--model", args.mpu_model)}  # a trace's worker arguments beyond its layout
    if "P" in args.traces:
        from _elastic_megatron import SHAPES, params

        results["mpu_model"] = (f"tests/support/train_megatron.py's GPT at {params(SHAPES[args.mpu_model]) / 1e6:.1f}M "
                                "parameters, global batch 8")
    results["stock"] = None
    three_d = sorted(set(args.traces) & set(THREE_D))
    if not args.no_stock:
        if set(args.traces) - set(THREE_D):
            print("stock path (save, ds_to_universal, load_universal) ...", flush=True)
            results["stock"] = stock_path(args.every, work)
        results["stock_3d"] = {}
        for name in three_d:
            print(f"stock path with {THREE_D[name].label} (trace {name}) ...", flush=True)
            results["stock_3d"][name] = stock_path(args.every, work, name, extra.get(name, ()))
            if args.json_out:  # minutes each: keep what is measured should a later run fail
                Path(args.json_out).write_text(json.dumps(results, indent=1))
    for name in three_d:  # a trace whose only save at its start layout is its first: steady ones here
        if THREE_D[name].plain:
            print(f"no failure with {THREE_D[name].label}: the saves' stalls ...", flush=True)
            results["plain_tp"] = run_plain(args.every, 2 * args.every + 1, work, "plain-tp",
                                            tp=THREE_D[name].saved_at["tp"])
    results["plain"] = {}
    if not args.no_plain:
        print("no failures: every K, every 1, no saves ...", flush=True)
        results["plain"] = {"every": run_plain(args.every, args.steps, work, "plain-every"),
                            "every1": run_plain(1, args.steps, work, "plain-every1"),
                            "none": run_plain(NO_SAVES, args.steps, work, "plain-none")}
    if args.memory:
        if not args.no_plain:
            results["plain"]["memory1"] = run_plain(NO_SAVES, args.steps, work, "plain-memory1", memory_every=1)
        args.traces = [*args.traces, *sorted(MEMORY_TRACES - set(args.traces))]
    results["traces"] = []
    for name in args.traces:
        print(f"trace {name} ...", flush=True)
        results["traces"].append(run_trace(name, args.steps, args.every, work, extra.get(name, ())))
        if args.json_out:  # a trace takes minutes: keep what is measured should a later one fail
            Path(args.json_out).write_text(json.dumps(results, indent=1))
    results["load_15min"] = os.getloadavg()[2]  # other work on the machine skews the walls; say how much there was
    text = markdown(results)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    if args.markdown_out:
        Path(args.markdown_out).write_text(text + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


def run_trainer(args: argparse.Namespace, work: Path, results: dict) -> None:
    """`--trainer`: the Trainer's trace B and the stock Trainer path, reported as one table."""
    results["model"] = {"112m": "~112M-parameter", "20m": "~20M-parameter"}[args.model]
    if not args.no_stock:
        print("stock Trainer path (checkpoint-N, ds_to_universal, resume_from_checkpoint) ...", flush=True)
        results["trainer_stock"] = trainer_stock_path(args.every, args.model, work)
    print("trace B with the Trainer ...", flush=True)
    results["trainer"] = trainer_trace(args.steps, args.every, args.model, work)
    results["load_15min"] = os.getloadavg()[2]
    text = trainer_markdown(results)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=1))
    if args.markdown_out:
        Path(args.markdown_out).write_text(text + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
