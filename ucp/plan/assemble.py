"""Extract → Union → StripPad for one planned state: the reduce step, with its reads at the edge.

States come out as numpy arrays held as `ucp.format.dtypes.NUMPY_DTYPES` (conversion imports no torch);
`materialize_tensor` is the edge where a live engine wants a torch tensor.
"""
from __future__ import annotations

import typing
from typing import TYPE_CHECKING, overload

import numpy as np

from ucp.format.dtypes import NUMPY_DTYPES, cast, to_torch
from ucp.plan.plan import Fragment, StateSource
from ucp.plan.primitives import Array, strip_pad, union
from ucp.storage.fileio import ReadCounter, pread_into

if TYPE_CHECKING:
    import torch


def read_fragment(fragment: Fragment, counter: ReadCounter | None = None) -> np.ndarray:
    """Extract: the fragment's elements, read straight from its source file, in the fragment's shape."""
    piece = fragment.piece
    out = np.empty(piece.numel, dtype=NUMPY_DTYPES[piece.dtype])
    return pread_into(piece.path, out, piece.byte_offset, counter).reshape(fragment.info.shape)


def materialize(source: StateSource, *, name: str, strict: bool = False,
                counter: ReadCounter | None = None) -> np.ndarray:
    """The full, unpadded tensor of one state of one parameter, in the state's stored dtype."""
    return assemble(source, [read_fragment(f, counter) for f in source.fragments], name=name, strict=strict)


def materialize_tensor(source: StateSource, *, name: str, strict: bool = False,
                       counter: ReadCounter | None = None) -> torch.Tensor:
    """`materialize`, as a torch tensor (for the load hook and --format deepspeed)."""
    return to_torch(materialize(source, name=name, strict=strict, counter=counter), source.dtype)


@overload
def assemble(source: StateSource, pieces: list[np.ndarray], *, name: str, strict: bool = False) -> np.ndarray: ...


@overload
def assemble(source: StateSource, pieces: list[torch.Tensor], *, name: str, strict: bool = False) -> torch.Tensor: ...


def assemble(source: StateSource, pieces: list[np.ndarray] | list[torch.Tensor], *, name: str,
             strict: bool = False) -> Array:
    """Union → StripPad of fragments already extracted (in `source.fragments` order), in the stored dtype.

    numpy pieces give a numpy array, torch pieces (the Ray backend's) a torch tensor.
    """
    dtypes = {f.piece.dtype for f in source.fragments}
    if pieces and isinstance(pieces[0], np.ndarray):
        if len(dtypes) > 1:  # as torch.cat would promote them: to the stored dtype, exactly
            pieces = [cast(p, f.piece.dtype, source.dtype) for p, f in zip(pieces, source.fragments)]
            dtypes = {source.dtype}
        dtype = dtypes.pop()
        full = strip_pad(union(source.spec, source.arrange(pieces), strict=strict, name=name, dtype=dtype), source.spec)
        return cast(typing.cast(np.ndarray, full), dtype, source.dtype)  # numpy pieces give numpy
    from ucp.format.safetensors_stream import TORCH_DTYPES

    full = strip_pad(union(source.spec, source.arrange(pieces), strict=strict, name=name), source.spec)
    return typing.cast("torch.Tensor", full).to(TORCH_DTYPES[source.dtype])  # torch pieces give torch
