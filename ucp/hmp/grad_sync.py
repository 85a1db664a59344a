"""The gradient sync across replicas of unequal TP size, run: `GradSync` (the plan is `ucp.hmp.sync_plan`).

    sync = GradSync(layout, table, dict(module.named_parameters()), samples=shares)  # every rank, once
    for step in ...:
        loss = mean loss over this replica's shares[replica] samples
        loss.backward()
        sync()              # every rank's gradients: the mean over the step's global batch
        optimizer.step(); optimizer.zero_grad()

Its process groups are created once, by every rank in the same order (torch.distributed's rule);
each call is one all-reduce per group this rank is in, over one flat buffer of its pieces.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from ucp.errors import UnsupportedLayoutError
from ucp.hmp.layout import Layout, ParamSpec
from ucp.hmp.sync_plan import Bucket, Piece, rank_buckets, sync_groups


class GradSync:
    """Reduce every gradient of this rank's parameters across replicas by splits, weighted by samples."""

    def __init__(self, layout: Layout, table: Iterable[ParamSpec], params: Mapping[str, torch.nn.Parameter],
                 samples: Sequence[int]):
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

    def __call__(self) -> None:
        for bucket in self.buckets:
            views = [self._view(piece) for piece in bucket.pieces]
            flat = torch.cat([v.reshape(-1) * piece.weight for v, piece in zip(views, bucket.pieces)])
            dist.all_reduce(flat, group=self.groups[bucket.group])
            start = 0
            for view in views:
                view.copy_(flat[start:start + view.numel()].view_as(view))
                start += view.numel()

    def _view(self, piece: Piece) -> torch.Tensor:
        param = self.params[piece.name]
        if param.grad is None:  # a parameter this replica's loss did not reach still joins the sum, as zeros
            param.grad = torch.zeros_like(param)
        if piece.dim is None:
            return param.grad
        return param.grad.narrow(piece.dim, piece.lo, piece.hi - piece.lo)
