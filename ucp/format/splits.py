"""Split-major storage: each tensor cut into `count` splits along its TP partition dim, stored split after split.

Split `i` of a dim of size `D` covers `[i*D//count, (i+1)*D//count)` (`ucp.format.boxes.split_bounds`)
and is stored as its own row-major block, so any run of consecutive splits is one contiguous byte
range, whatever the dim. Along dim 0 that is plain row-major order; along another dim the bytes
are reordered and the safetensors header gives the flat shape `[numel]`, so no reader takes them
for the logical tensor by accident. The index records `"splits": {"dim": d, "count": k}` per state
(docs/FORMAT.md); readers put the logical tensor back with `from_split_major`.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, overload

import numpy as np

from ucp.format.boxes import split_bounds

if TYPE_CHECKING:
    import torch

    from ucp.format.slice_read import SliceRead

@overload
def to_split_major(tensor: torch.Tensor, dim: int, count: int) -> torch.Tensor: ...


@overload
def to_split_major(tensor: np.ndarray, dim: int, count: int) -> np.ndarray: ...


def to_split_major(tensor: torch.Tensor | np.ndarray, dim: int, count: int) -> torch.Tensor | np.ndarray:
    """The elements of `tensor` (a torch tensor or numpy array) split after split along `dim` (flat when dim > 0)."""
    if dim == 0 or count == 1:
        return np.require(tensor, requirements="C") if isinstance(tensor, np.ndarray) else tensor.contiguous()
    bounds = split_bounds(tensor.shape[dim], count)
    cuts = [(slice(None),) * dim + (slice(a, b),) for a, b in zip(bounds, bounds[1:])]
    if isinstance(tensor, np.ndarray):
        return np.concatenate([tensor[cut].reshape(-1) for cut in cuts])
    import torch

    return torch.cat([tensor[cut].reshape(-1) for cut in cuts])


def join_splits(flat: torch.Tensor, shape: Sequence[int], dim: int, bounds: Sequence[int]) -> torch.Tensor:
    """Consecutive stored splits back into one tensor.

    `flat` holds the splits whose boundaries along `dim` are `bounds` (first to last), each a
    row-major block of the full `shape` except along `dim`; the result has `shape` with `dim`
    narrowed to `[bounds[0], bounds[-1])`.
    """
    import torch

    shape = list(shape)
    if dim == 0:
        return flat.reshape([bounds[-1] - bounds[0]] + shape[1:])
    pieces, offset = [], 0
    for a, b in zip(bounds, bounds[1:]):
        piece_shape = shape[:dim] + [b - a] + shape[dim + 1:]
        n = math.prod(piece_shape)
        pieces.append(flat[offset:offset + n].reshape(piece_shape))
        offset += n
    return torch.cat(pieces, dim)


def from_split_major(flat: torch.Tensor, shape: Sequence[int], dim: int, count: int) -> torch.Tensor:
    """The logical tensor of `shape` from its split-major elements."""
    return join_splits(flat.reshape(-1), shape, dim, split_bounds(shape[dim], count))


def box_of_read(flat: torch.Tensor, shape: Sequence[int], read: SliceRead, box_shape: tuple[int, ...]) -> torch.Tensor:
    """The elements one `ucp.format.slice_read.SliceRead` brought in (`flat`), as the box it was planned for."""
    if flat.numel() == 0:
        return flat.reshape(box_shape)
    if read.dim is None:
        tensor = flat.reshape(shape)
    else:
        tensor = join_splits(flat, shape, read.dim, read.bounds)
    for dim, start, length in read.narrow:
        tensor = tensor.narrow(dim, start, length)
    return tensor.clone() if read.narrow else tensor
