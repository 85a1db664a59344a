"""Split-major storage: each tensor cut into `count` splits along its TP partition dim, stored split after split.

Split `i` of a dim of size `D` covers `[i*D//count, (i+1)*D//count)` (`ucp.layout.split_bounds`)
and is stored as its own row-major block, so any run of consecutive splits is one contiguous byte
range, whatever the dim. Along dim 0 that is plain row-major order; along another dim the bytes
are reordered and the safetensors header gives the flat shape `[numel]`, so no reader takes them
for the logical tensor by accident. The index records `"splits": {"dim": d, "count": k}` per state
(docs/FORMAT.md); readers put the logical tensor back with `from_split_major`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ucp.errors import UcpError
from ucp.layout import split_bounds
from ucp.plan import ConversionPlan

if TYPE_CHECKING:
    import torch

# Megatron-style partition dims of Hugging Face Llama / Qwen2 / Mistral parameter names: column-parallel
# and vocab-parallel weights (and their biases) along dim 0, row-parallel weights along dim 1. First match wins;
# anything unmatched (norms, row-parallel biases, buffers) is stored whole.
HF_DECODER_RULES: tuple[tuple[str, int | None], ...] = (
    (r"(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", 0),
    (r"(o_proj|down_proj)\.weight$", 1),
    (r"(embed_tokens|lm_head)\.weight$", 0),
)


class SplitRuleError(UcpError):
    """A split rule is malformed or asks for a dim a tensor does not have."""


@dataclass(frozen=True)
class SplitPolicy:
    """How `ucp convert --splits K` cuts tensors: `global_split` splits along the dim the first matching rule names."""

    global_split: int
    rules: tuple[tuple[str, int | None], ...] = HF_DECODER_RULES

    def __post_init__(self) -> None:
        if self.global_split < 1:
            raise SplitRuleError(f"--splits {self.global_split}: the split count must be at least 1")
        for pattern, _ in self.rules:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise SplitRuleError(f"split rule '{pattern}': not a regular expression ({exc})") from None

    def dim_for(self, name: str, shape: Sequence[int]) -> int | None:
        for pattern, dim in self.rules:
            if re.search(pattern, name):
                if dim is not None and not 0 <= dim < len(shape):
                    raise SplitRuleError(f"{name}: split rule '{pattern}' names dim {dim}, the tensor has shape "
                                         f"{list(shape)}; fix the rule")
                return dim
        return None


def load_split_rules(path: str | os.PathLike) -> tuple[tuple[str, int | None], ...]:
    """Rules from a JSON object {"regex": dim or null, ...}, tried in file order."""
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise SplitRuleError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise SplitRuleError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or not all(v is None or isinstance(v, int) for v in data.values()):
        raise SplitRuleError(f'{path}: expected an object of regex to dim (or null), e.g. {{"l2\\\\.weight$": 1}}')
    return tuple(data.items())


def apply_split_policy(plan: ConversionPlan, policy: SplitPolicy) -> ConversionPlan:
    """The plan with each parameter's `splits` (dim, count) set where the policy cuts it."""
    params = []
    for p in plan.params:
        dim = policy.dim_for(p.name, p.shape) if policy.global_split > 1 else None
        params.append(dataclasses.replace(p, splits=(dim, policy.global_split)) if dim is not None else p)
    return dataclasses.replace(plan, params=params)


def to_split_major(tensor: torch.Tensor | np.ndarray, dim: int, count: int) -> torch.Tensor | np.ndarray:
    """The elements of `tensor` (a torch tensor or numpy array) split after split along `dim` (flat when dim > 0)."""
    numpy = isinstance(tensor, np.ndarray)
    if dim == 0 or count == 1:
        return np.require(tensor, requirements="C") if numpy else tensor.contiguous()
    bounds = split_bounds(tensor.shape[dim], count)
    splits = [tensor[(slice(None),) * dim + (slice(a, b),)].reshape(-1) for a, b in zip(bounds, bounds[1:])]
    if numpy:
        return np.concatenate(splits)
    import torch

    return torch.cat(splits)


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


def box_of_read(flat: torch.Tensor, shape: Sequence[int], read, box_shape: tuple[int, ...]) -> torch.Tensor:
    """The elements one `ucp.slice_read.SliceRead` brought in (`flat`), as the box it was planned for."""
    if flat.numel() == 0:
        return flat.reshape(box_shape)
    if read.dim is None:
        tensor = flat.reshape(shape)
    else:
        tensor = join_splits(flat, shape, read.dim, read.bounds)
    for dim, start, length in read.narrow:
        tensor = tensor.narrow(dim, start, length)
    return tensor.clone() if read.narrow else tensor
