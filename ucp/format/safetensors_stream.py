"""Write safetensors files tensor by tensor, and read single tensors back by byte offset.

A safetensors file is an 8-byte little-endian header length, a JSON header giving every tensor's
dtype, shape and byte range, then the raw bytes. When every shape and dtype is known in advance
(they are: the plan knows them), the header can be written first and the tensors streamed after
it one at a time, so a writer never holds more than one tensor. Files stay readable by stock
`safetensors.safe_open`.
"""
from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ucp.errors import CorruptCheckpointError
from ucp.format.crc import CHUNK_BYTES, crc32, join_segments, segment_crcs
from ucp.format.index import DTYPE_SIZES, SAFETENSORS_DTYPES
from ucp.storage.fileio import ReadCounter, tensor_bytes
from ucp.storage.layer import read_ranges
from ucp.storage.locations import Location

if TYPE_CHECKING:
    import torch

_ALIGN = 8  # safetensors pads the header so the data section starts 8-byte aligned


def __getattr__(name: str) -> dict[str, torch.dtype]:
    # TORCH_DTYPES (dtype name -> torch.dtype) is built on first use, so that conversion, which
    # imports this module, never imports torch.
    if name == "TORCH_DTYPES":
        import torch

        dtypes: dict[str, torch.dtype] = {dtype: getattr(torch, dtype) for dtype in SAFETENSORS_DTYPES}
        globals()[name] = dtypes
        return dtypes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass(frozen=True)
class TensorSlot:
    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes landed: absolute [begin, end) in its file, and their CRC-32."""

    key: str
    begin: int
    end: int
    crc32: int
    chunk_crc32: tuple[int, ...] = ()  # of each chunk (`ucp.format.crc.chunk_bounds`)


def encode_header(slots: Sequence[TensorSlot], metadata: dict[str, str] | None = None) -> bytes:
    """The first bytes of a safetensors file holding `slots` packed in order: length, JSON, padding.

    The data of slot i then starts at len(header) + the sum of the sizes of slots before it.
    """
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    cursor = 0
    for slot in slots:
        header[slot.key] = {"dtype": SAFETENSORS_DTYPES[slot.dtype], "shape": list(slot.shape),
                            "data_offsets": [cursor, cursor + slot.nbytes]}
        cursor += slot.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % _ALIGN)
    return struct.pack("<Q", len(raw)) + raw


class StreamingWriter:
    """Writes the header for `slots` at open, then accepts their tensors in the same order."""

    def __init__(self, path: str, slots: Sequence[TensorSlot], metadata: dict[str, str] | None = None,
                 chunk_bytes: int = CHUNK_BYTES):
        self.path = path
        self.chunk_bytes = chunk_bytes
        self._slots = list(slots)
        head = encode_header(self._slots, metadata)
        self._next = 0
        self._position = len(head)
        self._file = open(path, "wb")
        self._file.write(head)

    def write(self, key: str, tensor: torch.Tensor) -> StoredTensor:
        slot = self._slots[self._next]
        if key != slot.key:
            raise ValueError(f"{self.path}: expected tensor {slot.key}, got {key}")
        if tuple(tensor.shape) != slot.shape or str(tensor.dtype).removeprefix("torch.") != slot.dtype:
            raise ValueError(f"{key}: got {tuple(tensor.shape)} {tensor.dtype}, "
                             f"the header says {slot.shape} {slot.dtype}")
        data = tensor_bytes(tensor.contiguous())
        try:
            self._file.write(data)
        except OSError as exc:  # no space, quota: name the file, which a bare write error does not
            raise OSError(exc.errno, exc.strerror, self.path) from None
        begin = self._position
        self._position += len(data)
        self._next += 1
        whole, chunks = join_segments(segment_crcs(data, begin, self.chunk_bytes), begin, self._position,
                                      self.chunk_bytes)
        return StoredTensor(key, begin, self._position, whole, tuple(chunks))

    @property
    def size(self) -> int:
        """The bytes written so far: the whole file's size once every tensor is in."""
        return self._position

    def close(self) -> None:
        """Flush and fsync; the file is durable once this returns."""
        if self._next != len(self._slots):
            self._file.close()
            raise ValueError(f"{self.path}: closed after {self._next} of {len(self._slots)} tensors")
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, self.path) from None
        finally:
            self._file.close()

    def abort(self) -> None:
        self._file.close()


def read_stored(path: Location, begin: int, end: int, dtype: str, shape: Sequence[int],
                expected_crc: int | None = None, counter: ReadCounter | None = None) -> torch.Tensor:
    """The tensor stored at bytes [begin, end) of `path`, checked against its CRC-32 when given."""
    import torch

    out = torch.empty(tuple(shape), dtype=getattr(torch, dtype))
    if tensor_bytes(out).nbytes != end - begin:
        raise CorruptCheckpointError(f"{path}: bytes [{begin}, {end}) cannot hold {dtype}{list(shape)}")
    read_ranges([(path, begin, tensor_bytes(out))], counter)
    if expected_crc is not None and crc32(tensor_bytes(out)) != expected_crc:
        raise CorruptCheckpointError(f"{path}: bytes [{begin}, {end}) fail their checksum; the file is damaged, "
                                     "convert again or restore it from a copy")
    return out
