"""A Hugging Face Trainer job as a user runs it under torchrun's elastic agents: one command for the first start
and every restart, `ucp.transformers.train(trainer, resume_from_checkpoint="auto")`.

    ucp-torchrun --nnodes=MIN:MAX ... train_hf_elastic.py --output-dir OUT --max-steps T --save-steps K
        --log-out FILE [--model llama|llama-lora] [--stage S] [--global-batch B --micro-batch M] [--step-sleep SECONDS]
        [--die-in-save N --die-marker FILE] [--resume auto|PATH] [--per-device P]

The DeepSpeed config carries `"ucp": {"load": "auto", "elastic": {"global_batch": B, "micro_batch": M}}`
(without `--global-batch`, no "elastic": the Trainer's own per-device batch `--per-device` and sampler).
`--log-out` gets one JSON line per step the Trainer logs on rank 0: {"step", "loss", "lr", "epoch", "world"}
(a step redone after a restart appears again). `--die-in-save N`: rank 1 SIGKILLs itself inside the save of
checkpoint-N (after the model files, before its DeepSpeed files), once: `--die-marker` records that it did.
`--step-sleep` paces the steps so that a test can act between them.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.distributed as dist  # noqa: E402

from train_hf import LORA_LR, TokenData, ds_config, tiny_model  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama", choices=["llama", "llama-lora"])
    p.add_argument("--stage", type=int, default=2)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--save-steps", type=int, required=True)
    p.add_argument("--save-total-limit", type=int, default=None)
    p.add_argument("--global-batch", type=int, default=None)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--per-device", type=int, default=2)
    p.add_argument("--resume", default="auto")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--die-in-save", type=int, default=0)
    p.add_argument("--die-marker", default=None)
    p.add_argument("--log-out", required=True)
    return p


def build_trainer(args: argparse.Namespace):
    """The user's Trainer, as each worker builds it at every start (torchrun's or Ray Train's)."""
    import accelerate
    import transformers

    accelerate.PartialState(backend="gloo")  # the CPU recipe: the Trainer sees torchrun's world only this way
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    config = ds_config(args.stage)
    config["ucp"] = {"load": args.resume}
    if args.global_batch is not None:
        config["ucp"]["elastic"] = {"global_batch": args.global_batch, "micro_batch": args.micro_batch}
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.per_device,
        learning_rate=LORA_LR if args.model == "llama-lora" else 1e-2, weight_decay=0.01, lr_scheduler_type="linear",
        warmup_steps=2, seed=0,
        save_strategy="steps", save_steps=args.save_steps, save_total_limit=args.save_total_limit,
        logging_steps=1, report_to=[], deepspeed=config, accelerator_config={"use_configured_state": True},
        disable_tqdm=True)

    class StepLog(transformers.TrainerCallback):
        def on_log(self, _args, state, control, logs=None, **kwargs):
            if state.is_world_process_zero and logs and "loss" in logs:
                with open(args.log_out, "a") as f:
                    f.write(json.dumps({"step": state.global_step, "loss": logs["loss"], "world": world,
                                        "lr": logs["learning_rate"], "epoch": logs["epoch"]}) + "\n")

        def on_step_end(self, _args, state, control, **kwargs):
            time.sleep(args.step_sleep)

    trainer = transformers.Trainer(model=tiny_model(args.model), args=training_args, train_dataset=TokenData(),
                                   callbacks=[StepLog()])
    if args.die_in_save and rank == 1:
        stock_save = trainer._save_optimizer_and_scheduler

        def save_then_die(output_dir):
            marker = Path(args.die_marker)
            if trainer.state.global_step == args.die_in_save and not marker.exists():
                marker.write_text(output_dir)
                os.kill(os.getpid(), signal.SIGKILL)
            return stock_save(output_dir)

        trainer._save_optimizer_and_scheduler = save_then_die
    return trainer


def main() -> None:
    import ucp.transformers

    ucp.transformers.train(build_trainer(parser().parse_args()))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(main())
