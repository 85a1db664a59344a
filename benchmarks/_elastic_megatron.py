#!/usr/bin/env python
"""One worker of `benchmarks/elastic.py --traces P`: tests/support/train_megatron.py's Megatron-style GPT (an `mpu`
for tensor parallelism inside a DeepSpeed `PipelineModule`, `GPTModelPipe`, which declares
`universal_checkpoint_info`) at a benchmark size, ZeRO-1 fp32, trained elastically with ucp or on stock DeepSpeed's
path, timed. Every rank runs this file (torchrun or its elastic agents).

    ucp:   "elastic": {"global_batch": B, "micro_batch": 1, "tensor_parallel": [2, 1], "pipeline_parallel": [2, 1],
           "model": <this shape's config.json>, "seq_len": 64}, "load": "auto", "save": {"every": K, "keep": 2};
           the model is built for the layout `ucp.elastic.layout` chooses (as tests/support/train_megatron_elastic.py
           does), a spare waits in `ucp.elastic.spare_loop`; batches from `ElasticBatchSampler` through
           `engine.train_batch(data_iter)`. Rank 0 appends a JSON line per step (time, world, layout, loss, the
           slowest rank's save stall at a save step: ucp's snapshot) and one per restart (`engine.ucp_restart`).
    stock: exactly --tp x --pp (DP: the ranks left), the batch keys of that DP; engine.save_checkpoint every K steps
           (its stall recorded); --load-universal DIR loads ds_to_universal's output with {"checkpoint":
           {"load_universal": true}}, timed, and trains one step.

Shapes (`--model`): "100m" is hidden 768, 12 query / 4 KV heads of 64, SwiGLU FFN 2048, vocabulary 32000 (the
word embedding tied to the output head, as the test model's), 12 layers, sequences of 64: 100.2M parameters
(`params`). "16m" (quick check runs) is the ~20M Llama's shape of benchmarks/_train_llama.py: vocabulary 8000,
hidden 512, 8 / 4 heads, FFN 1376, 4 layers: 15.7M (its head is tied).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests" / "support")]
from _elastic_llama import SEED, Tokens, append, job_arguments, slowest  # noqa: E402

SHAPES = {"100m": {"vocab": 32000, "hidden": 768, "heads": 12, "kv_heads": 4, "ffn": 2048, "seq": 64, "layers": 12},
          "16m": {"vocab": 8000, "hidden": 512, "heads": 8, "kv_heads": 4, "ffn": 1376, "seq": 64, "layers": 4}}


def params(shape: dict) -> int:
    """The model's parameters at `shape`, counted once (the tied word embedding once, the head adds none)."""
    h, kv = shape["hidden"], shape["kv_heads"] * shape["hidden"] // shape["heads"]
    layer = ((h + 2 * kv) * h + h * h + h          # fused QKV; dense + bias
             + 2 * shape["ffn"] * h + shape["ffn"] * h + h   # SwiGLU gate/up; dense_4h_to_h + bias
             + 4 * h + h)                           # two layernorms; mlp.input_scale
    return shape["vocab"] * h + shape["seq"] * h + shape["layers"] * layer + 2 * h


class Pairs(Tokens):
    """The benchmark's token sequences as the pipeline takes them: (tokens, next tokens), within `vocab`."""

    def __init__(self, vocab: int):
        super().__init__()
        self.ids %= vocab

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = super().__getitem__(i)
        return ids, ids.roll(-1)


def hf_shape(gpt) -> dict:
    """The model's shape as `ucp plan --model` reads a config.json, for the elastic layout's cost model."""
    return {"model_type": "llama", "hidden_size": gpt.HIDDEN, "intermediate_size": gpt.FFN,
            "num_hidden_layers": gpt.LAYERS, "num_attention_heads": gpt.HEADS, "num_key_value_heads": gpt.KV_HEADS,
            "vocab_size": gpt.VOCAB}


def main() -> None:
    p = job_arguments(global_batch=8)
    p.add_argument("--model", choices=sorted(SHAPES), default="100m")
    p.add_argument("--tp", type=int, default=2, help="stock: the tensor-parallel size")
    p.add_argument("--pp", type=int, default=2, help="stock: the pipeline-parallel size")
    p.add_argument("--load-universal", help="stock: DeepSpeed's universal checkpoint folder (its tag) to load")
    args = p.parse_args()

    import deepspeed
    import torch.distributed as dist

    import train_megatron as gpt
    import ucp.deepspeed
    import ucp.elastic
    from ucp.deepspeed.life import saver_for

    ucp.elastic.init_distributed("gloo")
    gpt.use_shape(**SHAPES[args.model])
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
              # Buckets of 10M elements: the default (5e8) costs GBs per rank, four ranks on a small machine.
              "zero_optimization": {"stage": 1, "reduce_bucket_size": 10 ** 7, "allgather_bucket_size": 10 ** 7},
              "steps_per_print": 10 ** 9}
    world = dist.get_world_size()
    if args.mode == "ucp":
        shape = f"{args.records}.shape.json"
        if dist.get_rank() == 0:
            Path(shape + ".partial").write_text(json.dumps(hf_shape(gpt)))
            os.replace(shape + ".partial", shape)
        dist.barrier()
        config["ucp"] = {"load": "auto", "save": {"dir": args.save_dir, "every": args.every, "keep": 2},
                         "elastic": {"global_batch": args.global_batch, "micro_batch": 1, "tensor_parallel": [2, 1],
                                     "pipeline_parallel": [2, 1], "model": shape, "seq_len": gpt.SEQ}}
        place = ucp.elastic.layout(config)
        ucp.elastic.spare_loop()   # a spare waits here for the next restart
        tp, pp, dp = place.tp, place.pp, place.dp
    else:
        tp, pp, dp = args.tp, args.pp, world // (args.tp * args.pp)
        config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=args.global_batch // dp)
        if args.load_universal:
            config["checkpoint"] = {"load_universal": True}
    deepspeed.init_distributed("gloo")   # PipelineModule asks DeepSpeed's comm for ranks: the training group
    gpt.use_layout(tp, pp, sync_scale=True)
    model = gpt.build()
    called = time.time()
    engine, *_ = ucp.deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=config)
    rank = dist.get_rank()
    if args.load_universal:
        dist.barrier()
        began = time.perf_counter()
        folder = Path(args.load_universal)
        engine.load_checkpoint(str(folder.parent), tag=folder.name)
        dist.barrier()
        if rank == 0:
            append(args.records, {"load_universal_s": time.perf_counter() - began, "world": world})
    dataset = Pairs(gpt.VOCAB)
    if args.mode == "ucp":
        sampler = ucp.elastic.ElasticBatchSampler(dataset, engine, seed=SEED)
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    else:
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=dp, rank=gpt.MPU.get_data_parallel_rank(),
                                                      seed=SEED)
        loader = torch.utils.data.DataLoader(dataset, batch_size=1, sampler=sampler)

    def micro_batches():
        while True:
            yield from loader

    data, reported = micro_batches(), False
    while engine.global_steps < args.steps:
        loss = float(engine.train_batch(data))   # ucp's save, when due, is taken inside train_batch
        record = {"step": engine.global_steps, "time": time.time(), "world": world, "tp": tp, "pp": pp, "dp": dp,
                  "loss": loss}
        if engine.global_steps % args.every == 0:
            if args.mode == "stock":
                began = time.perf_counter()
                engine.save_checkpoint(args.save_dir)
                record["save_stall_s"] = slowest(time.perf_counter() - began)
            else:
                record["save_stall_s"] = slowest(saver_for(engine).stats.snapshot_s)
        if rank == 0:
            append(args.records, record)
            restart = getattr(engine, "ucp_restart", None)
            if restart is not None and not reported:
                append(args.records, {"restart": asdict(restart), "initialize_called": called})
                reported = True
    ucp.deepspeed.wait(engine)


if __name__ == "__main__":
    import ucp.deepspeed

    main()
    ucp.deepspeed.finish()
