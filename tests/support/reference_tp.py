"""A small Megatron-style model that runs under any layout, heterogeneous ones included (CPU, gloo).

Vocab-parallel embedding and LM head, and per layer LayerNorm → column-parallel `fc1` → GELU →
row-parallel `fc2` → residual. Each rank builds its stage from `ucp.hmp.load_slices`, so it holds
exactly its slices; replicas of one layout may differ in TP sizes and pipeline stages. It exists
to show, and test, that a checkpoint loads into such layouts with the right numbers: every
replica's forward pass must equal `full_forward` on the unsharded weights.

    groups = tp_groups(layout)                  # every rank, same order (torch.distributed rule)
    stage = Stage.load(layout, rank, "/ckpt/ucp", config)
    logits = stage.forward(tokens, groups)      # on each replica's last stage; None elsewhere

For training with DeepSpeed, `StageModule(layout, rank, config)` holds the rank's slices as
parameters (named as in the checkpoint, shaped as the slices) and its `ucp_param_table`, so
`ucp.deepspeed.initialize(..., config={"ucp": {"load": ..., "layout": layout.to_json()}})` fills
it; `Stage.of_module` runs it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ucp.hmp import load_slices
from ucp.hmp.layout import Layout, ParamSpec


@dataclass(frozen=True)
class RefConfig:
    vocab: int = 13
    hidden: int = 8
    ffn: int = 12
    layers: int = 4


def param_table(cfg: RefConfig) -> list[ParamSpec]:
    """Parameters, TP partition dims (column-parallel 0, row-parallel 1, replicated None) and layers."""
    table = [ParamSpec("embed.weight", (cfg.vocab, cfg.hidden), 0, -1)]
    for i in range(cfg.layers):
        p = f"layers.{i}."
        table += [ParamSpec(p + "norm.weight", (cfg.hidden,), None, i),
                  ParamSpec(p + "norm.bias", (cfg.hidden,), None, i),
                  ParamSpec(p + "fc1.weight", (cfg.ffn, cfg.hidden), 0, i),
                  ParamSpec(p + "fc1.bias", (cfg.ffn,), 0, i),
                  ParamSpec(p + "fc2.weight", (cfg.hidden, cfg.ffn), 1, i),
                  ParamSpec(p + "fc2.bias", (cfg.hidden,), None, i)]
    table += [ParamSpec("norm.weight", (cfg.hidden,), None, cfg.layers),
              ParamSpec("norm.bias", (cfg.hidden,), None, cfg.layers),
              ParamSpec("head.weight", (cfg.vocab, cfg.hidden), 0, cfg.layers)]
    return table


def init_weights(cfg: RefConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g) * 0.5 for s in param_table(cfg)}


def full_forward(weights: dict[str, torch.Tensor], cfg: RefConfig, tokens: torch.Tensor) -> torch.Tensor:
    """The unsharded model: logits for `tokens` (any shape), in the weights' dtype."""
    x = weights["embed.weight"][tokens]
    for i in range(cfg.layers):
        prefix = f"layers.{i}."
        x = x + _block(x, {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)})
    x = F.layer_norm(x, (cfg.hidden,), weights["norm.weight"], weights["norm.bias"])
    return x @ weights["head.weight"].T


def _block(x: torch.Tensor, w: dict[str, torch.Tensor], reduce=lambda t: t) -> torch.Tensor:
    h = F.layer_norm(x, x.shape[-1:], w["norm.weight"], w["norm.bias"])
    a = F.gelu(h @ w["fc1.weight"].T + w["fc1.bias"])          # column-parallel: this rank's ffn columns
    return reduce(a @ w["fc2.weight"].T) + w["fc2.bias"]     # row-parallel: partial sums, then all-reduce


def tp_groups(layout: Layout) -> dict[tuple[int, ...], object]:
    """A process group per TP group of the layout; every rank must call this, in the same order."""
    return {s.ranks: dist.new_group(list(s.ranks)) for r in layout.replicas for s in r.stages}


class Stage:
    """One rank's part of one replica's pipeline: its layers' slices, and how to run them."""

    def __init__(self, layout: Layout, rank: int, cfg: RefConfig, weights: dict[str, torch.Tensor],
                 boxes: dict[str, tuple]):
        self.layout, self.rank, self.cfg = layout, rank, cfg
        self.where = layout.placement(rank)
        self.replica = layout.replicas[self.where.replica]
        self.stage = self.replica.stages[self.where.stage]
        self.weights, self.boxes = weights, boxes

    @classmethod
    def of_module(cls, module: StageModule, dtype: torch.dtype = torch.float64) -> Stage:
        """The stage over a `StageModule`'s parameters (copied to `dtype`)."""
        weights = {n: p.detach().to(dtype) for n, p in module.named_parameters()}
        return cls(module.layout, module.rank, module.cfg, weights, module.boxes)

    @classmethod
    def load(cls, layout: Layout, rank: int, path: str | os.PathLike, cfg: RefConfig,
             dtype: torch.dtype = torch.float64) -> Stage:
        loaded = load_slices(layout, rank, path, param_table(cfg))
        weights = {n: s["fp32"].to(dtype) for n, s in loaded.tensors.items()}
        return cls(layout, rank, cfg, weights, {n: s.box for n, s in loaded.slices.items()})

    def forward(self, tokens: torch.Tensor, groups: dict) -> torch.Tensor | None:
        """Run this stage; returns the logits on the replica's last stage's first TP rank, else None."""
        group = groups[self.stage.ranks]
        j = self.where.stage
        dtype = next(iter(self.weights.values())).dtype
        if j == 0:
            x = self._embed(tokens, group)
        else:
            x = torch.empty(tuple(tokens.shape) + (self.cfg.hidden,), dtype=dtype)
            if self.rank == self.stage.ranks[0]:
                dist.recv(x, src=self.replica.stages[j - 1].ranks[0])
            self._broadcast(x, group)
        for i in range(*self.stage.layers):
            prefix = f"layers.{i}."
            w = {k.removeprefix(prefix): v for k, v in self.weights.items() if k.startswith(prefix)}
            x = x + _block(x, w, lambda t: self._all_reduce(t, group))
        if j + 1 < len(self.replica.stages):
            if self.rank == self.stage.ranks[0]:
                dist.send(x, dst=self.replica.stages[j + 1].ranks[0])
            return None
        x = F.layer_norm(x, (self.cfg.hidden,), self.weights["norm.weight"], self.weights["norm.bias"])
        lo, hi = self.boxes["head.weight"][0]
        logits = torch.zeros(tuple(x.shape[:-1]) + (self.cfg.vocab,), dtype=dtype)
        logits[..., lo:hi] = x @ self.weights["head.weight"].T   # vocab-parallel: this rank's columns
        logits = self._all_reduce(logits, group)
        return logits if self.rank == self.stage.ranks[0] else None

    def _embed(self, tokens: torch.Tensor, group) -> torch.Tensor:
        lo, hi = self.boxes["embed.weight"][0]
        mine = (tokens >= lo) & (tokens < hi)
        rows = self.weights["embed.weight"][(tokens - lo).clamp(0, max(hi - lo - 1, 0))] if hi > lo else \
            torch.zeros(tuple(tokens.shape) + (self.cfg.hidden,), dtype=self.weights["embed.weight"].dtype)
        return self._all_reduce(rows * mine.unsqueeze(-1), group)

    def _all_reduce(self, t: torch.Tensor, group) -> torch.Tensor:
        if self.stage.tp > 1:
            dist.all_reduce(t, group=group)
        return t

    def _broadcast(self, t: torch.Tensor, group) -> None:
        if self.stage.tp > 1:
            dist.broadcast(t, src=self.stage.ranks[0], group=group)


class StageModule(torch.nn.Module):
    """A rank's slices as `torch.nn.Parameter`s (zeros until loaded), named as the full model's parameters."""

    def __init__(self, layout: Layout, rank: int, cfg: RefConfig):
        super().__init__()
        self.layout, self.rank, self.cfg = layout, rank, cfg
        self.ucp_param_table = param_table(cfg)
        self.boxes = {n: s.box for n, s in layout.rank_slices(rank, self.ucp_param_table).items()}
        for name, box in self.boxes.items():
            *path, leaf = name.split(".")
            owner = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, torch.nn.Parameter(torch.zeros(tuple(b - a for a, b in box))))
