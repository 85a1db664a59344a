"""The three primitives of Universal Checkpointing, as pure functions on tensors.

Extract is the read of a fragment's bytes from a rank file (`ucp.plan.assemble.read_fragment`);
here are Union, which merges the fragments of one state of one parameter according to its pattern,
and StripPad, which drops ZeRO alignment and vocabulary padding. Nothing here touches the disk.

They take torch tensors (the load hook, the Ray backend) or numpy arrays (conversion, which imports no
torch), and give back the same kind. A numpy bfloat16 array is held as its raw words (`ucp.format.dtypes`);
the two steps that compute on values (PARTIAL's mean, --strict's replica check) are told the dtype.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

import numpy as np

from ucp.errors import UcpError
from ucp.format.dtypes import FLOATS, as_values, from_values
from ucp.patterns.types import Pattern, PatternSpec

if TYPE_CHECKING:
    import torch

Array = Union["torch.Tensor", np.ndarray]


class ReplicaMismatchError(UcpError):
    """Copies of a replicated parameter differ (only checked with --strict)."""


def union(spec: PatternSpec, pieces: Sequence, *, strict: bool = False, name: str = "?",
          dtype: str | None = None) -> Array:
    """Merge the pieces of one state of one parameter, ordered by rank, by `spec`'s pattern.

    The result may still carry padding; `strip_pad` removes it. For SHARD_HY, and for any other
    pattern whose spec has an `inner` pattern (a pipeline-replicated copy that ZeRO partitioned,
    say), `pieces` is a sequence (one per outer piece) of sequences of inner pieces. `dtype` names
    the dtype of numpy pieces (needed for bfloat16, which numpy holds as raw words).
    """
    if not pieces:
        raise ValueError(f"{name}: no fragments to merge")
    pattern = spec.pattern
    if spec.inner is not None and pattern is not Pattern.SHARD_HY:
        outer = dataclasses.replace(spec, inner=None, shard_shapes=None)
        return union(outer, _rebuild_shards(spec, pieces, strict, name, dtype), strict=strict, name=name, dtype=dtype)
    if pattern is Pattern.UNIQUE:
        if len(pieces) != 1:
            raise ValueError(f"{name}: a unique parameter has exactly one fragment, got {len(pieces)}")
        return pieces[0]
    if pattern is Pattern.REPLICATE:
        if strict:
            for rank, other in enumerate(pieces[1:], start=1):
                if not _same_copy(pieces[0], other, dtype):
                    raise ReplicaMismatchError(
                        f"{name}: the copy on rank {rank} differs from rank 0's; the replicas diverged "
                        "during training. Drop --strict to take rank 0's copy.")
        return pieces[0]
    if pattern is Pattern.PARTIAL:
        return _mean(pieces, dtype)
    if pattern in (Pattern.SHARD_V, Pattern.SHARD_H):
        return _cat(pieces, 0 if spec.flat else _dim(spec, name))
    if pattern is Pattern.SHARD_NC:
        return _union_non_contiguous(spec, pieces, name)
    if pattern is Pattern.SHARD_HY:
        return _union_hybrid(spec, pieces, strict, name, dtype)
    raise ValueError(f"{name}: unknown pattern {pattern}")


def strip_pad(tensor: Array, spec: PatternSpec) -> Array:
    """Cut `tensor` back to `spec.shape`: flat pieces lose their tail, dim shards their padded rows."""
    if spec.flat or (tensor.ndim == 1 and len(spec.shape) != 1):
        flat = tensor.reshape(-1)
        if flat.shape[0] < spec.numel:
            raise ValueError(f"{flat.shape[0]} elements cannot fill shape {spec.shape}")
        return _contiguous(flat[:spec.numel].reshape(spec.shape))
    out = tensor
    for dim, want in enumerate(spec.shape):
        if out.shape[dim] < want:
            raise ValueError(f"dim {dim} has {out.shape[dim]} entries, shape {spec.shape} needs {want}")
        if out.shape[dim] > want:
            out = _narrow(out, dim, 0, want)
    return _contiguous(out)


def _torch():
    import torch

    return torch


def _narrow(x: Array, dim: int, start: int, length: int) -> Array:
    return x[(slice(None),) * dim + (slice(start, start + length),)]


def _cat(pieces: Sequence[Array], dim: int) -> Array:
    if isinstance(pieces[0], np.ndarray):
        return np.concatenate(list(pieces), axis=dim)
    return _torch().cat(list(pieces), dim=dim)


def _contiguous(x: Array) -> Array:
    return np.require(x, requirements="C") if isinstance(x, np.ndarray) else x.contiguous()  # keeps 0-d 0-d


def _mean(pieces: Sequence[Array], dtype: str | None) -> Array:
    """DeepSpeed's `sum(slices) / len(slices)`, in the same order of operations, so results agree bit for bit."""
    with np.errstate(all="ignore"):  # numpy warns of overflow and NaN where torch computes quietly
        if isinstance(pieces[0], np.ndarray) and dtype == "bfloat16":
            words = typing.cast("Sequence[np.ndarray]", pieces)  # the pieces are all of one kind
            # torch computes each bfloat16 operation in float32 and rounds the result back: so do we
            running = from_values(0 + as_values(words[0], dtype), dtype)
            for word in words[1:]:
                running = from_values(as_values(running, dtype) + as_values(word, dtype), dtype)
            return from_values(as_values(running, dtype) / np.float32(len(words)), dtype)
        total: Array = 0 + pieces[0]  # sum() starts from 0: 0 + (-0.0) is +0.0, which a copy would not give
        for piece in pieces[1:]:
            total += piece
        return total / len(pieces)


def _same_copy(a: Array, b: Array, dtype: str | None = None) -> bool:
    """torch.equal, except that NaNs in the same places match (identical copies of a NaN are the same copy)."""
    if isinstance(a, np.ndarray):
        x, y = as_values(a, dtype or ""), as_values(typing.cast(np.ndarray, b), dtype or "")  # both of one kind
        floating = np.issubdtype(x.dtype, np.floating) and (dtype is None or dtype in FLOATS)
        return x.shape == y.shape and np.array_equal(x, y, equal_nan=floating)
    b = typing.cast("torch.Tensor", b)
    torch = _torch()
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


def _union_non_contiguous(spec: PatternSpec, pieces: Sequence[Array], name: str) -> Array:
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
            blocks.append(_narrow(piece, dim, cursor[rank], width))
            cursor[rank] += width
        merged.append(_cat(blocks, dim))
    for rank, piece in enumerate(pieces):
        if cursor[rank] != piece.shape[dim]:
            raise ValueError(f"{name}: rank {rank} holds {piece.shape[dim]} along dim {dim}, "
                             f"its widths cover {cursor[rank]}")
    return _cat(merged, dim)


def _union_hybrid(spec: PatternSpec, pieces: Sequence, strict: bool, name: str, dtype: str | None) -> Array:
    if spec.inner is None or spec.shard_shapes is None:
        raise ValueError(f"{name}: shard_hy needs an inner pattern and the outer shard shapes")
    shards = _rebuild_shards(spec, pieces, strict, name, dtype)
    outer = PatternSpec(Pattern.SHARD_V if _dim(spec, name) == 0 else Pattern.SHARD_H, spec.shape, dim=spec.dim)
    return union(outer, shards, strict=strict, name=name, dtype=dtype)


def _rebuild_shards(spec: PatternSpec, pieces: Sequence, strict: bool, name: str, dtype: str | None) -> list[Array]:
    """Each outer piece, rebuilt from its inner pieces by `spec.inner` at its own shape."""
    if spec.inner is None or spec.shard_shapes is None:
        raise ValueError(f"{name}: a nested {spec.pattern.value} needs an inner pattern and the outer shard shapes")
    if len(spec.shard_shapes) != len(pieces):
        raise ValueError(f"{name}: {len(spec.shard_shapes)} shard shapes for {len(pieces)} shards")
    shards = []
    for shard_shape, inner_pieces in zip(spec.shard_shapes, pieces):
        inner = dataclasses.replace(spec.inner, shape=tuple(shard_shape))
        shards.append(strip_pad(union(inner, inner_pieces, strict=strict, name=name, dtype=dtype), inner))
    return shards
