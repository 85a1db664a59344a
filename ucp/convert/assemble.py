"""Extract → Union → StripPad for one planned state: the reduce step, with its reads at the edge."""
from __future__ import annotations

import torch

from ucp.convert.plan import Fragment, StateSource
from ucp.convert.primitives import strip_pad, union
from ucp.format.fileio import ReadCounter, pread_into
from ucp.format.safetensors_stream import TORCH_DTYPES
from ucp.patterns.types import Pattern


def read_fragment(fragment: Fragment, counter: ReadCounter | None = None) -> torch.Tensor:
    """Extract: the fragment's elements, read straight from its source file, in the fragment's shape."""
    piece = fragment.piece
    out = torch.empty(piece.numel, dtype=TORCH_DTYPES[piece.dtype])
    return pread_into(piece.path, out, piece.byte_offset, counter).reshape(fragment.info.shape)


class Arena:
    """One reusable buffer that states are read into, instead of fresh memory for every state.

    Fresh pages cost a fault on first touch (seconds per GiB on some VMs); a conversion worker that
    reuses one buffer pays it once. A tensor taken from the arena is valid only until the next
    `materialize` call with the same arena.
    """

    def __init__(self) -> None:
        self._buffer = torch.empty(0, dtype=torch.uint8)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self._buffer[:nbytes].view(dtype)


def materialize(source: StateSource, *, name: str, strict: bool = False,
                counter: ReadCounter | None = None, arena: Arena | None = None) -> torch.Tensor:
    """The full, unpadded tensor of one state of one parameter, in the state's stored dtype."""
    if arena is not None and _places_flat(source):
        return _read_in_place(source, arena, counter)
    return assemble(source, [read_fragment(f, counter) for f in source.fragments], name=name, strict=strict)


def _places_flat(source: StateSource) -> bool:
    """Whether the fragments are rank-ordered flat runs that tile the padded tensor (ZeRO partitions)."""
    spec = source.spec
    return (spec.flat and spec.padded_size is not None and source.groups is None
            and spec.pattern in (Pattern.UNIQUE, Pattern.SHARD_V)
            and all(f.piece.dtype == source.dtype and f.info.offset is not None for f in source.fragments))


def _read_in_place(source: StateSource, arena: Arena, counter: ReadCounter | None) -> torch.Tensor:
    """Union of flat shards by placement: each fragment is read straight into its offset of the
    padded flat tensor, which is exactly what concatenating them in rank order makes."""
    flat = arena.take(source.spec.padded_size, TORCH_DTYPES[source.dtype])
    for f in source.fragments:
        pread_into(f.piece.path, flat.narrow(0, f.info.offset, f.piece.numel), f.piece.byte_offset, counter)
    return strip_pad(flat, source.spec)


def assemble(source: StateSource, pieces: list[torch.Tensor], *, name: str, strict: bool = False) -> torch.Tensor:
    """Union → StripPad of fragments already extracted (in `source.fragments` order), in the stored dtype."""
    full = strip_pad(union(source.spec, source.arrange(pieces), strict=strict, name=name), source.spec)
    return full.to(TORCH_DTYPES[source.dtype])
