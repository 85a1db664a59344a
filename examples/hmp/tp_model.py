"""A small Megatron-style model that trains with any TP size per pipeline stage, any stages per replica.

Vocab-parallel embedding and LM head, and per layer LayerNorm → column-parallel `fc1` → GELU →
row-parallel `fc2` → residual, the layers of tests/support/reference_tp.py with Megatron's two
autograd-aware TP operators: `_copy` (identity forward, all-reduce of the gradient backward)
before a column-parallel layer and `_reduce` (all-reduce forward, identity backward) after a
row-parallel one. Each rank holds exactly the slices its layout gives it (`Layout.slice_of`),
named as the full model's parameters, so `ucp.hmp.grad_sync.GradSync` and ucp's loaders find them.

A rank holds its stage's part: the first stage the embedding, each stage its layers `[a, b)`, the last
the final norm and head. Between stages the activations travel point to point (`pipeline.StageLinks`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ucp.hmp.layout import Layout, ParamSpec


@dataclass(frozen=True)
class Config:
    vocab: int = 13     # odd: TP 2 cuts the vocabulary 6 + 7, so the sync meets uneven slices
    hidden: int = 16
    ffn: int = 32
    layers: int = 2


def param_table(cfg: Config) -> list[ParamSpec]:
    """Parameters, TP partition dims (column-parallel 0, row-parallel 1, whole on every TP rank None) and layers."""
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


def init_weights(cfg: Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """The full model's weights, the same on every rank (each then keeps its slices)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for spec in param_table(cfg):
        if spec.name.endswith("norm.weight"):
            out[spec.name] = torch.ones(spec.shape)
        elif spec.name.endswith("bias"):
            out[spec.name] = torch.zeros(spec.shape)
        else:
            out[spec.name] = torch.randn(spec.shape, generator=g) * spec.shape[-1] ** -0.5
    return out


class _Copy(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward (before a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward (after a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherVocab(torch.autograd.Function):
    """This rank's logit columns [lo, hi) into the full vocabulary; backward keeps the own columns' gradient."""

    @staticmethod
    def forward(ctx, local, lo, vocab, group):
        ctx.lo, ctx.hi = lo, lo + local.shape[-1]
        full = local.new_zeros(tuple(local.shape[:-1]) + (vocab,))
        full[..., ctx.lo:ctx.hi] = local
        dist.all_reduce(full, group=group)
        return full

    @staticmethod
    def backward(ctx, grad):
        return grad[..., ctx.lo:ctx.hi].contiguous(), None, None, None


class TPModel(torch.nn.Module):
    """One rank's slices of the model: those of its pipeline stage, cut for its stage's TP size."""

    def __init__(self, layout: Layout, rank: int, cfg: Config, group, weights: dict[str, torch.Tensor]):
        super().__init__()
        where = layout.placement(rank)
        stages = layout.replicas[where.replica].stages
        self.cfg, self.group, self.tp = cfg, group, where.tp_size
        self.layer_range = stages[where.stage].layers  # [a, b); "layers" is the submodule
        self.first, self.last = where.stage == 0, where.stage == len(stages) - 1
        self.ucp_param_table = param_table(cfg)  # the whole model's, for ucp.deepspeed
        self.boxes = {n: s.box for n, s in layout.rank_slices(rank, self.ucp_param_table).items()}
        for name, box in self.boxes.items():  # nested modules, so each parameter has the full model's name
            *path, leaf = name.split(".")
            owner: torch.nn.Module = self
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            param = torch.nn.Parameter(weights[name][tuple(slice(a, b) for a, b in box)].clone())
            # Megatron's mark of a TP-cut tensor: DeepSpeed counts the others in its norms on TP rank 0 only
            param.tensor_model_parallel = self.tp > 1 and tuple(box) != tuple((0, n) for n in weights[name].shape)
            owner.register_parameter(leaf, param)

    def named_slices(self) -> dict[str, torch.nn.Parameter]:
        """The parameters by the full model's names (what `GradSync` and the param table call them)."""
        return dict(self.named_parameters())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The first stage takes token ids, the others the previous stage's activations. The last stage returns
        the full vocabulary's logits, the others their activations; either is the same on every rank of the TP group."""
        w = self.named_slices()
        x = self._embed(inputs, w) if self.first else inputs
        for i in range(*self.layer_range):
            p = f"layers.{i}."
            h = self._copy(F.layer_norm(x, (self.cfg.hidden,), w[p + "norm.weight"], w[p + "norm.bias"]))
            a = F.gelu(F.linear(h, w[p + "fc1.weight"], w[p + "fc1.bias"]))
            x = x + self._reduce(F.linear(a, w[p + "fc2.weight"])) + w[p + "fc2.bias"]
        if not self.last:
            return x
        x = self._copy(F.layer_norm(x, (self.cfg.hidden,), w["norm.weight"], w["norm.bias"]))
        local = F.linear(x, w["head.weight"])
        if self.tp == 1:
            return local
        return _GatherVocab.apply(local, self.boxes["head.weight"][0][0], self.cfg.vocab, self.group)

    def _embed(self, tokens: torch.Tensor, w: dict[str, torch.nn.Parameter]) -> torch.Tensor:
        lo, hi = self.boxes["embed.weight"][0]
        mine = ((tokens >= lo) & (tokens < hi)).unsqueeze(-1)
        return self._reduce(w["embed.weight"][(tokens - lo).clamp(0, hi - lo - 1)] * mine)

    def _copy(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp == 1 else _Copy.apply(x, self.group)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.tp == 1 else _Reduce.apply(x, self.group)
