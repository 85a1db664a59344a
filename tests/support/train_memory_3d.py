#!/usr/bin/env python
"""A tiny AutoTP Llama (train_llama_tp.py's) trained under torchrun's elastic agents with the ucp loop:
`"ucp": {"load": "auto", "save": {"dir", "every", "keep", "memory": {"every", "replicas", "dir"}}}`.

    ucp-torchrun ... tests/support/train_memory_3d.py --save-dir D --steps N --tp '{"4": 2, "2": 1}' ...

`--tp` maps a world size to the AutoTP degree this start uses (the data-parallel degree is the rest), so a
restart at another world size may take another layout. Each step trains on a global batch of
`--global-batch` rows drawn from the step's own seed, split over the data-parallel ranks, so the losses do
not depend on the layout. Rank 0 appends {step, loss, world, tp} per optimizer step to `--losses-out`.
"""
import argparse
import json
import os

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from train_llama_tp import SEQ, build_model  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--save-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--tp", required=True, help='JSON: world size -> AutoTP degree, e.g. {"4": 2, "2": 1}')
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=4)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--memory-every", type=int, default=1)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--memory-dir", required=True)
    p.add_argument("--losses-out", required=True)
    args = p.parse_args()

    import torch.distributed as dist

    import ucp.deepspeed
    import ucp.elastic

    ucp.elastic.init_distributed("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    tp = json.loads(args.tp)[str(world)]
    dp = world // tp
    micro = args.global_batch // dp
    config = {
        "train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": args.stage}, "steps_per_print": 10**9,
        "ucp": {"load": "auto", "save": {"dir": args.save_dir, "every": args.every, "keep": 2,
                                         "memory": {"every": args.memory_every, "replicas": args.replicas,
                                                    "dir": args.memory_dir}}},
    }
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    model = build_model(tied=False)
    engine, *_ = ucp.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    dp_rank = rank // tp  # AutoTP's TP groups are consecutive ranks
    while engine.global_steps < args.steps:
        g = torch.Generator().manual_seed(engine.global_steps)
        tokens = torch.randint(0, model.config.vocab_size, (args.global_batch, SEQ), generator=g)
        rows = tokens[dp_rank * micro:(dp_rank + 1) * micro]
        loss = engine(input_ids=rows, labels=rows).loss
        engine.backward(loss)
        engine.step()
        total = loss.detach().float().clone()
        dist.all_reduce(total)  # each data-parallel rank's mean, once per TP rank
        if rank == 0:
            with open(args.losses_out, "a") as f:
                f.write(json.dumps({"step": engine.global_steps, "loss": total.item() / world, "world": world,
                                    "tp": tp}) + "\n")
    ucp.deepspeed.wait(engine)


if __name__ == "__main__":
    main()
    import ucp.deepspeed

    ucp.deepspeed.finish()
