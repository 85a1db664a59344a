"""Tensor dtypes as numpy arrays, bit for bit as torch has them, so conversion needs no torch.

numpy has no bfloat16: a bfloat16 array is held as its raw uint16 words, and the conversions
here do what torch does on CPU (upcast exactly; on the way down round to nearest even, and write
NaN as torch's CPU kernels write it). Everything else maps to numpy's own dtype, whose casts match
torch's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch

# How each stored dtype (ucp.format.index.DTYPE_SIZES) is held in numpy: bfloat16 as its raw words.
NUMPY_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype("<f4"), "float64": np.dtype("<f8"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2"),
    "int64": np.dtype("<i8"), "int32": np.dtype("<i4"), "int16": np.dtype("<i2"), "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"), "bool": np.dtype("?")}
FLOATS = ("float32", "float64", "float16", "bfloat16")
_BF16_NAN = 0xFFFF  # what torch's vectorised float -> bfloat16 cast gives for any NaN (on CPU)


def as_values(array: np.ndarray, dtype: str) -> np.ndarray:
    """`array` (held as `NUMPY_DTYPES[dtype]`) as numbers numpy can compute with: bfloat16 becomes float32, exactly."""
    if dtype != "bfloat16":
        return array
    return (array.astype(np.uint32) << 16).view(np.float32)


def from_values(values: np.ndarray, dtype: str) -> np.ndarray:
    """Numbers cast to `dtype` and held as `NUMPY_DTYPES[dtype]`, rounded as torch's `.to(dtype)` rounds."""
    if dtype != "bfloat16":
        with np.errstate(all="ignore"):  # overflow to inf is the cast's result, as in torch, not a warning to print
            return values.astype(NUMPY_DTYPES[dtype], copy=False)
    words = values.astype(np.float32, copy=False).view(np.uint32)
    rounded = ((words + (0x7FFF + ((words >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(values), np.uint16(_BF16_NAN), rounded)


def cast(array: np.ndarray, source: str, target: str) -> np.ndarray:
    """`array` of dtype `source` cast to `target`, as torch's `.to` casts (a no-op when they agree)."""
    if source == target:
        return array
    return from_values(as_values(array, source), target)


def to_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    """A torch tensor sharing `array`'s memory, of `dtype` (the edge where conversion meets a live engine)."""
    import torch

    tensor = torch.from_numpy(np.require(array, requirements="C"))  # (ascontiguousarray makes 0-d 1-d)
    return tensor.view(torch.bfloat16) if dtype == "bfloat16" else tensor


def from_torch(tensor: torch.Tensor) -> tuple[np.ndarray, str]:
    """A CPU tensor as a numpy array sharing its memory, with its dtype's name."""
    import torch

    dtype = str(tensor.dtype).removeprefix("torch.")
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.uint16) if hasattr(torch, "uint16") else tensor.view(torch.int16)
        return tensor.numpy().view(np.uint16), dtype
    return tensor.numpy(), dtype
