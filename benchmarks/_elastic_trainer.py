#!/usr/bin/env python
"""One worker of `benchmarks/elastic.py --trainer`: the benchmark Llama trained by the Hugging Face Trainer with
DeepSpeed ZeRO-1 fp32 on CPU, timed. Every rank runs this file (torchrun or its elastic agents).

    ucp:   ucp.transformers.train(trainer) with "ucp": {"load": "auto", "elastic": {"global_batch": B,
           "micro_batch": 1}}: the one command for the first start and every restart.
    stock: the per-device batch B // world; --resume CHECKPOINT_N: trainer.train(resume_from_checkpoint=...) with
           {"checkpoint": {"load_universal": true}}, i.e. ds_to_universal's output beside the Trainer's global_stepN
           and its `latest_universal`, as a person runs it.

The Trainer saves checkpoint-N every --every steps (save_total_limit 2). Rank 0 appends JSON lines to --records:
{"start": time, "world"} as the process starts (before its imports), {"load_began", "load_s"} around the engine's
load (ucp.deepspeed.load, or DeepSpeed's load_checkpoint as the Trainer calls it), and {"step", "time", "world"}
at the end of each step.
"""
from __future__ import annotations

import time

STARTED = time.time()

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _elastic_llama import Tokens  # noqa: E402
from _train_llama import MODELS  # noqa: E402


class LabelledTokens(Tokens):
    """The benchmark's token sequences as the Trainer takes them, within `vocab` (the 20m model's is smaller)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.ids %= vocab

    def __getitem__(self, i: int) -> dict:
        ids = super().__getitem__(i)
        return {"input_ids": ids, "labels": ids}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("ucp", "stock"), required=True)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--model", choices=sorted(MODELS), default="112m")
    p.add_argument("--resume", help="stock: the checkpoint-N folder holding ds_to_universal's output")
    p.add_argument("--records", required=True)
    args = p.parse_args()

    import accelerate
    import transformers

    import ucp.deepspeed
    import ucp.transformers

    accelerate.PartialState(backend="gloo")  # the CPU recipe (README): the Trainer sees torchrun's world
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))

    def record(line: dict) -> None:
        if rank == 0:
            with open(args.records, "a") as f:
                f.write(json.dumps(line) + "\n")

    record({"start": STARTED, "world": world})

    def timed(load):
        @functools.wraps(load)
        def timed_load(*a, **k):
            began = time.time()
            out = load(*a, **k)
            record({"load_began": began, "load_s": time.time() - began})
            return out
        return timed_load

    if args.mode == "ucp":
        ucp.deepspeed.load = timed(ucp.deepspeed.load)  # what ucp.transformers calls for the engine
    else:
        import transformers.trainer

        transformers.trainer.deepspeed_load_checkpoint = timed(transformers.trainer.deepspeed_load_checkpoint)

    config = {"zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                         "weight_decay": "auto", "torch_adam": True}},
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "train_batch_size": "auto", "gradient_clipping": "auto"}
    if args.mode == "ucp":
        config["ucp"] = {"load": "auto", "elastic": {"global_batch": args.global_batch, "micro_batch": 1}}
    elif args.resume:
        config["checkpoint"] = {"load_universal": True}
    training_args = transformers.TrainingArguments(
        output_dir=args.output_dir, max_steps=args.steps, per_device_train_batch_size=args.global_batch // world,
        learning_rate=1e-4, lr_scheduler_type="linear", warmup_steps=1, seed=0, save_strategy="steps",
        save_steps=args.every, save_total_limit=2, logging_steps=1, report_to=[], deepspeed=config,
        accelerator_config={"use_configured_state": True}, disable_tqdm=True, dataloader_drop_last=True)

    class StepTimes(transformers.TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            record({"step": state.global_step, "time": time.time(), "world": world})

    torch.manual_seed(0)
    shape = MODELS[args.model]
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
    trainer = transformers.Trainer(model=model, args=training_args, train_dataset=LabelledTokens(shape["vocab_size"]),
                                   callbacks=[StepTimes()])
    if args.mode == "ucp":
        ucp.transformers.train(trainer)
    else:
        trainer.train(resume_from_checkpoint=args.resume)
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    import ucp.deepspeed
    ucp.deepspeed.finish(main())
