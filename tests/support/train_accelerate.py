"""Train a tiny tied Llama with Accelerate + DeepSpeed on CPU (torchrun, gloo), as an Accelerate user does.

    torchrun --nproc_per_node N train_accelerate.py --stage S --steps T [--save-at K --save-dir DIR]
        [--load DIR [--stock]] --losses-out FILE

The data is a plain `DataLoader(shuffle=True)`, as Accelerate prepares it by default, and the global
batch is fixed (GLOBAL_BATCH = N x per-process batch). The LR scheduler is a torch LambdaLR that
Accelerate keeps outside the engine (`scheduler.bin`). `--load` restores with `ucp.accelerate.load_state`
(engine state from `--checkpoint` when given; `--stock`: `accelerator.load_state`), then iterates the
loader from the start of the epoch, skipping the batches trained before the checkpoint, as Accelerate
users do, and trains the steps after the saved one. `--losses-out` gets {"losses": [...], "first_step":
K+1, "samples": [the sample ids of each step's global batch]}.
"""
from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"

import torch  # noqa: E402

from train_hf import GLOBAL_BATCH, TokenData, tiny_model  # noqa: E402


class IndexedTokenData(TokenData):
    """TokenData whose items say which sample they are, so a run can record the order it trained in."""

    def __getitem__(self, i):
        return {**super().__getitem__(i), "index": i}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stage", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--save-dir", default=None)
    p.add_argument("--load", default=None)
    p.add_argument("--checkpoint", default=None, help="the engine's state from here (e.g. a ucp conversion)")
    p.add_argument("--stock", action="store_true")
    p.add_argument("--losses-out", required=True)
    args = p.parse_args()

    import accelerate
    from accelerate.utils import DeepSpeedPlugin

    import ucp.accelerate

    state = accelerate.PartialState(backend="gloo")
    world = state.num_processes
    micro = GLOBAL_BATCH // world
    config = {"zero_optimization": {"stage": args.stage}, "train_micro_batch_size_per_gpu": micro,
              "gradient_accumulation_steps": 1, "train_batch_size": GLOBAL_BATCH}
    # One scheduler step per optimizer step at any world size (Accelerate would step it once per process).
    accelerator = accelerate.Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config),
                                         step_scheduler_with_optimizer=False)
    model = tiny_model("llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = torch.utils.data.DataLoader(IndexedTokenData(), batch_size=micro, shuffle=True, drop_last=True)
    engine, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    done = 0
    if args.load:
        if args.stock:
            accelerator.load_state(args.load)
        else:
            ucp.accelerate.load_state(accelerator, args.load, checkpoint=args.checkpoint)
        done = engine.global_steps
    losses, samples = [], []
    for step, batch in enumerate(loader):
        if step < done:
            continue  # the batches trained before the checkpoint
        if step == args.steps:
            break
        loss = engine(input_ids=batch["input_ids"], labels=batch["labels"]).loss
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
        samples.append(accelerator.gather(batch["index"]).tolist())
        if step + 1 == args.save_at:
            accelerator.save_state(args.save_dir)
    if accelerator.is_main_process:
        with open(args.losses_out, "w") as f:
            json.dump({"losses": losses, "first_step": done + 1, "samples": samples}, f)
    accelerator.wait_for_everyone()
    accelerator.end_training()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(main())
