#!/usr/bin/env python
"""train_moe.py's tiny model with a native DeepSpeed MoE layer (4 experts, ep_size 2) trained elastically under
torchrun's agents.

    ucp-torchrun ... tests/support/train_moe_elastic.py --save-dir D --steps N --losses-out L

`"elastic": {"global_batch": 12, "micro_batch": 3, "expert_parallel": 2}`: D is a multiple of the ep_size, so 4
ranks train D=4 and 3 ranks D=2 with a spare. Each micro-batch of 3 samples is routed on its own rank (the
gate's capacity covers every token), so a sample's loss is the same at every D. Batches come from
`ElasticBatchSampler`; each step runs the engine's gradient-accumulation micro-batches through `engine(...)`,
`engine.backward`, `engine.step` (`elastic_steps.accumulated_step`). Rank 0 appends {step, loss, world, dp, pid}
per step to `--losses-out`.
With `--stock` ucp neither saves nor resumes (the uninterrupted reference run).
"""
import json
import os

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import train_moe as moe  # noqa: E402
from elastic_steps import Tokens, accumulated_step, arguments, endless  # noqa: E402

EP_SIZE = 2


def main() -> None:
    p = arguments()
    p.add_argument("--stock", action="store_true", help="ucp neither saves nor resumes (the reference run)")
    args = p.parse_args()

    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    import ucp.deepspeed
    import ucp.elastic

    ucp.elastic.init_distributed("gloo")
    elastic = {"global_batch": 12, "micro_batch": moe.MICRO_BATCH, "expert_parallel": EP_SIZE}
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 3e-2, "betas": [0.9, 0.95], "weight_decay": 0.01,
                                                      "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 10**9, "ucp": {"elastic": elastic}}
    if not args.stock:
        config["ucp"].update({"load": "auto", "save": {"dir": args.save_dir, "every": args.every, "keep": 2}})
    place = ucp.elastic.layout(config)
    ucp.elastic.spare_loop()   # a spare waits here for the next restart
    deepspeed.init_distributed("gloo")
    rank = dist.get_rank()
    model = moe.MoEModel(EP_SIZE, rank % EP_SIZE)   # DeepSpeed's EP rank of a rank without model parallelism
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": list(model.parameters()), "name": "all"}])
    engine, *_ = ucp.deepspeed.initialize(model=model, model_parameters=groups, config=config)
    dataset = Tokens(48, moe.VOCAB, moe.SEQ, scale=5, shift=2)
    sampler = ucp.elastic.ElasticBatchSampler(dataset, engine, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)

    data = endless(loader)
    while engine.global_steps < args.steps:
        loss = accumulated_step(engine, data, place.dp)   # every training rank is a data-parallel rank
        if rank == 0:
            with open(args.losses_out, "a") as f:
                f.write(json.dumps({"step": engine.global_steps, "loss": loss, "world": place.world, "dp": place.dp,
                                    "pid": os.getpid()}) + "\n")
    if not args.stock:
        ucp.deepspeed.wait(engine)


if __name__ == "__main__":
    main()
    import ucp.deepspeed

    ucp.deepspeed.finish()
