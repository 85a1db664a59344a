"""README's Ray Train recipe for a Hugging Face Trainer job, as a user runs it: Ray Train's `TorchTrainer` wraps
the function that builds the Trainer and calls `ucp.transformers.train(trainer)` (`"ucp": {"load": "auto"}`);
a worker group Ray restarts after a failure resumes from the newest complete `checkpoint-N` of `output_dir`.

    python train_hf_ray.py --address ADDRESS --storage DIR --min-workers 2 --max-workers 3 -- \\
        --output-dir OUT --max-steps T --save-steps K --global-batch B --log-out FILE [train_hf_elastic.py options]

The Trainer is `train_hf_elastic.py`'s (the torchrun recipe's script): the same function under either launcher.
CPU only: gloo, one `slot` resource per worker (one worker per raylet).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

SUPPORT = str(Path(__file__).resolve().parent)


def train_fn(config: dict) -> None:
    """One worker of the group: build the Trainer, then one command for the first start and every restart."""
    import sys

    sys.path.insert(0, config["support"])
    import train_hf_elastic
    import ucp.transformers

    ucp.transformers.train(train_hf_elastic.build_trainer(train_hf_elastic.parser().parse_args(config["argv"])))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--address", required=True, help="the Ray cluster (ray.init's address)")
    p.add_argument("--storage", required=True, help="RunConfig.storage_path")
    p.add_argument("--name", default="ucp-trainer")
    p.add_argument("--min-workers", type=int, default=2)
    p.add_argument("--max-workers", type=int, default=3)
    p.add_argument("--max-failures", type=int, default=5)
    p.add_argument("argv", nargs=argparse.REMAINDER, help="after --: train_hf_elastic.py's arguments")
    args = p.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv

    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    ray.init(address=args.address)
    trainer = TorchTrainer(
        train_fn, train_loop_config={"support": SUPPORT, "argv": argv},
        torch_config=TorchConfig(backend="gloo"),   # CPU only
        scaling_config=ScalingConfig(num_workers=(args.min_workers, args.max_workers),
                                     resources_per_worker={"CPU": 0.5, "slot": 1}),
        run_config=RunConfig(name=args.name, storage_path=args.storage,
                             failure_config=FailureConfig(max_failures=args.max_failures)))
    trainer.fit()
    print("finished")


if __name__ == "__main__":
    main()
