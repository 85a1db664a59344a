"""The demo's training job: a tiny language model under DeepSpeed on CPU ranks (run by torchrun)."""
from __future__ import annotations

import argparse
import json

import torch

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 ranks: every layout sees the same global batches


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 101, dim: int = 48, layers: int = 2):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(dim), torch.nn.Linear(dim, 3 * dim), torch.nn.GELU(),
                                torch.nn.Linear(3 * dim, dim)) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens[:, :-1])
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(self.norm(h)).float()
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def batch(step: int, rank: int, world: int, seq: int = 16) -> torch.Tensor:
    """The same global batch for a given step whatever the data-parallel degree."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 101, (GLOBAL_BATCH, seq), generator=g)
    per_rank = GLOBAL_BATCH // world
    return tokens[rank * per_rank:(rank + 1) * per_rank]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--save-dir", help="save a DeepSpeed checkpoint here after --steps steps")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--more-steps", type=int, default=0, help="steps to train after saving (the reference)")
    parser.add_argument("--stage", type=int, default=2)
    parser.add_argument("--ucp-load", help="resume from this ucp checkpoint through ucp.deepspeed")
    parser.add_argument("--losses-out")
    args = parser.parse_args()

    import deepspeed
    import torch.distributed as dist

    import ucp.deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = TinyLM()
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
    config = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // world, "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 3, "warmup_max_lr": 3e-3}},
        "zero_optimization": {"stage": args.stage}, "steps_per_print": 10 ** 9,
    }
    if args.ucp_load:
        config["ucp"] = {"load": args.ucp_load}
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    engine, _, _, _ = ucp.deepspeed.initialize(model=model, model_parameters=groups, config=config)
    if args.ucp_load and rank == 0:
        stats = engine.ucp_load_stats
        print(f"  resumed at step {engine.global_steps} on {world} ranks (ZeRO-{args.stage}); this rank read "
              f"{stats.bytes_read} bytes in {stats.read_calls} reads, layer by layer ({stats.layers} layers)",
              flush=True)
    losses = []

    def train(steps: int) -> None:
        for _ in range(steps):
            step = engine.global_steps
            loss = engine(batch(step, rank, world))
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / world)
            if rank == 0:
                print(f"  step {step + 1}: loss {losses[-1]:.6f}", flush=True)

    train(args.steps)
    if args.save_dir:
        engine.save_checkpoint(args.save_dir, client_state={"demo": True})
        train(args.more_steps)
    if rank == 0 and args.losses_out:
        with open(args.losses_out, "w") as f:
            json.dump(losses, f)


if __name__ == "__main__":
    import ucp.deepspeed

    main()
    ucp.deepspeed.finish()  # exit 0 every time: no gloo thread outlives the interpreter (docs/RELIABILITY.md)
