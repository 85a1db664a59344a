"""Extract → Union → StripPad for one planned state: the reduce step, with its reads at the edge."""
from __future__ import annotations

import torch

from ucp.fileio import ReadCounter, pread_into
from ucp.plan import Fragment, StateSource
from ucp.primitives import strip_pad, union
from ucp.safetensors_stream import TORCH_DTYPES


def read_fragment(fragment: Fragment, counter: ReadCounter | None = None) -> torch.Tensor:
    """Extract: the fragment's elements, read straight from its source file, in the fragment's shape."""
    piece = fragment.piece
    out = torch.empty(piece.numel, dtype=TORCH_DTYPES[piece.dtype])
    return pread_into(piece.path, out, piece.byte_offset, counter).reshape(fragment.info.shape)


def materialize(source: StateSource, *, name: str, strict: bool = False,
                counter: ReadCounter | None = None) -> torch.Tensor:
    """The full, unpadded tensor of one state of one parameter, in the state's stored dtype."""
    return assemble(source, [read_fragment(f, counter) for f in source.fragments], name=name, strict=strict)


def assemble(source: StateSource, pieces: list[torch.Tensor], *, name: str, strict: bool = False) -> torch.Tensor:
    """Union → StripPad of fragments already extracted (in `source.fragments` order), in the stored dtype."""
    full = strip_pad(union(source.spec, source.arrange(pieces), strict=strict, name=name), source.spec)
    return full.to(TORCH_DTYPES[source.dtype])
