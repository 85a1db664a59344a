#!/usr/bin/env python
"""train_megatron.py's tiny Megatron-style GPT (an `mpu` for TP inside a `PipelineModule` for PP) trained
elastically under torchrun's agents: each start builds the model for the layout `ucp.elastic.layout` chooses.

    ucp-torchrun ... tests/support/train_megatron_elastic.py --save-dir D --steps N --losses-out L

`"elastic": {"global_batch": 4, "micro_batch": 1, "tensor_parallel": [2, 1], "pipeline_parallel": [2, 1]}` with
the model's shape (`"model"`, a config.json this script writes next to the save folder, and `"seq_len"`) for the
cost model: on 4 ranks it picks T=2 x P=2 x D=1, on 3 ranks T=2 x P=1 x D=1 and a spare (test_elastic_megatron
says why). `mlp.input_scale`'s gradient is all-reduced over TP (`sync_scale`), so its copies stay equal and a
resume at another TP continues the run exactly. Batches come from `ElasticBatchSampler` through
`engine.train_batch(data_iter)`. Rank 0 appends {step, loss, world, tp, pp, dp, pid} per step to `--losses-out`.
With `--stock` DeepSpeed saves every step and ucp neither saves nor resumes (the uninterrupted reference run; with
`--load-tag`, DeepSpeed's own resume: the negative control).

With `--no-pipeline` the same layers train in a plain module (`train_megatron.GPTModel`), the `mpu` passed to
`initialize`, and `"elastic": {..., "tensor_parallel": 2, "pipeline_parallel": 1}`: T=2 x D=2 on 4 ranks, T=2 x D=1
and a spare on 3. Each step runs the engine's gradient-accumulation micro-batches from the sampler through
`engine(...)`, `engine.backward`, `engine.step`; the loss logged is their mean over the data-parallel ranks, as a
pipeline's `train_batch` reports it.
"""
import json
import os

import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import train_megatron as gpt  # noqa: E402
from elastic_steps import Tokens, accumulated_step, arguments, endless  # noqa: E402

SHAPE = {"model_type": "llama", "hidden_size": gpt.HIDDEN, "intermediate_size": gpt.FFN, "num_hidden_layers": 2,
         "num_attention_heads": gpt.HEADS, "num_key_value_heads": gpt.KV_HEADS, "vocab_size": gpt.VOCAB}


def main() -> None:
    p = arguments()
    p.add_argument("--stock", action="store_true", help="DeepSpeed saves every step (engine.save_checkpoint)")
    p.add_argument("--load-tag", help="with --stock: engine.load_checkpoint of this tag first")
    p.add_argument("--no-pipeline", action="store_true", help="an mpu without a PipelineModule (TP 2 x DP)")
    args = p.parse_args()

    import deepspeed
    import torch.distributed as dist

    import ucp.deepspeed
    import ucp.elastic

    ucp.elastic.init_distributed("gloo")
    shape = args.save_dir.rstrip("/") + ".shape.json"
    if dist.get_rank() == 0:
        with open(shape + ".partial", "w") as f:
            json.dump(SHAPE, f)
        os.replace(shape + ".partial", shape)
    dist.barrier()
    elastic = {"global_batch": 4, "micro_batch": 1, "tensor_parallel": [2, 1], "pipeline_parallel": [2, 1],
               "model": shape, "seq_len": gpt.SEQ}
    if args.no_pipeline:
        elastic.update({"tensor_parallel": 2, "pipeline_parallel": 1})
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "betas": [0.9, 0.95], "weight_decay": 0.05,
                                                      "torch_adam": True}},
              "zero_optimization": {"stage": 1, "reduce_bucket_size": 10**6, "allgather_bucket_size": 10**6},
              "steps_per_print": 10**9, "ucp": {"elastic": elastic}}
    if not args.stock:
        config["ucp"].update({"load": "auto", "save": {"dir": args.save_dir, "every": args.every, "keep": 2}})
    place = ucp.elastic.layout(config)
    ucp.elastic.spare_loop()   # a spare waits here for the next restart
    deepspeed.init_distributed("gloo")   # PipelineModule asks DeepSpeed's comm for ranks: the training group
    gpt.use_layout(place.tp, place.pp, sync_scale=True)
    model = gpt.build_plain() if args.no_pipeline else gpt.build()
    mpu = {"mpu": gpt.MPU} if args.no_pipeline else {}  # a PipelineModule hands DeepSpeed its mpu itself
    engine, *_ = ucp.deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config,
                                          **mpu)
    dataset = Tokens(24, gpt.VOCAB, gpt.SEQ, scale=3, shift=1)
    sampler = ucp.elastic.ElasticBatchSampler(dataset, engine, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)

    if args.stock and args.load_tag:
        engine.load_checkpoint(args.save_dir, tag=args.load_tag)
    data = endless(loader)
    while engine.global_steps < args.steps:
        if args.no_pipeline:
            loss = accumulated_step(engine, data, place.dp, gpt.MPU.get_data_parallel_group())
        else:
            loss = float(engine.train_batch(data))
        if args.stock:
            engine.save_checkpoint(args.save_dir)
        if dist.get_rank() == 0:
            with open(args.losses_out, "a") as f:
                f.write(json.dumps({"step": engine.global_steps, "loss": loss, "world": place.world, "tp": place.tp,
                                    "pp": place.pp, "dp": place.dp, "pid": os.getpid()}) + "\n")
    if not args.stock:
        ucp.deepspeed.wait(engine)


if __name__ == "__main__":
    main()
    import ucp.deepspeed

    ucp.deepspeed.finish()
