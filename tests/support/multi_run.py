"""The ``main`` of the family training scripts (train_pipe.py, train_moe.py, train_llama_tp.py).

Each script trains several configurations one after another in one torchrun launch: ``--runs`` is a
JSON list of runs (the options the script reads, plus ``save_dir`` and ``dump_state``), ``--steps``
how many steps each trains before saving. Process groups are made once (gloo, CPU) and torch is
made deterministic, so a run's checkpoint and reference state do not depend on the runs before it.
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch


def run_all(train_one: Callable[[dict, argparse.Namespace], None], runs_help: str, argv: list[str] | None = None,
            add_arguments: Callable[[argparse.ArgumentParser], None] | None = None) -> int:
    """Parse ``--runs`` and ``--steps`` (and what `add_arguments` adds), then ``train_one(run, args)`` for each run."""
    p = argparse.ArgumentParser()
    p.add_argument("--runs", required=True, help=f"JSON list of runs, each {runs_help}: trained one after another "
                   "in this process (one launch, several checkpoints)")
    p.add_argument("--steps", type=int, default=2)
    if add_arguments is not None:
        add_arguments(p)
    args = p.parse_args(argv)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    import torch.distributed as dist

    torch.use_deterministic_algorithms(True)
    deepspeed.init_distributed(dist_backend="gloo")
    for run in json.loads(args.runs):
        train_one(run, args)
    dist.destroy_process_group()
    return 0


def save_and_close(engine, run: dict, client_state: dict) -> None:
    """Save the run's checkpoint into its ``save_dir``, wait for every rank, and free the engine for the next run."""
    import torch.distributed as dist

    engine.save_checkpoint(run["save_dir"], client_state=client_state)
    dist.barrier()
    engine.destroy()
