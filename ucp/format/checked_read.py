"""Reads of stored states that are verified, whole or in part (docs/FORMAT.md, "Checksums").

A read of part of a state is widened to the state's chunk boundaries (`cover`), and every chunk it
then holds is checked against the chunk CRC-32 the index records (`check`); a whole state is checked
against its CRC-32. A state recorded without chunk checksums (checkpoints of format 1 written before
them) is read whole to be checked. No byte reaches a model unchecked.
"""
from __future__ import annotations

import zlib
from pathlib import Path

import torch

from ucp.errors import CorruptCheckpointError
from ucp.format.byte_ranges import ByteRange, coalesce
from ucp.format.crc import chunk_bounds
from ucp.format.fileio import ReadCounter, pread_into, tensor_bytes
from ucp.format.index import StoredState

Key = tuple[str, str]


def cover(stored: StoredState, wanted: ByteRange, chunk_bytes: int) -> ByteRange:
    """The range to read so that `wanted` (inside `stored`) can be checked: whole chunks of the state."""
    if wanted.nbytes == 0:
        return wanted  # nothing to check
    if wanted.begin == stored.begin and wanted.end == stored.end or stored.chunk_crc32 is None:
        return ByteRange(wanted.file, stored.begin, stored.end)
    lo = max(stored.begin, wanted.begin // chunk_bytes * chunk_bytes)
    hi = min(stored.end, -(-wanted.end // chunk_bytes) * chunk_bytes)
    return ByteRange(wanted.file, lo, hi)


def check(data: torch.Tensor, read: ByteRange, stored: StoredState, chunk_bytes: int, where: str) -> None:
    """Raise `CorruptCheckpointError` unless `data`, the bytes of `read` (a `cover`), match their checksums."""
    raw = tensor_bytes(data)
    if read.nbytes == 0:
        return
    if read.begin == stored.begin and read.end == stored.end:
        if zlib.crc32(raw) == stored.crc32:
            return
        raise CorruptCheckpointError(f"{where} fails its checksum; the file is damaged, convert again or restore "
                                     "it from a copy")
    first = len(chunk_bounds(stored.begin, read.begin, chunk_bytes))
    for i, (lo, hi) in enumerate(chunk_bounds(read.begin, read.end, chunk_bytes), start=first):
        if zlib.crc32(raw[lo - read.begin:hi - read.begin]) != stored.chunk_crc32[i]:
            raise CorruptCheckpointError(f"{where} bytes [{lo}, {hi}) fail their checksum; the file is damaged, "
                                         "convert again or restore it from a copy")


def fetch(root: Path, ranges: list[ByteRange], counter: ReadCounter) -> dict[ByteRange, torch.Tensor]:
    """The bytes of every range (relative to `root` unless absolute), touching ranges of a file read at once."""
    chunks = {}
    for merged, parts in coalesce(ranges):
        buf = torch.empty(merged.nbytes, dtype=torch.uint8)
        pread_into(str(root / merged.file), buf, merged.begin, counter)
        for part in parts:
            chunks[part] = buf.narrow(0, part.begin - merged.begin, part.nbytes)
    return chunks


def read_checked(root: Path, wanted: dict[Key, tuple[StoredState, ByteRange]], chunk_bytes: int,
                 counter: ReadCounter, verify: bool = True) -> tuple[dict[Key, torch.Tensor], int]:
    """The bytes of each wanted range of a stored state, checked (see the module docstring), and how many
    bytes were read beyond the wanted ones to check them. Touching reads of a file are coalesced."""
    covers = {key: cover(stored, rng, chunk_bytes) if verify else rng for key, (stored, rng) in wanted.items()}
    fetched = fetch(root, [c for c in covers.values() if c.nbytes], counter)
    out = {}
    for key, (stored, rng) in wanted.items():
        read = covers[key]
        data = fetched.get(read, torch.empty(0, dtype=torch.uint8))
        if verify:
            check(data, read, stored, chunk_bytes, f"{root / stored.file}: {key[0]}:{key[1]}")
        out[key] = data.narrow(0, rng.begin - read.begin, rng.nbytes)
    extra = sum(c.nbytes for c in covers.values()) - sum(rng.nbytes for _, rng in wanted.values())
    return out, extra
