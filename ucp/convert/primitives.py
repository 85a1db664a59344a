"""The three primitives of Universal Checkpointing, as pure functions on tensors.

Extract is the read of a fragment's bytes from a rank file (`ucp.convert.assemble.read_fragment`);
here are Union, which merges the fragments of one state of one parameter according to its pattern,
and StripPad, which drops ZeRO alignment and vocabulary padding. Nothing here touches the disk.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from ucp.errors import UcpError
from ucp.patterns.types import Pattern, PatternSpec


class ReplicaMismatchError(UcpError):
    """Copies of a replicated parameter differ (only checked with --strict)."""


def union(spec: PatternSpec, pieces: Sequence, *, strict: bool = False, name: str = "?") -> torch.Tensor:
    """Merge the pieces of one state of one parameter, ordered by rank, by `spec`'s pattern.

    The result may still carry padding; `strip_pad` removes it. For SHARD_HY, and for any other
    pattern whose spec has an `inner` pattern (a pipeline-replicated copy that ZeRO partitioned,
    say), `pieces` is a sequence (one per outer piece) of sequences of inner pieces.
    """
    if not pieces:
        raise ValueError(f"{name}: no fragments to merge")
    pattern = spec.pattern
    if spec.inner is not None and pattern is not Pattern.SHARD_HY:
        outer = dataclasses.replace(spec, inner=None, shard_shapes=None)
        return union(outer, _rebuild_shards(spec, pieces, strict, name), strict=strict, name=name)
    if pattern is Pattern.UNIQUE:
        if len(pieces) != 1:
            raise ValueError(f"{name}: a unique parameter has exactly one fragment, got {len(pieces)}")
        return pieces[0]
    if pattern is Pattern.REPLICATE:
        if strict:
            for rank, other in enumerate(pieces[1:], start=1):
                if not _same_copy(pieces[0], other):
                    raise ReplicaMismatchError(
                        f"{name}: the copy on rank {rank} differs from rank 0's; the replicas diverged "
                        "during training. Drop --strict to take rank 0's copy.")
        return pieces[0]
    if pattern is Pattern.PARTIAL:
        # Same order of operations as DeepSpeed's `sum(slices) / len(slices)`, so results agree bit for bit.
        total = 0 + pieces[0]  # sum() starts from 0: 0 + (-0.0) is +0.0, which clone() would not give
        for piece in pieces[1:]:
            total += piece
        return total / len(pieces)
    if pattern in (Pattern.SHARD_V, Pattern.SHARD_H):
        return torch.cat(list(pieces), dim=0 if spec.flat else _dim(spec, name))
    if pattern is Pattern.SHARD_NC:
        return _union_non_contiguous(spec, pieces, name)
    if pattern is Pattern.SHARD_HY:
        return _union_hybrid(spec, pieces, strict, name)
    raise ValueError(f"{name}: unknown pattern {pattern}")


def strip_pad(tensor: torch.Tensor, spec: PatternSpec) -> torch.Tensor:
    """Cut `tensor` back to `spec.shape`: flat pieces lose their tail, dim shards their padded rows."""
    if spec.flat or (tensor.dim() == 1 and len(spec.shape) != 1):
        flat = tensor.reshape(-1)
        if flat.numel() < spec.numel:
            raise ValueError(f"{flat.numel()} elements cannot fill shape {spec.shape}")
        return flat.narrow(0, 0, spec.numel).reshape(spec.shape).contiguous()
    out = tensor
    for dim, want in enumerate(spec.shape):
        if out.shape[dim] < want:
            raise ValueError(f"dim {dim} has {out.shape[dim]} entries, shape {spec.shape} needs {want}")
        if out.shape[dim] > want:
            out = out.narrow(dim, 0, want)
    return out.contiguous()


def _same_copy(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, except that NaNs in the same places match (identical copies of a NaN are the same copy)."""
    if torch.equal(a, b):
        return True
    if a.shape != b.shape or a.dtype != b.dtype or not a.is_floating_point():
        return False
    nan_a, nan_b = a.isnan(), b.isnan()
    return torch.equal(nan_a, nan_b) and torch.equal(a.masked_fill(nan_a, 0), b.masked_fill(nan_b, 0))


def _dim(spec: PatternSpec, name: str) -> int:
    if spec.dim is None:
        raise ValueError(f"{name}: {spec.pattern.value} needs a dim")
    return spec.dim


def _union_non_contiguous(spec: PatternSpec, pieces: Sequence[torch.Tensor], name: str) -> torch.Tensor:
    dim = _dim(spec, name)
    if spec.sub_widths is None:
        raise ValueError(f"{name}: shard_nc needs the sub-parameter widths")
    cursor = [0] * len(pieces)
    merged = []
    for widths in spec.sub_widths:
        if len(widths) != len(pieces):
            raise ValueError(f"{name}: {len(widths)} widths for {len(pieces)} ranks")
        blocks = []
        for rank, (piece, width) in enumerate(zip(pieces, widths)):
            blocks.append(piece.narrow(dim, cursor[rank], width))
            cursor[rank] += width
        merged.append(torch.cat(blocks, dim=dim))
    for rank, piece in enumerate(pieces):
        if cursor[rank] != piece.shape[dim]:
            raise ValueError(f"{name}: rank {rank} holds {piece.shape[dim]} along dim {dim}, "
                             f"its widths cover {cursor[rank]}")
    return torch.cat(merged, dim=dim)


def _union_hybrid(spec: PatternSpec, pieces: Sequence, strict: bool, name: str) -> torch.Tensor:
    if spec.inner is None or spec.shard_shapes is None:
        raise ValueError(f"{name}: shard_hy needs an inner pattern and the outer shard shapes")
    shards = _rebuild_shards(spec, pieces, strict, name)
    outer = PatternSpec(Pattern.SHARD_V if _dim(spec, name) == 0 else Pattern.SHARD_H, spec.shape, dim=spec.dim)
    return union(outer, shards, strict=strict, name=name)


def _rebuild_shards(spec: PatternSpec, pieces: Sequence, strict: bool, name: str) -> list[torch.Tensor]:
    """Each outer piece, rebuilt from its inner pieces by `spec.inner` at its own shape."""
    if spec.inner is None or spec.shard_shapes is None:
        raise ValueError(f"{name}: a nested {spec.pattern.value} needs an inner pattern and the outer shard shapes")
    if len(spec.shard_shapes) != len(pieces):
        raise ValueError(f"{name}: {len(spec.shard_shapes)} shard shapes for {len(pieces)} shards")
    shards = []
    for shard_shape, inner_pieces in zip(spec.shard_shapes, pieces):
        inner = dataclasses.replace(spec.inner, shape=tuple(shard_shape))
        shards.append(strip_pad(union(inner, inner_pieces, strict=strict, name=name), inner))
    return shards
