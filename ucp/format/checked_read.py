"""Reads of stored states that are verified, whole or in part (docs/FORMAT.md, "Checksums").

A read of part of a state is widened to the state's chunk boundaries (`cover`), and every chunk it
then holds is checked against the chunk CRC-32 the index records (`check`); a whole state is checked
against its CRC-32. A state recorded without chunk checksums (checkpoints of format 1 written before
them) is read whole to be checked. No byte reaches a model unchecked.

Ranks that read neighbouring parts of a state (ZeRO partitions) need not each read the chunks their
boundary cuts: given `open_chunks`, a read stays exact, its whole chunks are checked, and each chunk it
holds only part of becomes an `OpenChunk` carrying that part's CRC-32. The parts of a chunk go to one
rank (`ucp.deepspeed.loading.exchange`), whose `close_chunks` checks the chunk from the parts every rank read,
joined with `crc32_combine`, reading only the bytes no rank read.

A read made again after such a check (what the check could not keep in memory) is exact too: `crcs`
records the CRC-32 of each read's bytes the first time, and `check_again` compares the second read with it.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ucp.errors import CorruptCheckpointError
from ucp.format.byte_ranges import ByteRange, coalesce
from ucp.format.crc import chunk_bounds, crc32, crc32_combine
from ucp.format.index import StoredState
from ucp.storage.fileio import ReadCounter, read_buffer, tensor_bytes
from ucp.storage.layer import read_ranges
from ucp.storage.locations import Location

Key = tuple[str, str]


@dataclass(frozen=True)
class OpenChunk:
    """A chunk of a stored state of which a read holds only `part` = (begin, end, CRC-32 of those bytes)."""

    file: str
    begin: int
    end: int
    crc32: int  # of the whole chunk, as the index records it
    part: tuple[int, int, int]
    where: str  # the state, for the error


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
        if crc32(raw) == stored.crc32:
            return
        raise CorruptCheckpointError(f"{where} fails its checksum; the file is damaged, convert again or restore "
                                     "it from a copy")
    first = len(chunk_bounds(stored.begin, read.begin, chunk_bytes))
    for i, (lo, hi) in enumerate(chunk_bounds(read.begin, read.end, chunk_bytes), start=first):
        if crc32(raw[lo - read.begin:hi - read.begin]) != stored.chunk_crc32[i]:  # type: ignore[index]  # a cover
            raise CorruptCheckpointError(f"{where} bytes [{lo}, {hi}) fail their checksum; the file is damaged, "
                                         "convert again or restore it from a copy")


def fetch(root: Location, ranges: list[ByteRange], counter: ReadCounter) -> dict[ByteRange, torch.Tensor]:
    """The bytes of every range (relative to `root` unless absolute), touching ranges of a file read at once,
    all handed to the storage together (an object store runs them concurrently)."""
    chunks, reads = {}, []
    for merged, parts in coalesce(ranges):
        buf = read_buffer(merged.nbytes)
        reads.append((root / merged.file, merged.begin, tensor_bytes(buf)))
        for part in parts:
            chunks[part] = buf.narrow(0, part.begin - merged.begin, part.nbytes)
    read_ranges(reads, counter)
    return chunks


def fill(root: Location, ranges: list[ByteRange], into: torch.Tensor, counter: ReadCounter
         ) -> dict[ByteRange, torch.Tensor]:
    """Read `ranges` (relative to `root` unless absolute) one after the other into `into` (bytes, exactly as many
    as they hold), where the caller wants them, with no buffer of their own; each range's part of it."""
    if sum(r.nbytes for r in ranges) != into.numel():
        raise ValueError(f"{into.numel()} bytes to fill from ranges of {sum(r.nbytes for r in ranges)}")
    parts, reads, offset = {}, [], 0
    for r in ranges:
        parts[r] = into.narrow(0, offset, r.nbytes)
        reads.append((root / r.file, r.begin, tensor_bytes(parts[r])))
        offset += r.nbytes
    read_ranges(reads, counter)
    return parts


def read_checked(root: Location, wanted: dict[Key, tuple[StoredState, ByteRange]], chunk_bytes: int,
                 counter: ReadCounter, verify: bool = True, open_chunks: list[OpenChunk] | None = None,
                 crcs: dict[Key, int] | None = None,
                 again: dict[Key, int] | None = None) -> tuple[dict[Key, torch.Tensor], int]:
    """The bytes of each wanted range of a stored state, checked (see the module docstring), and how many
    bytes were read beyond the wanted ones to check them. Touching reads of a file are coalesced. With
    `open_chunks`, partial chunks are not widened but appended there, for `close_chunks`; with `crcs`, the
    CRC-32 of each wanted range's bytes is recorded there. With `again` (such a record), each range is read
    exactly and compared with the CRC-32 it had then (`check_again`) instead."""
    def to_read(stored: StoredState, rng: ByteRange) -> ByteRange:
        if not verify or again is not None or open_chunks is not None and stored.chunk_crc32 is not None:
            return rng
        return cover(stored, rng, chunk_bytes)

    covers = {key: to_read(stored, rng) for key, (stored, rng) in wanted.items()}
    fetched = fetch(root, [c for c in covers.values() if c.nbytes], counter)
    out = {}
    for key, (stored, rng) in wanted.items():
        read = covers[key]
        data = fetched.get(read, torch.empty(0, dtype=torch.uint8))
        where = f"{root / stored.file}: {key[0]}:{key[1]}"
        crc = None
        if again is not None:
            if verify:
                check_again(data, again[key], f"{where} bytes [{rng.begin}, {rng.end})")
        elif verify and read == rng and open_chunks is not None and stored.chunk_crc32 is not None:
            opened, crc = _check_whole_chunks(data, read, stored, chunk_bytes, where)
            open_chunks += opened
        elif verify:
            check(data, read, stored, chunk_bytes, where)
        out[key] = data.narrow(0, rng.begin - read.begin, rng.nbytes)
        if crcs is not None:
            whole = rng.begin == stored.begin and rng.end == stored.end and verify
            crcs[key] = crc if crc is not None else stored.crc32 if whole else crc32(tensor_bytes(out[key]))
    extra = sum(c.nbytes for c in covers.values()) - sum(rng.nbytes for _, rng in wanted.values())
    return out, extra


def check_again(data: torch.Tensor, expected: int, where: str) -> None:
    """Raise `CorruptCheckpointError` unless `data`, bytes read again after the check before a load, have the
    CRC-32 the check's read of them had (`expected`)."""
    found = crc32(tensor_bytes(data))
    if found != expected:
        raise CorruptCheckpointError(
            f"{where} changed since the check before the load (CRC-32 {expected:08x} then, {found:08x} now): something "
            "wrote the file or the storage returns other bytes; the engine holds a partial load, so load again once "
            "the files are stable")


def _check_whole_chunks(data: torch.Tensor, read: ByteRange, stored: StoredState, chunk_bytes: int,
                        where: str) -> tuple[list[OpenChunk], int]:
    """Check the chunks of `stored` that `read` holds whole; the ones it holds part of, open. Also the CRC-32
    of all of `read`'s bytes, joined from its pieces'."""
    raw, opened, whole = tensor_bytes(data), [], 0
    for lo, hi in chunk_bounds(read.begin, read.end, chunk_bytes):
        first = max(stored.begin, lo // chunk_bytes * chunk_bytes)
        bounds = (first, min(stored.end, (lo // chunk_bytes + 1) * chunk_bytes))
        expected = stored.chunk_crc32[len(chunk_bounds(stored.begin, first, chunk_bytes))]  # type: ignore[index]
        crc = crc32(raw[lo - read.begin:hi - read.begin])
        whole = crc32_combine(whole, crc, hi - lo)
        if (lo, hi) != bounds:
            opened.append(OpenChunk(stored.file, *bounds, expected, (lo, hi, crc), where))
        elif crc != expected:
            raise CorruptCheckpointError(f"{where} bytes [{lo}, {hi}) fail their checksum; the file is damaged, "
                                         "convert again or restore it from a copy")
    return opened, whole


def close_chunks(root: Location, parts: Sequence[OpenChunk], counter: ReadCounter) -> int:
    """Check each chunk that `parts` (what every rank read of the chunks this rank closes) are parts of, from
    them joined in file order; bytes of a chunk no rank read are read here. Returns how many were."""
    joined: dict[tuple[str, int], set[tuple[int, int, int]]] = {}
    chunks: dict[tuple[str, int], OpenChunk] = {}
    for c in parts:
        joined.setdefault((c.file, c.begin), set()).add(c.part)
        chunks.setdefault((c.file, c.begin), c)
    extra = 0
    for unit, c in sorted(chunks.items()):
        crc, read = _joined(root / c.file, joined[unit], c.begin, c.end, counter)
        extra += read
        if crc != c.crc32:
            raise CorruptCheckpointError(f"{c.where} bytes [{c.begin}, {c.end}) fail their checksum; the file is "
                                         "damaged, convert again or restore it from a copy")
    return extra


def _joined(path: Location, parts: set[tuple[int, int, int]], begin: int, end: int,
            counter: ReadCounter) -> tuple[int, int]:
    """The CRC-32 of bytes [begin, end) of `path` from `parts` (begin, end, CRC-32) of them, in file order,
    reading what no part covers; and how many bytes that read."""
    crc, cursor, read = 0, begin, 0
    while cursor < end:
        step = max((p for p in parts if p[0] == cursor), key=lambda p: p[1], default=None)
        if step is None:  # a gap: up to the next part
            stop = min((p[0] for p in parts if p[0] > cursor), default=end)
            buf = torch.empty(stop - cursor, dtype=torch.uint8)
            read_ranges([(path, cursor, tensor_bytes(buf))], counter)
            step, read = (cursor, stop, crc32(tensor_bytes(buf))), read + stop - cursor
        crc, cursor = crc32_combine(crc, step[2], step[1] - step[0]), step[1]
    return crc, read
