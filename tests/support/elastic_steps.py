"""The pieces that the elastic support scripts share (train_megatron_elastic, train_moe_elastic): their common
flags, a dataset of fixed token sequences, an endless stream of micro-batches from an `ElasticBatchSampler`'s
loader, and one optimizer step of a plain module run through its gradient-accumulation micro-batches, with the
step's loss as a pipeline's `train_batch` reports it."""
from __future__ import annotations

import argparse
from collections.abc import Iterator

import torch
import torch.distributed as dist


def arguments() -> argparse.ArgumentParser:
    """The flags every elastic support script takes (a script adds its own)."""
    p = argparse.ArgumentParser()
    p.add_argument("--save-dir", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--every", type=int, default=1)
    p.add_argument("--losses-out", required=True)
    return p


class Tokens(torch.utils.data.Dataset):
    """`n` fixed sequences of `seq` tokens below `vocab` and their targets: the model learns
    targets = scale * tokens + shift mod the vocabulary."""

    def __init__(self, n: int, vocab: int, seq: int, scale: int, shift: int):
        self.tokens = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(7))
        self.vocab, self.scale, self.shift = vocab, scale, shift

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        return self.tokens[i], (self.tokens[i] * self.scale + self.shift) % self.vocab


def endless(loader) -> Iterator:
    """The loader's micro-batches, epoch after epoch (the sampler continues one global order)."""
    while True:
        yield from loader


def accumulated_step(engine, data: Iterator, dp_size: int, group=None) -> float:
    """One optimizer step: this rank's gradient-accumulation micro-batches through `engine(...)`,
    `engine.backward`, `engine.step`; their loss averaged over them and the `dp_size` data-parallel ranks of
    `group` (the default group: every training rank)."""
    total, count = torch.zeros(()), engine.gradient_accumulation_steps()
    for _ in range(count):
        tokens, targets = next(data)
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        total += loss.detach().float()
    total /= count * dp_size
    dist.all_reduce(total, group=group)
    return float(total)
