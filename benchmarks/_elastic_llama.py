#!/usr/bin/env python
"""One worker of benchmarks/elastic.py: the ~112M-parameter benchmark Llama trained elastically with ucp, or the
stock DeepSpeed path to a new world size, timed. Every rank runs this file (torchrun or its elastic agents).

    ucp:   "load": "auto", "save": {"every": K, "keep": 2}, "elastic": {"global_batch": B, "micro_batch": 1},
           ElasticBatchSampler; rank 0 appends a JSON line per step (time, world, loss) and one per restart
           (engine.ucp_restart) to --records.
    stock: deepspeed.initialize with the batch keys of this world size; --save-dir gets engine.save_checkpoint
           every K steps; --load-universal DIR loads DeepSpeed's universal checkpoint (ds_to_universal's output)
           with {"checkpoint": {"load_universal": true}}, timed, and trains one step.
    --tp T (trace T of benchmarks/elastic.py): DeepSpeed's AutoTP. ucp: "elastic": {"tensor_parallel": [T, 1]}, the
           model built after ucp.elastic.layout(); stock: {"tensor_parallel": {"autotp_size": T}}, the batch keys
           of D = world // T. Eager attention (as tests/support/train_llama_tp.py). The saves' stalls are recorded:
           ucp's snapshot (what training waits for), stock's engine.save_checkpoint call, the slowest rank's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _train_llama import MODEL, SEED, SEQ_LEN  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    """Random token sequences (no download), fixed by the seed."""

    def __init__(self, n: int = 4096):
        self.ids = torch.randint(0, MODEL["vocab_size"], (n, SEQ_LEN), generator=torch.Generator().manual_seed(SEED))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def lm_loss(engine, ids: torch.Tensor) -> torch.Tensor:
    logits = engine(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def slowest(seconds: float) -> float:
    """The largest of every rank's `seconds` (a collective)."""
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def job_arguments(global_batch: int) -> argparse.ArgumentParser:
    """The arguments every elastic benchmark worker takes (this one and `_elastic_megatron.py`)."""
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("ucp", "stock"), required=True)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=global_batch)
    p.add_argument("--records", required=True)
    return p


def main() -> None:
    p = job_arguments(global_batch=12)
    p.add_argument("--memory-every", type=int, help="ucp: the host-memory tier every K steps, one peer copy")
    p.add_argument("--memory-dir", help="ucp: each node's memory folder ($VARS expanded on each node)")
    p.add_argument("--load-universal", help="stock: DeepSpeed's universal checkpoint folder (its tag) to load")
    p.add_argument("--tp", type=int, help="AutoTP: the tensor-parallel size (ucp: [T, 1] allowed; stock: exactly T)")
    args = p.parse_args()

    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    import ucp.deepspeed
    import ucp.elastic
    from ucp.deepspeed.life import saver_for
    from ucp.elastic import ElasticBatchSampler

    called = time.time()
    ucp.elastic.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(LlamaConfig(**MODEL, **({"attn_implementation": "eager"} if args.tp else {})))
    config = {"zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    if args.mode == "ucp":
        config["ucp"] = {"load": "auto", "save": {"dir": args.save_dir, "every": args.every, "keep": 2},
                         "elastic": {"global_batch": args.global_batch, "micro_batch": 1}}
        if args.memory_every:
            config["ucp"]["save"]["memory"] = {"every": args.memory_every, "replicas": 1, "dir": args.memory_dir}
        if args.tp:
            config["ucp"]["elastic"].update(tensor_parallel=[args.tp, 1], seq_len=SEQ_LEN)
            place = ucp.elastic.layout(config, model)
            tp, dp_rank = place.tp, place.dp_rank
            ucp.elastic.spare_loop()
        else:
            tp, dp_rank = 1, rank
    else:
        tp = args.tp or 1
        dp_rank = rank // tp  # AutoTP's groups are runs of T consecutive ranks
        config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=args.global_batch // (world // tp))
        if args.tp:
            config["tensor_parallel"] = {"autotp_size": args.tp}
        if args.load_universal:
            config["checkpoint"] = {"load_universal": True}
    engine, *_ = ucp.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if args.load_universal:
        dist.barrier()
        began = time.perf_counter()
        folder = Path(args.load_universal)
        engine.load_checkpoint(str(folder.parent), tag=folder.name)
        dist.barrier()
        if rank == 0:
            append(args.records, {"load_universal_s": time.perf_counter() - began, "world": world,
                                  "startup_s": time.time() - called})
    dataset = Tokens()
    if args.mode == "ucp":
        sampler = ElasticBatchSampler(dataset, engine, seed=SEED)
        loader, weight = torch.utils.data.DataLoader(dataset, batch_sampler=sampler), sampler.loss_weight
    else:
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world // tp, rank=dp_rank, seed=SEED)
        loader, weight = torch.utils.data.DataLoader(dataset, batch_size=1, sampler=sampler), None
    reported = False
    while engine.global_steps < args.steps:
        for ids in loader:
            loss = lm_loss(engine, ids)
            engine.backward(loss * weight(len(ids)) if weight else loss)
            step = engine.global_steps
            engine.step()
            if engine.global_steps == step:
                continue
            record = {"step": engine.global_steps, "time": time.time(), "world": world, "tp": tp,
                      "loss": loss.item()}
            if args.mode == "stock" and engine.global_steps % args.every == 0:
                began = time.perf_counter()
                engine.save_checkpoint(args.save_dir)
                if args.tp:
                    record["save_stall_s"] = slowest(time.perf_counter() - began)
            elif args.tp and engine.global_steps % args.every == 0:  # ucp saved inside engine.step
                record["save_stall_s"] = slowest(saver_for(engine).stats.snapshot_s)
            if rank == 0:
                append(args.records, record)
                restart = getattr(engine, "ucp_restart", None)
                if restart is not None and not reported:
                    append(args.records, {"restart": asdict(restart), "initialize_called": called})
                    reported = True
            if engine.global_steps >= args.steps:
                break
    ucp.deepspeed.wait(engine)


if __name__ == "__main__":
    import ucp.deepspeed

    main()
    ucp.deepspeed.finish()
