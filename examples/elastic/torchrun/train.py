"""Elastic DeepSpeed training under torchrun: lose a node or a worker, keep training, get it back.

Each agent is a "node"; on one machine, start several (each its own terminal), all with the same rendezvous:

    ucp-torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 \\
        --rdzv-id=demo --max-restarts=10 --monitor-interval=1 --rdzv-conf=last_call_timeout=2 \\
        examples/elastic/torchrun/train.py --save-dir /tmp/elastic --steps 40

Kill one agent (and its worker) and the others restart their workers at the new world size, which resume from
the newest committed ucp checkpoint. With --in-process (`ucp.elastic.run`), the survivors do not restart at all:
they leave the broken process group, regroup and load the newest checkpoint in the same processes (launch with
--rdzv-backend=c10d and --rdzv-endpoint: they meet in that store). Start an agent again and the job grows back at
the next restart (torchrun's agents restart every worker then, in-process or not). The first
agent hosts the rendezvous store: keep it (or run the store elsewhere, --rdzv-endpoint) alive. `ucp-torchrun` is
torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 set, without which torch's agents cannot admit a node that
joins later (README, "Elastic training"). On GPUs, drop
DS_ACCELERATOR and the gloo backend.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")   # CPU only
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training import Run, train  # noqa: E402

import ucp.deepspeed  # noqa: E402
import ucp.elastic  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-dir", required=True, help="where ucp saves, and resumes from after a restart")
    p.add_argument("--steps", type=int, default=16, help="optimizer steps the run trains in all")
    p.add_argument("--stage", type=int, default=1, help="ZeRO stage")
    p.add_argument("--global-batch", type=int, default=10, help="samples per optimizer step, at any world size")
    p.add_argument("--micro-batch", type=int, default=2, help="the most samples per forward pass")
    p.add_argument("--every", type=int, default=1, help="save every this many optimizer steps")
    p.add_argument("--keep", type=int, default=3, help="committed checkpoints to keep")
    p.add_argument("--memory-every", type=int, help="also save into host memory every this many steps")
    p.add_argument("--replicas", type=int, default=1, help="other nodes that keep a copy of each node's memory save")
    p.add_argument("--memory-dir", help="each node's memory folder ($VARS expanded on the node; default /dev/shm)")
    p.add_argument("--losses-out", help="append each step's loss here (JSON lines, rank 0)")
    p.add_argument("--stock", action="store_true", help="negative control: DistributedSampler, no \"elastic\"")
    p.add_argument("--in-process", action="store_true",
                   help="ucp.elastic.run: the survivors of a fault go on in the same processes")
    p.add_argument("--detect-s", type=float, help="with --in-process: seconds of silence before a rank is hung")
    p.add_argument("--step-s", type=float, default=0.0,
                   help="sleep this long after each optimizer step, a stand-in for a real model's compute: the tiny "
                        "model's step is shorter than its memory save, which a real step is not")
    args = p.parse_args()
    memory = None
    if args.memory_every:
        memory = {"every": args.memory_every, "replicas": args.replicas}
        if args.memory_dir:
            memory["dir"] = args.memory_dir
    run = Run(args.save_dir, args.steps, args.stage, args.global_batch, args.micro_batch, args.every, args.keep,
              args.losses_out, args.stock, memory=memory, detect_s=args.detect_s)
    if args.step_s:
        run.after_step = lambda engine, loss: time.sleep(args.step_s)
    if args.in_process:
        # The process group, then train(run); after a fault, train(run) again in this process at the new size.
        ucp.elastic.run(lambda: train(run), backend="gloo")   # CPU only
        return
    # In place of deepspeed.init_distributed(): each restart meets in a store of its own (torchrun's shared
    # store keeps the addresses dead workers left; docs/RELIABILITY.md, "Elastic training").
    ucp.elastic.init_distributed("gloo")   # CPU only
    train(run)


if __name__ == "__main__":
    main()
    ucp.deepspeed.finish()   # exit 0 every time (docs/RELIABILITY.md, "Processes end with their exit code")
