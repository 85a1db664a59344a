"""Elastic AutoTP training under torchrun: each start takes a tensor x data-parallel layout for the ranks it has.

Launch it as `train.py` (one agent per "node", README "Elastic training"):

    ucp-torchrun --nnodes=1:4 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29400 \\
        --rdzv-id=demo3d --max-restarts=10 --monitor-interval=1 --rdzv-conf=last_call_timeout=2 \\
        examples/elastic/torchrun/train_3d.py --save-dir /tmp/elastic3d --steps 40

A tiny Llama (no download) split by DeepSpeed's AutoTP. `"elastic": {"tensor_parallel": [2, 1]}` lets ucp pick
T=2 or T=1 at each start (`ucp.elastic.layout_choice`): on 4 ranks T=2 x D=2 (the cost model's choice for this model,
whose step is all gradient all-reduce), on 3 ranks T=1 x D=3 (all ranks used). With `--tp 2` (T=2 only), 3 ranks
train as T=2 x D=1 and the third is a spare that waits for the next restart (with `--memory-dir` on a node of its
own, holding a copy of every memory checkpoint). The global batch is the same at every layout, so the run's losses
do not depend on it. The lines that differ from a stock DeepSpeed loop say "ucp".
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

os.environ.setdefault("DS_ACCELERATOR", "cpu")   # CPU only

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import ucp.deepspeed  # noqa: E402
import ucp.elastic  # noqa: E402

VOCAB, SEQ = 37, 6


class Tokens(Dataset):
    """A fixed synthetic language-model task: 40 sequences of 6 tokens."""

    def __init__(self, n: int = 40):
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.ids[i]


def build_model() -> torch.nn.Module:
    """The same at every layout: AutoTP splits it inside deepspeed.initialize."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(99)   # no dropout: every draw of the run is in the data order and the initial weights
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        attn_implementation="eager"))


def deepspeed_config(args: argparse.Namespace, ucp_section: dict | None = None) -> dict:
    """`ucp_section`: the "ucp" section's load and save keys where a launcher gives them (Ray Train)."""
    elastic = {"global_batch": args.global_batch, "micro_batch": args.micro_batch,            # ucp
               "tensor_parallel": args.tp if args.tp else [2, 1], "seq_len": SEQ}              # ucp
    if getattr(args, "detect_s", None):
        elastic["detect_s"] = args.detect_s                                                     # ucp
    section = ucp_section or {"load": "auto", "save": {"dir": args.save_dir, "every": args.every, "keep": args.keep}}
    config = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
              "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9,
              "ucp": {**section, "elastic": elastic}}                                          # ucp
    if args.memory_dir:   # the host-memory tier: every step, each node's pieces on `--replicas` others    # ucp
        config["ucp"]["save"]["memory"] = {"every": 1, "replicas": args.replicas, "dir": args.memory_dir}  # ucp
    if args.stock:   # negative control: DeepSpeed's own checkpoints, ucp only for the batch and the layout
        config["ucp"] = {"elastic": elastic}
    return config


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--save-dir", required=True, help="where ucp saves, and resumes from after a restart")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps the run trains in all")
    p.add_argument("--global-batch", type=int, default=8, help="samples per optimizer step, at any layout")
    p.add_argument("--micro-batch", type=int, default=2, help="the most samples per forward pass")
    p.add_argument("--tp", type=int, help="the one tensor-parallel size allowed (default: 2 or 1)")
    p.add_argument("--every", type=int, default=1, help="save every this many optimizer steps")
    p.add_argument("--keep", type=int, default=2, help="committed checkpoints to keep")
    p.add_argument("--memory-dir", help="keep a memory checkpoint every step here too ($VARS expand on each node)")
    p.add_argument("--replicas", type=int, default=1, help="with --memory-dir: other nodes that keep a copy")
    p.add_argument("--losses-out", help="append each step's loss here (JSON lines, rank 0)")
    p.add_argument("--stock", action="store_true",
                   help="negative control: engine.save_checkpoint / load_checkpoint instead of ucp's")
    p.add_argument("--load-tag", help="with --stock: the DeepSpeed checkpoint to resume from (default: none)")
    p.add_argument("--in-process", action="store_true",
                   help="ucp.elastic.run: the survivors of a fault go on in the same processes, at a new layout")
    p.add_argument("--detect-s", type=float, help="with --in-process: seconds of silence before a rank is hung")
    return p


def main() -> None:
    args = parser().parse_args()
    if args.in_process:
        ucp.elastic.run(lambda: train(args), backend="gloo")   # CPU only                        # ucp
        return
    ucp.elastic.init_distributed("gloo")   # CPU only
    train(args)


def train(args: argparse.Namespace, ucp_section: dict | None = None,
          after_step: Callable[[object, float], None] = lambda engine, loss: None) -> None:
    """Train until `args.steps` optimizer steps, from wherever the save folder says the run is; `after_step(engine,
    mean loss)` on every rank after each optimizer step (Ray Train's report)."""
    config = deepspeed_config(args, ucp_section)
    model = build_model()
    place = ucp.elastic.layout(config, model)                                                  # ucp
    ucp.elastic.spare_loop()   # a spare waits here for the next restart                        # ucp
    engine, *_ = ucp.deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)  # ucp
    if args.stock and args.load_tag:
        engine.load_checkpoint(args.save_dir, tag=args.load_tag)
    dataset = Tokens()
    sampler = ucp.elastic.ElasticBatchSampler(dataset, engine, shuffle=True, seed=0)          # ucp
    loader = DataLoader(dataset, batch_sampler=sampler)
    while engine.global_steps < args.steps:
        summed = torch.zeros(1)   # this replica's loss summed over its samples of the step
        for ids in loader:
            loss = engine(input_ids=ids, labels=ids).loss   # mean over the micro-batch
            engine.backward(loss * sampler.loss_weight(len(ids)))                              # ucp
            summed += loss.detach() * len(ids)
            step = engine.global_steps
            engine.step()
            if engine.global_steps != step:
                after_step(engine, log(args, engine, place, summed))
                summed = torch.zeros(1)
                if args.stock:
                    engine.save_checkpoint(args.save_dir)
                if engine.global_steps >= args.steps:
                    break
    ucp.deepspeed.wait(engine)   # the last save is committed


def log(args: argparse.Namespace, engine, place, summed: torch.Tensor) -> float:
    """The step's mean loss over its global batch (every TP rank of a replica holds its replica's sum)."""
    dist.all_reduce(summed)
    loss = summed.item() / place.tp / args.global_batch
    if dist.get_rank() == 0 and args.losses_out:
        with open(args.losses_out, "a") as f:
            f.write(json.dumps({"step": engine.global_steps, "loss": loss, "world": place.world, "tp": place.tp,
                                "dp": place.dp, "pid": os.getpid()}) + "\n")
    return loss


if __name__ == "__main__":
    main()
    ucp.deepspeed.finish()   # exit 0 every time (docs/RELIABILITY.md, "Processes end with their exit code")
