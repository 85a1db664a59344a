"""Extract → Union → StripPad for one planned state: the reduce step, with its reads at the edge.

States come out as numpy arrays held as `ucp.dtypes.NUMPY_DTYPES` (conversion imports no torch);
`materialize_tensor` is the edge where a live engine wants a torch tensor.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ucp.dtypes import NUMPY_DTYPES, cast, to_torch
from ucp.fileio import ReadCounter, pread_into
from ucp.patterns.types import Pattern
from ucp.plan import Fragment, StateSource
from ucp.primitives import Array, strip_pad, union

if TYPE_CHECKING:
    import torch


def read_fragment(fragment: Fragment, counter: ReadCounter | None = None) -> np.ndarray:
    """Extract: the fragment's elements, read straight from its source file, in the fragment's shape."""
    piece = fragment.piece
    out = np.empty(piece.numel, dtype=NUMPY_DTYPES[piece.dtype])
    return pread_into(piece.path, out, piece.byte_offset, counter).reshape(fragment.info.shape)


class Arena:
    """One reusable buffer that states are read into, instead of fresh memory for every state.

    Fresh pages cost a fault on first touch (seconds per GiB on some VMs); a conversion worker that
    reuses one buffer pays it once. An array taken from the arena is valid only until the next
    `take`.
    """

    def __init__(self) -> None:
        self._buffer = np.empty(0, dtype=np.uint8)

    def take(self, numel: int, dtype: str) -> np.ndarray:
        held = NUMPY_DTYPES[dtype]
        nbytes = numel * held.itemsize
        if self._buffer.nbytes < nbytes:
            self._buffer = np.empty(nbytes, dtype=np.uint8)
        return self._buffer[:nbytes].view(held)


def materialize(source: StateSource, *, name: str, strict: bool = False,
                counter: ReadCounter | None = None, arena: Arena | None = None) -> np.ndarray:
    """The full, unpadded tensor of one state of one parameter, in the state's stored dtype."""
    if arena is not None and _places_flat(source):
        return _read_in_place(source, arena, counter)
    return assemble(source, [read_fragment(f, counter) for f in source.fragments], name=name, strict=strict)


def materialize_tensor(source: StateSource, *, name: str, strict: bool = False,
                       counter: ReadCounter | None = None) -> torch.Tensor:
    """`materialize`, as a torch tensor (for the load hook and --format deepspeed)."""
    return to_torch(materialize(source, name=name, strict=strict, counter=counter), source.dtype)


def _places_flat(source: StateSource) -> bool:
    """Whether the fragments are rank-ordered flat runs that tile the padded tensor (ZeRO partitions)."""
    spec = source.spec
    return (spec.flat and spec.padded_size is not None and source.groups is None
            and spec.pattern in (Pattern.UNIQUE, Pattern.SHARD_V)
            and all(f.piece.dtype == source.dtype and f.info.offset is not None for f in source.fragments))


def _read_in_place(source: StateSource, arena: Arena, counter: ReadCounter | None) -> np.ndarray:
    """Union of flat shards by placement: each fragment is read straight into its offset of the
    padded flat tensor, which is exactly what concatenating them in rank order makes."""
    flat = arena.take(source.spec.padded_size, source.dtype)
    for f in source.fragments:
        pread_into(f.piece.path, flat[f.info.offset:f.info.offset + f.piece.numel], f.piece.byte_offset, counter)
    return strip_pad(flat, source.spec)


def assemble(source: StateSource, pieces: list[Array], *, name: str, strict: bool = False) -> Array:
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
        return cast(full, dtype, source.dtype)
    from ucp.safetensors_stream import TORCH_DTYPES

    full = strip_pad(union(source.spec, source.arrange(pieces), strict=strict, name=name), source.spec)
    return full.to(TORCH_DTYPES[source.dtype])
