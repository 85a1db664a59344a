"""The gradient sync across replicas of unequal TP size, run: `GradSync` (the plan is `ucp.hmp.sync_plan`).

    sync = GradSync(layout, table, dict(module.named_parameters()), samples=shares)  # every rank, once
    for step in ...:
        loss = mean loss over this replica's shares[replica] samples
        loss.backward()
        sync()              # every rank's gradients: the mean over the step's global batch
        optimizer.step(); optimizer.zero_grad()

Its process groups are created once, by every rank in the same order (torch.distributed's rule);
each call starts all its all-reduces at once: large pieces in place, the others of a group in one flat buffer.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from ucp.errors import UnsupportedLayoutError
from ucp.hmp.layout import Layout, ParamSpec
from ucp.hmp.sync_plan import Bucket, Piece, rank_buckets, sync_groups

IN_PLACE_ELEMENTS = 1 << 18  # default: pieces at least this large (1 MiB of fp32) are reduced without a copy


class GradSync:
    """Reduce every gradient of this rank's parameters across replicas by splits, weighted by samples."""

    def __init__(self, layout: Layout, table: Iterable[ParamSpec], params: Mapping[str, torch.nn.Parameter],
                 samples: Sequence[int], in_place_elements: int = IN_PLACE_ELEMENTS):
        self.in_place_elements = in_place_elements
        self.layout, self.table = layout, list(table)
        self.rank = dist.get_rank()
        # dist.new_group must be called by every rank for every group, in the same order.
        self.groups = {group: dist.new_group(list(group)) for group in sync_groups(layout, self.table)}
        mine = {spec.name for spec in self.table if layout.slice_of(self.rank, spec) is not None}
        missing = sorted(mine - set(params))
        if missing:
            raise UnsupportedLayoutError(f"{missing[0]}: the layout gives rank {self.rank} a slice of it, but the "
                                         "module has no such parameter; build the module for this layout and table")
        self.params = dict(params)
        self.buckets: tuple[Bucket, ...] = ()
        self.set_samples(samples)

    def set_samples(self, samples: Sequence[int]) -> None:
        """New per-replica sample counts (weights); the groups stay as they are."""
        self.buckets = rank_buckets(self.layout, self.table, self.rank, samples)

    def __call__(self, grads: Mapping[str, torch.Tensor] | None = None) -> None:
        """Reduce the parameters' `.grad` in place, or with `grads` (by name, each of its parameter's shape:
        the gradient an optimizer wrapper steps on, e.g. DeepSpeed's fp32 copy) those tensors instead."""
        # Every group's all-reduces are started before any is waited on: a rank in several groups (the TP=1
        # rank beside a TP=2 replica) reduces in all of them at once. Large pieces cut along dim 0 (or whole)
        # are reduced in place, without copies; the rest of a group's pieces share one flat buffer. The choice
        # depends on the plan alone, so every member issues the same all-reduces in the same order.
        started = []
        for bucket in self.buckets:
            group = self.groups[bucket.group]
            packed = []
            for piece in bucket.pieces:
                view = self._view(piece, grads)
                view.mul_(piece.weight)
                if self._in_place(piece, view):
                    buffer = view if view.is_contiguous() else view.contiguous()
                    started.append(([view], buffer, dist.all_reduce(buffer, group=group, async_op=True)))
                else:
                    packed.append(view)
            if packed:
                flat = torch.cat([v.reshape(-1) for v in packed])
                started.append((packed, flat, dist.all_reduce(flat, group=group, async_op=True)))
        for views, buffer, work in started:
            work.wait()
            if len(views) == 1 and views[0] is buffer:
                continue
            start = 0
            for view in views:
                view.copy_(buffer.reshape(-1)[start:start + view.numel()].view_as(view))
                start += view.numel()

    def _in_place(self, piece: Piece, view: torch.Tensor) -> bool:
        """Whether `piece` is reduced in place: whole or cut along dim 0 (contiguous on every member), and large."""
        return (piece.dim is None or piece.dim == 0) and view.numel() >= self.in_place_elements

    def _view(self, piece: Piece, grads: Mapping[str, torch.Tensor] | None) -> torch.Tensor:
        if grads is not None:
            grad = grads[piece.name]
        else:
            param = self.params[piece.name]
            if param.grad is None:  # a parameter this replica's loss did not reach still joins the sum, as zeros
                param.grad = torch.zeros_like(param)
            grad = param.grad
        if piece.dim is None:
            return grad
        return grad.narrow(piece.dim, piece.lo, piece.hi - piece.lo)
