#!/usr/bin/env python
"""One worker of benchmarks/peers.py: the benchmark Llama (ZeRO-1, fp32) trained with one family's checkpoints.
Every rank runs this file, under the family's own launcher: torchrun for ucp and DeepSpeed (`--tools ucp
ucp_memory deepspeed`, one engine from `ucp.deepspeed.initialize`), dlrover-run for DLRover (`--tools dlrover
dlrover_disk`, an engine from `deepspeed.initialize` and DLRover's `DeepSpeedCheckpointer`).

    --phase save      per tool in turn: warm up (one untimed save), time plain steps, saves one by one (the call
                      that holds training, then the time until the checkpoint is durable), steps with a save after
                      every one and after every 4th; rank 0 appends one JSON record per tool to --records.
    --phase recover   train --steps steps saving into memory after every step (ucp: the memory tier with "load":
                      "auto"; DLRover: StorageType.MEMORY, after one StorageType.DISK save at step 1, which writes
                      DeepSpeed's `latest`, the tag DeepSpeed's load reads); a restarted worker loads (ucp: in
                      initialize; DLRover: `checkpointer.load_checkpoint`), and rank 0 appends a record per step and
                      one for the restart.
    --phase resize    DeepSpeed at a new world size, through DLRover: `checkpointer.load_checkpoint` of the
                      checkpoint --phase recover left, or with --load-universal DeepSpeed's universal checkpoint of
                      it (ds_to_universal's output, `"load_universal": true`); then one step. A refusal is recorded.

Tools: ucp (`ucp.deepspeed.save`: asynchronous, to disk), ucp_memory (the memory tier, one node, no peer copy),
deepspeed (`engine.save_checkpoint`), dlrover (Flash Checkpoint to memory), dlrover_disk (Flash Checkpoint to
disk: memory, then DLRover's agent writes it). The memory tier is configured as the README says (`"memory":
{"every": ...}`) with an `every` no step reaches, and its saves are started at the measured steps by
`Saver.save_memory`, what the config's step hook calls, so that a save is timed alone.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _elastic_llama import append, lm_loss  # noqa: E402
from _train_llama import MODELS, SEED, SEQ_LEN  # noqa: E402

NEVER = 10 ** 9
UCP_FAMILY = ("ucp", "ucp_memory", "deepspeed")
DLROVER_FAMILY = ("dlrover", "dlrover_disk")
DCP_FAMILY = ("dcp",)
FAMILY_OF = {**{t: "torchrun" for t in UCP_FAMILY}, **{t: "dlrover" for t in DLROVER_FAMILY},
             **{t: "dcp" for t in DCP_FAMILY}}
DLROVER_TRACER = "dlrover_latest.txt"


class StartMarks:
    """When this worker's start-up reached each point (wall-clock seconds), from the process's creation: its
    interpreter and module imports until `main`, the imports of the job's libraries, the process group's rendezvous,
    the model, the engine (`initialize`; ucp's load runs inside it)."""

    def __init__(self) -> None:
        import psutil

        self.at = {"process": psutil.Process().create_time(), "main": time.time()}

    def mark(self, name: str) -> None:
        self.at[name] = time.time()

    def parts(self, load_in_engine: float = 0.0) -> dict:
        """Seconds per part; `load_in_engine`, a load that ran inside `initialize`, is taken out of the engine."""
        at = self.at
        return {"imports_s": at["imported"] - at["process"], "rendezvous_s": at["rendezvous"] - at["imported"],
                "model_s": at["model"] - at["rendezvous"],
                "engine_init_s": at["engine"] - at["model"] - load_in_engine}


# Where ucp's restart spends its time (--phase recover, ucp): (module[:class], attribute, section). Each is wrapped by a
# timer (`Sections`); nested sections are also in the one around them (a read and its CRCs in the load).
ZERO_CHECK = ("deepspeed.runtime.engine", "is_zero_supported_optimizer",
              "engine init: DeepSpeed's ZeRO optimizer check (imports Muon: torch.compile, inductor)")
UCP_SECTIONS = (
    ("deepspeed", "initialize", "engine init: DeepSpeed's initialize"),
    ZERO_CHECK,
    ("ucp.deepspeed.hook", "warn_shared_rendezvous_store", "engine init: rendezvous store check"),
    ("ucp.deepspeed.auto_resume", "candidates", "engine init: auto search, disk candidates"),
    ("ucp.deepspeed.auto_resume", "memory_resume_point", "engine init: auto search, memory tier"),
    ("ucp.deepspeed.life:StepBook", "__init__", "engine init: step book"),
    ("ucp.deepspeed.hook", "load", "load"),
    ("ucp.deepspeed.loading.load", "target_for", "load: engine's layout (target)"),
    ("ucp.deepspeed.loading.load", "open_checkpoint", "load: open the checkpoint (index)"),
    ("ucp.deepspeed.loading.load", "_check", "load: names and shapes"),
    ("ucp.deepspeed.loading.load", "_check_first", "load: read + CRC (check_first)"),
    ("ucp.deepspeed.loading.load", "_load_tensors", "load: tensors (check_first, install)"),
    ("ucp.format.checked_read", "fetch", "load: read (fetch)"),
    ("ucp.format.checked_read", "fill", "load: read (fill)"),
    ("ucp.format.checked_read", "crc32", "load: CRC-32"),
    ("ucp.deepspeed.loading.load", "_agree", "load: agree (all-gather)"),
    ("ucp.deepspeed.engine.targets:_FlatPartitionTarget", "finish",
     "load: module weights from the masters (DeepSpeed's update_lp_params: an all-gather)"),
    ("ucp.deepspeed.life:StepBook", "after_step", "first step: step book (progress, restart report)"),
    ("ucp.deepspeed.life:CheckpointLife", "_new_saver", "first step: saver and memory tier setup"),
    ("ucp.deepspeed.saving.saver:Saver", "save_memory", "first step: memory save (blocked)"),
    ("ucp.deepspeed.saving.saver:Saver", "_prepare", "first step: memory save, snapshot buffer"),
)


# DLRover's side of the same split: DeepSpeed's initialize, the checkpointer, its load.
DLROVER_SECTIONS = (
    ("deepspeed", "initialize", "engine init: DeepSpeed's initialize"),
    ZERO_CHECK,
    ("dlrover.trainer.torch.flash_checkpoint.deepspeed:DeepSpeedCheckpointer", "__init__",
     "engine init: DLRover's checkpointer"),
)


class Sections:
    """Seconds and calls spent in each of `UCP_SECTIONS` on this rank (wall clock; sections are wrapped where
    they are looked up, so a function imported by name is wrapped in the module that calls it)."""

    def __init__(self, sections: tuple[tuple[str, str, str], ...] = UCP_SECTIONS):
        import importlib

        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        for where, attr, name in sections:
            module, _, cls = where.partition(":")
            owner = importlib.import_module(module)
            owner = getattr(owner, cls) if cls else owner
            setattr(owner, attr, self._timed(getattr(owner, attr), name))

    def _timed(self, function, name: str):
        import functools

        @functools.wraps(function)
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began
                self.calls[name] = self.calls.get(name, 0) + 1

        return timed

    def report(self) -> dict:
        return {name: {"s": round(s, 4), "calls": self.calls[name]} for name, s in self.seconds.items()}


def peak_rss(pid: int | str = "self") -> int:
    """The peak resident set of a process since its last reset (VmHWM), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def reset_peak_rss(pid: int | str = "self") -> None:
    """Start VmHWM afresh (Linux: "5" into clear_refs), so each tool's peak is its own."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        pass


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def accept_torch_keywords(checkpointer) -> None:
    """DLRover 0.6.1 puts its agent's `save(state_dict, path)` and `load(path, map_location)` in place of
    `torch.save` and `torch.load` while DeepSpeed saves and loads, and DeepSpeed 0.19's TorchCheckpointEngine calls
    `torch.save(state_dict, path, _use_new_zipfile_serialization=...)` and `torch.load(path, map_location=...,
    weights_only=False)`: without this shim every save fails with "TypeError: AsyncCheckpointAgent.save() got an
    unexpected keyword argument '_use_new_zipfile_serialization'" and every load with "TypeError:
    AsyncCheckpointAgent.load() got an unexpected keyword argument 'weights_only'". It drops those keywords (DLRover
    keeps state dicts in memory, whatever the format, and its own reads pass no weights_only) and changes nothing
    else."""
    agent = checkpointer._ckpt_agent
    save, load = agent.save, agent.load
    agent.save = lambda state_dict, path, **keywords: save(state_dict, path)
    agent.load = lambda path, map_location=None, **keywords: load(path, map_location=map_location)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--tools", nargs="+", choices=tuple(FAMILY_OF), required=True)
    p.add_argument("--phase", choices=("save", "recover", "resize"), required=True)
    p.add_argument("--model", choices=sorted(MODELS), default="112m")
    p.add_argument("--save-dir", required=True)
    p.add_argument("--memory-dir", help="ucp: the node's memory folder")
    p.add_argument("--records", required=True)
    p.add_argument("--rounds", type=int, default=3, help="save: saves timed one by one")
    p.add_argument("--plain", type=int, default=3, help="save: plain steps timed")
    p.add_argument("--every1", type=int, default=4, help="save: steps timed with a save after each")
    p.add_argument("--every4", type=int, default=8, help="save: steps timed with a save after every 4th")
    p.add_argument("--steps", type=int, default=8, help="recover: steps to train")
    p.add_argument("--load-universal", help="resize: DeepSpeed's universal checkpoint folder (its tag)")
    args = p.parse_args(argv)
    if len({FAMILY_OF[t] for t in args.tools}) > 1:
        p.error("--tools: ucp and DeepSpeed run under torchrun, DLRover under dlrover-run, DCP on its own FSDP2 "
                "job (_peers_dcp.py); one family per launch")
    return args


class Job:
    """The engine of one launch and the saves of its tools: `save(tool)` returns when training may go on,
    `durable(tool)` when that save is on disk and synced (None for a memory tier), `committed(tool)` when it is
    complete where it goes."""

    def __init__(self, args: argparse.Namespace):
        self.marks = StartMarks()
        import torch.distributed as dist
        from transformers import LlamaConfig, LlamaForCausalLM

        self.args = args
        self.dlrover = args.tools[0] in DLROVER_FAMILY
        if self.dlrover:
            import deepspeed
            from dlrover.trainer.torch.flash_checkpoint.deepspeed import DeepSpeedCheckpointer

            self.marks.mark("imported")
            deepspeed.init_distributed(dist_backend="gloo")
        else:
            # deepspeed as in DLRover's worker: with the job's libraries (ucp's initialize would import it)
            import deepspeed  # noqa: F401

            import ucp.elastic

            self.marks.mark("imported")
            ucp.elastic.init_distributed("gloo")
        self.marks.mark("rendezvous")
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(LlamaConfig(**MODELS[args.model]))
        self.marks.mark("model")
        self.sections = None
        if args.phase in ("recover", "resize"):  # where the restart's time goes, by part
            self.sections = Sections(DLROVER_SECTIONS if self.dlrover else UCP_SECTIONS)
        self.n_params = sum(p.numel() for p in model.parameters())
        config: dict = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                        "zero_optimization": {"stage": 1}, "steps_per_print": NEVER,
                        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
        if self.dlrover:
            if args.load_universal:
                config["checkpoint"] = {"load_universal": True}
            self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
            self.checkpointer = DeepSpeedCheckpointer(self.engine, args.save_dir)
            accept_torch_keywords(self.checkpointer)
        else:
            import ucp.deepspeed

            memory_every = 1 if args.phase == "recover" else NEVER
            config["ucp"] = {"load": "auto", "save": {
                "dir": str(Path(args.save_dir) / "ucp"), "every": NEVER,
                "memory": {"every": memory_every, "replicas": 0, "dir": args.memory_dir}}}
            self.engine, *_ = ucp.deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                       config=config)
        self.started = time.time()
        self.marks.mark("engine")
        g = torch.Generator().manual_seed(SEED + self.rank)
        self.ids = torch.randint(0, MODELS[args.model]["vocab_size"], (1, SEQ_LEN), generator=g)
        self.save_began = 0.0
        self.ucp_stats = None
        self.skipped = 0

    def step(self) -> float:
        began = time.perf_counter()
        loss = lm_loss(self.engine, self.ids)
        forward = time.perf_counter()
        self.engine.backward(loss)
        backward = time.perf_counter()
        self.engine.step()
        end = time.perf_counter()
        self.step_parts = {"forward_s": forward - began, "backward_s": backward - forward,
                           "engine_step_s": end - backward}  # ucp's engine.step: DeepSpeed's, then its life's
        return end - began

    def folder(self, tool: str) -> Path:
        return Path(self.args.save_dir) / tool

    def save(self, tool: str) -> float:
        """Save at the current step; the seconds training was held."""
        import ucp.deepspeed

        step = self.engine.global_steps
        self.save_began = began = time.perf_counter()
        if tool == "ucp":
            self.ucp_stats = ucp.deepspeed.save(self.engine, self.folder(tool))
        elif tool == "ucp_memory":
            from ucp.deepspeed.life import saver_for

            saver_for(self.engine).save_memory()
        elif tool == "deepspeed":
            self.engine.save_checkpoint(str(self.folder(tool)), tag=f"global_step{step}")
        else:
            from dlrover.trainer.torch.flash_checkpoint.checkpointer import StorageType

            engine = self.checkpointer._async_save_engine
            self.checkpointer.save_checkpoint(self.args.save_dir, tag=step, storage_type=(
                StorageType.DISK if tool == "dlrover_disk" else StorageType.MEMORY))
            if (engine.latest_step if tool == "dlrover_disk" else engine._cached_step) != step:
                self.skipped += 1  # DLRover skips a save while its agent still persists the previous one
        return time.perf_counter() - began

    def durable(self, tool: str) -> float | None:
        """Block until the last save is on disk and synced; seconds from its call (None: memory only)."""
        import ucp.deepspeed

        if tool in ("ucp_memory", "dlrover"):
            return None
        if tool == "ucp":  # fsynced, index committed: ucp's own measure
            ucp.deepspeed.wait(self.engine)
            return self.ucp_stats.durable_s
        if tool == "dlrover_disk":  # DLRover's agent writes (torch.save, no fsync), then fsyncs its tracer file
            self.wait_dlrover_tracer()
        os.sync()  # neither DeepSpeed nor DLRover's agent fsync their data files: sync says when they are durable
        return time.perf_counter() - self.save_began

    def wait_dlrover_tracer(self) -> None:
        """Until DLRover's agent has persisted the last save it accepted: a save that finds the agent still writing
        the previous one is skipped (`save_to_storage` returns False and keeps `latest_step`)."""
        tracer = Path(self.args.save_dir) / DLROVER_TRACER
        want = str(self.checkpointer._async_save_engine.latest_step)
        while not (tracer.is_file() and tracer.read_text().strip() == want):
            time.sleep(0.01)

    def committed(self, tool: str) -> float:
        """Block until the last save is complete where it goes (memory tiers: in memory); seconds from its call."""
        import ucp.deepspeed

        if tool.startswith("ucp"):
            ucp.deepspeed.wait(self.engine)
        elif tool == "dlrover_disk":
            self.wait_dlrover_tracer()
        return time.perf_counter() - self.save_began

    def saved_bytes(self, tool: str) -> int:
        """What this rank sees of the last save where it went: a folder on the shared disk (all ranks' files), the
        node's memory folder, or (dlrover) this rank's shared-memory segment."""
        step = self.engine.global_steps
        if tool == "ucp_memory":
            return folder_bytes(Path(self.args.memory_dir) / f"global_step{step}")
        if tool == "dlrover":
            return self.checkpointer._async_save_engine._shm_handler.shared_memory.size
        if tool == "dlrover_disk":
            return folder_bytes(Path(self.args.save_dir) / str(step))
        return folder_bytes(self.folder(tool) / f"global_step{step}")

    def slowest(self, seconds: float) -> float:
        import torch.distributed as dist

        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def gather(self, values: list[float]) -> list[list[float]]:
        import torch.distributed as dist

        out = [torch.zeros(len(values), dtype=torch.float64) for _ in range(self.world)]
        dist.all_gather(out, torch.tensor(values, dtype=torch.float64))
        return [t.tolist() for t in out]

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()


def measure_saves(job: Job, tool: str) -> dict:
    """One tool's saves on the running job (module docstring); the slowest rank's time for each."""
    args = job.args
    job.barrier()
    job.save(tool)  # untimed: buffers, shared memory and process groups are made at the first save
    job.committed(tool)
    reset_peak_rss()
    reset_peak_rss(os.getppid())
    job.barrier()
    plain = [job.slowest(job.step()) for _ in range(args.plain)]
    blocked, durable, committed = [], [], []
    for _ in range(args.rounds):
        job.step()
        job.barrier()
        blocked.append(job.slowest(job.save(tool)))
        seconds = job.durable(tool)
        durable.append(None if seconds is None else job.slowest(seconds))
        committed.append(job.slowest(job.committed(tool)))
    per_rank_bytes = job.gather([job.saved_bytes(tool)])

    def every(k: int, n: int) -> list[float]:
        job.barrier()
        times = []
        for i in range(n):
            began = time.perf_counter()
            job.step()
            if (i + 1) % k == 0:
                job.save(tool)
            times.append(job.slowest(time.perf_counter() - began))
        job.committed(tool)
        return times

    job.skipped = 0
    every1, every4 = every(1, args.every1), every(4, args.every4)
    rss = job.gather([peak_rss(), peak_rss(os.getppid())])
    # dlrover: each rank's own segment, summed; the others: one folder every rank sees (the node's, the disk's)
    saved = sum(b[0] for b in per_rank_bytes) if tool == "dlrover" else per_rank_bytes[0][0]
    return {"tool": tool, "world": job.world, "params": job.n_params, "plain_s": plain, "blocked_s": blocked,
            "durable_s": durable, "committed_s": committed, "every1_s": every1, "every4_s": every4,
            "bytes_per_save": int(saved), "peak_rss_per_rank": [int(r[0]) for r in rss],
            "launcher_peak_rss": int(rss[0][1]), "skipped_saves": int(job.slowest(job.skipped))}


def save_phase(job: Job) -> None:
    for _ in range(2):
        job.step()
    for tool in job.args.tools:
        record = measure_saves(job, tool)
        if job.rank == 0:
            append(job.args.records, record)


def recover_phase(job: Job, called: float) -> None:
    args = job.args
    load_s, checkpoint_step = 0.0, 0
    if job.dlrover and (Path(args.save_dir) / "latest").is_file():  # a restart: DLRover's load, from its memory
        began = time.perf_counter()
        job.checkpointer.load_checkpoint(args.save_dir)
        load_s, checkpoint_step = time.perf_counter() - began, job.engine.global_steps
    ready = time.time()
    first = True
    while job.engine.global_steps < args.steps:
        job.step()
        step = job.engine.global_steps
        restart = getattr(job.engine, "ucp_restart", None)  # ucp's report of its load, made at the first step
        if first and restart is not None and restart.checkpoint is not None:
            load_s, checkpoint_step = restart.load_s, restart.checkpoint_step
        if job.dlrover:
            job.save("dlrover_disk" if step == 1 else "dlrover")
            if step == 1:  # not checkpointer.wait_latest_checkpoint: it opens DLRover's tracer before it exists
                job.wait_dlrover_tracer()
        if job.rank == 0:
            now = time.time()
            if first and checkpoint_step > 0:
                # ucp's load runs inside initialize; DLRover's after it
                startup = job.started - called - (0.0 if job.dlrover else load_s)
                append(args.records, {"restart": {
                    "called": called, "startup_s": startup, "load_s": load_s, "first_step_s": now - ready,
                    "first_step_at": now, "checkpoint_step": checkpoint_step, "world": job.world,
                    "process_at": job.marks.at["process"], "params": job.n_params,
                    "sections": {**job.sections.report(), **{f"first step: {k.removesuffix('_s')}": {"s": v, "calls": 1}
                                                                   for k, v in job.step_parts.items()}},
                    **job.marks.parts(0.0 if job.dlrover else load_s)}})
            append(args.records, {"step": step, "time": now, "world": job.world})
        first = False


def resize_phase(job: Job, called: float) -> None:
    args = job.args
    began = time.perf_counter()
    try:
        if args.load_universal:
            folder = Path(args.load_universal)
            job.engine.load_checkpoint(str(folder.parent), tag=folder.name)
        else:
            job.checkpointer.load_checkpoint(args.save_dir)
    except Exception as exc:  # the refusal is the result: recorded in one line
        if job.rank == 0:
            append(args.records, {"refused": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0]}",
                                  "world": job.world})
        return
    load_s = time.perf_counter() - began
    ready = time.time()
    job.step()
    if job.rank == 0:
        now = time.time()
        append(args.records, {"resized": {"called": called, "startup_s": job.started - called, "load_s": load_s,
                                          "first_step_s": now - ready, "first_step_at": now,
                                          "step": job.engine.global_steps, "world": job.world,
                                          "process_at": job.marks.at["process"], "params": job.n_params,
                                          "sections": job.sections.report(), **job.marks.parts()}})


def main() -> None:
    called = time.time()
    args = parse()
    job = Job(args)
    if args.phase == "save":
        save_phase(job)
    elif args.phase == "recover":
        recover_phase(job, called)
    else:
        resize_phase(job, called)
    job.barrier()


if __name__ == "__main__":
    import ucp.deepspeed

    main()
    ucp.deepspeed.finish()  # waits for ucp's saves in flight, exits with their status
