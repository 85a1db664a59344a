"""Elastic DeepSpeed training under Ray Train: lose a node, keep training at the new size, grow back.

    ray start --head --num-cpus 1 --resources '{"slot": 1}'                 # one "slot" per node: one worker each
    ray start --address HEAD:6379 --num-cpus 1 --resources '{"slot": 1}'    # on every other node
    python examples/elastic/ray/train.py --address auto --storage /shared/ray_runs --steps 40

The training function is the torchrun example's (`../training.py`; with `--example train_3d`, the AutoTP one of
`../torchrun/train_3d.py`, which takes a tensor x data-parallel layout for the workers of each start), run by
`ray.train.torch.TorchTrainer` with `ScalingConfig(num_workers=(MIN, MAX))`: when a node goes, Ray restarts the
worker group on the nodes left, and the function resumes through ucp from the checkpoint Ray hands back
(`ucp.elastic.ray_train`); when a node comes back, Ray grows the group at its next resize check and the function
resumes again, at the new size. Each committed ucp checkpoint is reported to Ray in place, under the run's storage.
On GPUs, drop DS_ACCELERATOR and the gloo backend, and ask for {"GPU": 1} per worker.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1]


def train_fn(config: dict) -> None:
    """One worker of the group (Ray has set up torch.distributed already)."""
    import os
    import sys

    os.environ.setdefault("DS_ACCELERATOR", "cpu")   # CPU only
    sys.path.insert(0, config["examples"])
    import deepspeed

    import ucp.elastic.ray_train

    deepspeed.init_distributed(dist_backend="gloo")   # CPU only

    def report(engine, loss: float) -> None:
        ucp.elastic.ray_train.report(engine, {"loss": loss, "step": engine.global_steps})

    if config["example"] == "train_3d":
        sys.path.insert(0, os.path.join(config["examples"], "torchrun"))
        import train_3d

        args = train_3d.parser().parse_args(
            ["--save-dir", "", "--steps", str(config["steps"]), "--global-batch", str(config["global_batch"]),
             "--micro-batch", str(config["micro_batch"]),
             *(["--losses-out", config["losses_out"]] if config["losses_out"] else [])])
        train_3d.train(args, ucp.elastic.ray_train.ucp_section(every=config["every"], keep=config["keep"]), report)
        return
    from training import Run, train

    run = Run(save_dir="", steps=config["steps"], stage=config["stage"], global_batch=config["global_batch"],
              micro_batch=config["micro_batch"], losses_out=config["losses_out"],
              ucp=ucp.elastic.ray_train.ucp_section(every=config["every"], keep=config["keep"]), after_step=report)
    train(run)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", default="auto", help="the Ray cluster (ray.init's address)")
    p.add_argument("--storage", required=True, help="RunConfig.storage_path: runs and their checkpoints")
    p.add_argument("--name", default="ucp-elastic", help="RunConfig.name: the run's folder under --storage")
    p.add_argument("--min-workers", type=int, default=2)
    p.add_argument("--max-workers", type=int, default=3)
    p.add_argument("--resources-per-worker", default='{"CPU": 0.5, "slot": 1}', help="JSON")
    p.add_argument("--max-failures", type=int, default=10)
    p.add_argument("--resize-check-s", type=float, default=5.0, help="how often Ray looks for room to grow")
    p.add_argument("--example", choices=["training", "train_3d"], default="training",
                   help="the training function: ../training.py's (data parallel), or torchrun/train_3d.py's (AutoTP "
                        "Llama, a tensor x data-parallel layout chosen at each start)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=10)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--losses-out", help="append each step's loss here (JSON lines, rank 0)")
    args = p.parse_args()

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    ray.init(address=args.address)
    trainer = TorchTrainer(
        train_fn,
        train_loop_config={**vars(args), "examples": str(EXAMPLES)},
        torch_config=TorchConfig(backend="gloo"),   # CPU only
        scaling_config=ScalingConfig(num_workers=(args.min_workers, args.max_workers),
                                     resources_per_worker=json.loads(args.resources_per_worker),
                                     elastic_resize_monitor_interval_s=args.resize_check_s),
        run_config=RunConfig(name=args.name, storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=args.max_failures)))
    result = trainer.fit()
    print(f"finished: {result.metrics}, checkpoint {result.checkpoint.path if result.checkpoint else None}")


if __name__ == "__main__":
    main()
