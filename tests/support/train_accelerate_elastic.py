"""An Accelerate + DeepSpeed loop as a user runs it under torchrun's elastic agents: the same command for the first
start and every restart, `ucp.accelerate.load_state(accelerator, SAVE_DIR, checkpoint="auto")`.

    ucp-torchrun --nnodes=MIN:MAX ... train_accelerate_elastic.py --project-dir DIR --steps T --save-every K
        --log-out FILE [--step-sleep SECONDS]

ZeRO-2, the tiny tied Llama, 4 samples per step at any number of processes (4 / N each). The data loader shuffles
with Accelerate's seedable sampler (`use_seedable_sampler=True`, the order ucp carries to any size, 1 -> N
included; a plain `shuffle=True` loader cannot go from 1 process to more). Accelerate names the saves
(`automatic_checkpoint_naming`, `DIR/checkpoints/checkpoint_<i>`, `total_limit=2`) every K steps; after a resume
the next save's number follows the folder resumed from (ucp sets it: Accelerate would write checkpoint_0 again and
refuse). The loop skips the batches trained before the checkpoint, as Accelerate users do. `--log-out` gets one
JSON line per step on the main process: {"step", "loss", "lr", "world", "samples": the step's global batch, in
rank order}.
"""
from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"

import torch  # noqa: E402

from train_accelerate import IndexedTokenData  # noqa: E402
from train_hf import GLOBAL_BATCH, tiny_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--project-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, required=True)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--log-out", required=True)
    args = p.parse_args()

    import accelerate
    from accelerate.utils import DataLoaderConfiguration, DeepSpeedPlugin, ProjectConfiguration, set_seed

    import ucp.accelerate

    state = accelerate.PartialState(backend="gloo")
    world = state.num_processes
    micro = GLOBAL_BATCH // world
    config = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": 1, "train_batch_size": GLOBAL_BATCH}
    accelerator = accelerate.Accelerator(
        deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config), step_scheduler_with_optimizer=False,
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
        project_config=ProjectConfiguration(project_dir=args.project_dir, automatic_checkpoint_naming=True,
                                            total_limit=2))
    set_seed(0)
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = torch.utils.data.DataLoader(IndexedTokenData(), batch_size=micro, shuffle=True, drop_last=True)
    engine, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    resumed = ucp.accelerate.load_state(accelerator, os.path.join(args.project_dir, "checkpoints"),
                                        checkpoint="auto")
    done = engine.global_steps if resumed is not None else 0
    for step, batch in enumerate(loader):
        if step < done:
            continue  # the batches trained before the checkpoint
        if step == args.steps:
            break
        loss = engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        accelerator.backward(loss)
        optimizer.step()
        lr = scheduler.get_last_lr()[0]
        scheduler.step()
        optimizer.zero_grad()
        mean = accelerator.reduce(loss.detach(), reduction="mean").item()
        samples = accelerator.gather(batch["index"]).tolist()
        if accelerator.is_main_process:
            with open(args.log_out, "a") as f:
                f.write(json.dumps({"step": step + 1, "loss": mean, "lr": lr, "world": world,
                                    "samples": samples}) + "\n")
        if (step + 1) % args.save_every == 0:
            accelerator.save_state()
        time.sleep(args.step_sleep)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(main())
