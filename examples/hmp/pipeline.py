"""The point-to-point links between the pipeline stages of one HMP replica, and one micro-batch through them.

Activations go from stage s to stage s+1: rank j of s+1 takes them from rank j % tp_s of s (after the
row-parallel reduce every rank of a stage holds the same activations). Their gradients go back: rank i of
s takes them from rank i % tp_{s+1} of s+1 (Megatron's copy operator makes the input gradient the same
on every rank of a stage). Each rank receives from one rank and sends to its receivers in rank order,
stage after stage, so the sends and receives of a replica form a chain without cycles: no deadlock.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ucp.hmp.layout import Layout


@dataclass(frozen=True)
class StageLinks:
    """Whom one rank receives from and sends to, forward (activations) and backward (their gradients)."""

    forward_from: int | None        # None on the first stage
    forward_to: tuple[int, ...]     # empty on the last stage
    backward_from: int | None       # None on the last stage
    backward_to: tuple[int, ...]    # empty on the first stage

    @classmethod
    def for_rank(cls, layout: Layout, rank: int) -> StageLinks:
        where = layout.placement(rank)
        stages = layout.replicas[where.replica].stages
        me, i = stages[where.stage], where.tp_rank
        before = stages[where.stage - 1] if where.stage > 0 else None
        after = stages[where.stage + 1] if where.stage + 1 < len(stages) else None
        return cls(forward_from=before.ranks[i % before.tp] if before else None,
                   forward_to=tuple(r for j, r in enumerate(after.ranks) if j % me.tp == i) if after else (),
                   backward_from=after.ranks[i % after.tp] if after else None,
                   backward_to=tuple(r for j, r in enumerate(before.ranks) if j % me.tp == i) if before else ())

    @property
    def last(self) -> bool:
        return self.backward_from is None


def forward_backward(links: StageLinks, stage: Callable[[torch.Tensor], torch.Tensor],
                     backward: Callable[[torch.Tensor, bool], None], tokens: torch.Tensor, hidden: int,
                     dtype: torch.dtype, loss_weight: float = 1.0) -> torch.Tensor | None:
    """One micro-batch of `tokens` through this rank's `stage`, forward then backward; the mean loss on the last
    stage, else None. `backward(x, is_loss)` runs the backward of `x`: the loss times `loss_weight` on the last
    stage, elsewhere a surrogate whose gradient is the one the next stage sent (no further scaling)."""
    inputs = tokens[:, :-1]
    if links.forward_from is not None:
        inputs = torch.empty(tuple(inputs.shape) + (hidden,), dtype=dtype, device=tokens.device)
        dist.recv(inputs, links.forward_from)
        inputs.requires_grad_()
    out = stage(inputs)
    for rank in links.forward_to:
        dist.send(out.detach().contiguous(), rank)
    loss = None
    if links.last:
        loss = F.cross_entropy(out.float().reshape(-1, out.shape[-1]), tokens[:, 1:].reshape(-1))  # mean
        backward(loss * loss_weight, True)
    else:
        grad = torch.empty_like(out)
        dist.recv(grad, links.backward_from)
        backward((out * grad).sum(), False)  # d/d(out) of the surrogate is `grad`
    for rank in links.backward_to:
        dist.send(inputs.grad.contiguous(), rank)
    return loss
