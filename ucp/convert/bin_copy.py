"""The local conversion's reduce task: one bin's states, from the rank files into one safetensors file.

Most states are the bytes of a few runs of the rank files, back to back: ZeRO partitions in rank
order less their padding, dim-0 TP shards, rank 0's copy of a replica, perhaps upcast to the
stored dtype (`state_runs`). Those are copied block by block, a few blocks in flight on threads
(reads, CRC-32 and writes release the GIL), each block into its place in the file, whose layout
the header fixes in advance. Row-parallel TP shards (joined along dim 1, `row_parts`) are read
whole and copied into their columns of the output on the same threads. Any other state (averaged
partials, --strict replicas, split-major storage) is assembled in memory (`ucp.plan.assemble`) and
written the same way.

Every byte read is CRC'd once: where a block is copied as is, each CRC of the block's pieces
between output chunk boundaries is both an output chunk's segment (`ucp.format.crc.join_segments`) and
a segment of the source zip entry it came from, which the driver checks (`ucp.convert.source_check`).
An upcast block's source bytes get a CRC of their own, and so do the bytes of a state's fragments
that no output needs (the other copies of a replica, padding: `unread_bytes`), read on the same
threads, so that every entry the conversion reads is covered. Writeback is started as blocks land, so
the one fsync at the end finds little left to write. Nothing here imports torch.
"""
from __future__ import annotations

import ctypes
import dataclasses
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ucp.format.crc import chunk_bounds, crc32, join_segments
from ucp.format.dtypes import NUMPY_DTYPES, cast
from ucp.format.index import DTYPE_SIZES
from ucp.format.safetensors_stream import StoredTensor, TensorSlot, encode_header
from ucp.format.splits import to_split_major
from ucp.patterns.types import Pattern, PatternSpec
from ucp.plan.assemble import assemble, read_fragment
from ucp.plan.plan import ParamPlan, StateSource
from ucp.storage.fileio import open_regular, read_exactly, tensor_bytes

BLOCK_BYTES = 8 << 20  # a block: the bytes one thread copies as one task
# A block moves through a buffer this large, a piece at a time: read, CRC'd and written while the
# piece is still in the core's cache (8 MiB pieces ran three times slower than 1 MiB ones here).
PIECE_BYTES = 1 << 20
THREADS = 3            # blocks in flight per worker, so reads, CRCs and writes overlap
WRITEBACK_BYTES = 64 << 20  # start the kernel's writeback after this many bytes, so fsync has little left

Segment = tuple[int, int, int]               # (begin, end, crc32) of output bytes
SourceSegment = tuple[str, int, int, int]    # (path, begin, end, crc32) of source bytes


@dataclass(frozen=True)
class Run:
    """`numel` elements of `dtype` at byte `offset` of file `path`, the next stretch of a state's elements."""

    path: str
    offset: int
    numel: int
    dtype: str


def state_runs(source: StateSource, strict: bool = False) -> list[Run] | None:
    """The state as runs of its source files, in order, when its elements are exactly those (each run
    cast to the stored dtype); None when Union has to compute them (see the module docstring).

    These are the states whose Union concatenates along the first dim (or flat) and whose StripPad
    keeps a prefix: UNIQUE, SHARD_V, REPLICATE without `strict` (rank 0's copy), and the same over
    pieces that are themselves such states (a TP shard that ZeRO partitioned: Shard-Hy along dim 0).
    """
    spec = source.spec
    if spec.pattern in (Pattern.SHARD_H, Pattern.SHARD_HY) and spec.dim != 0:
        return None  # joined along dim 1: rows interleave (`row_parts`)
    parts = _parts(source, strict)
    if parts is None:
        return None
    if spec.inner is not None:
        pattern = Pattern.SHARD_V if spec.pattern is Pattern.SHARD_HY else spec.pattern
        spec = dataclasses.replace(spec, pattern=pattern, inner=None, shard_shapes=None)
    return _joined(spec, parts, strict)


def row_parts(source: StateSource, strict: bool = False) -> list[tuple[tuple[int, ...], list[Run]]] | None:
    """A 2-D state that Union joins along dim 1 from pieces that are runs (row-parallel TP shards, whole or
    ZeRO-partitioned): each piece's (shape, runs); None for any other state, or where StripPad would cut."""
    spec = source.spec
    if spec.pattern not in (Pattern.SHARD_H, Pattern.SHARD_HY) or spec.dim != 1 or len(spec.shape) != 2:
        return None
    parts = _parts(source, strict)
    if parts is None or any(len(shape) != 2 or shape[0] != spec.shape[0] for shape, _ in parts) \
            or sum(shape[1] for shape, _ in parts) != spec.shape[1]:
        return None
    return parts


def _parts(source: StateSource, strict: bool) -> list[tuple[tuple[int, ...], list[Run]]] | None:
    """The pieces Union joins, as (shape, runs): the fragments, or the outer pieces their inner pattern rebuilds."""
    spec, frags = source.spec, source.fragments
    if not frags or len({f.piece.dtype for f in frags}) != 1:
        return None
    if spec.inner is None:
        if source.groups is not None:
            return None
        return [(f.info.shape, [Run(f.piece.path, f.piece.byte_offset, f.piece.numel, f.piece.dtype)]) for f in frags]
    if source.groups is None or spec.shard_shapes is None or len(spec.shard_shapes) != len(source.groups):
        return None
    parts, start = [], 0
    for size, shape in zip(source.groups, spec.shard_shapes):
        inner = StateSource(dataclasses.replace(spec.inner, shape=tuple(shape)), frags[start:start + size],
                            source.dtype)
        start += size
        runs = state_runs(inner, strict)
        if runs is None:
            return None
        parts.append((tuple(shape), runs))
    return parts


def _joined(spec: PatternSpec, parts: list[tuple[tuple[int, ...], list[Run]]], strict: bool) -> list[Run] | None:
    """Union and StripPad of pieces given as (shape, runs), as runs; None where that is not a prefix of them."""
    if spec.pattern is Pattern.REPLICATE and not strict or spec.pattern is Pattern.UNIQUE and len(parts) == 1:
        parts = parts[:1]
    elif spec.pattern is not Pattern.SHARD_V:
        return None
    flat = spec.flat or all(len(shape) == 1 for shape, _ in parts) and len(spec.shape) != 1
    if not flat and any(len(shape) != len(spec.shape) or tuple(shape[1:]) != tuple(spec.shape[1:])
                        for shape, _ in parts):
        return None  # StripPad would cut along another dim than the first
    out, left = [], spec.numel
    for run in (run for _, runs in parts for run in runs):
        take = min(left, run.numel)
        if take:
            out.append(dataclasses.replace(run, numel=take))
        left -= take
    return out if left == 0 else None  # too few elements: Union's own error says which


class BinFile:
    """A safetensors file whose header is written first and whose states are written in place, by offset."""

    def __init__(self, path: str, slots: list[TensorSlot], metadata: dict[str, str], chunk_bytes: int):
        self.path = path
        self.chunk_bytes = chunk_bytes
        head = encode_header(slots, metadata)
        self.begins, cursor = {}, len(head)
        for slot in slots:
            self.begins[slot.key] = cursor
            cursor += slot.nbytes
        self.size = cursor
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._flushed = 0
        try:
            self.write(head, 0)
        except BaseException:
            self.abort()
            raise

    def write(self, data, offset: int) -> None:
        view = memoryview(data).cast("B")
        done = 0
        try:
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], offset + done)
        except OSError as exc:  # no space, quota: name the file, which a bare write error does not
            raise OSError(exc.errno, exc.strerror, self.path) from None

    def start_writeback(self, upto: int) -> None:
        """Ask the kernel to start writing [flushed, upto) to disk now, without waiting for it."""
        if upto - self._flushed >= WRITEBACK_BYTES:
            _sync_file_range(self._fd, self._flushed, upto - self._flushed)
            self._flushed = upto

    def close(self) -> None:
        """fsync and close; the file is durable once this returns."""
        try:
            os.fsync(self._fd)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, self.path) from None
        finally:
            self.abort()

    def abort(self) -> None:
        """Close without fsync (the caller deletes the file); closing twice is harmless."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if _libc is not None:
    _libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]


def _sync_file_range(fd: int, offset: int, nbytes: int) -> None:
    if _libc is not None:
        _libc.sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # advice only: errors surface at fsync


class Sources:
    """Open descriptors of the rank files a bin reads, each opened once."""

    def __init__(self) -> None:
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()  # blocks of one file may be read on several threads

    def read(self, path: str, view: memoryview, offset: int) -> None:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = open_regular(path)
            fd = self._fds[path]
        read_exactly(fd, path, view, offset)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass(frozen=True)
class Block:
    """Elements [start, start + numel) of a run, landing at byte `dest` of the output file."""

    run: Run
    start: int
    numel: int
    dest: int
    dtype: str  # the stored dtype


def blocks(runs: list[Run], dest: int, dtype: str) -> Iterator[Block]:
    """The blocks that copy `runs` to byte `dest` on, in `dtype`: at most BLOCK_BYTES read each."""
    for run in runs:
        per_block = max(1, BLOCK_BYTES // DTYPE_SIZES[run.dtype])
        for start in range(0, run.numel, per_block):
            numel = min(per_block, run.numel - start)
            yield Block(run, start, numel, dest, dtype)
            dest += numel * DTYPE_SIZES[dtype]


class Copier:
    """Copies blocks into a `BinFile` on a few threads, each with a reusable buffer, and collects CRCs."""

    def __init__(self, out: BinFile, sources: Sources):
        self.out = out
        self.sources = sources
        self._pool = ThreadPoolExecutor(THREADS)
        self._buffers: queue.Queue[np.ndarray] = queue.Queue()
        for _ in range(THREADS):
            self._buffers.put(np.empty(PIECE_BYTES, dtype=np.uint8))

    def submit(self, block: Block) -> Future:
        return self._pool.submit(self._copy, block)

    def submit_checksum(self, path: str, begin: int, end: int) -> Future:
        return self._pool.submit(self._checksum, path, begin, end)

    def _checksum(self, path: str, begin: int, end: int) -> tuple[list[Segment], list[SourceSegment]]:
        """Source bytes no output needs, read and CRC'd only (a piece at a time, as copies are)."""
        buffer = self._buffers.get()
        read: list[SourceSegment] = []
        try:
            for lo in range(begin, end, PIECE_BYTES):
                raw = buffer[:min(PIECE_BYTES, end - lo)]
                self.sources.read(path, raw.data, lo)
                read.append((path, lo, lo + raw.nbytes, crc32(raw)))
        finally:
            self._buffers.put(buffer)
        return [], read

    def submit_rows(self, parts: list[tuple[tuple[int, ...], list[Run]]], dtype: str, dest: int) -> Future:
        return self._pool.submit(self._interleave, parts, dtype, dest)

    def _interleave(self, parts: list[tuple[tuple[int, ...], list[Run]]], dtype: str,
                    dest: int) -> tuple[list[Segment], list[SourceSegment]]:
        """Pieces joined along dim 1: each read whole (and CRC'd), then copied into its columns of the output."""
        rows = parts[0][0][0]
        out = np.empty((rows, sum(shape[1] for shape, _ in parts)), dtype=NUMPY_DTYPES[dtype])
        read: list[SourceSegment] = []
        column = 0
        for (_, width), runs in parts:
            piece = np.empty(rows * width, dtype=NUMPY_DTYPES[runs[0].dtype])
            start = 0
            for run in runs:
                raw = piece[start:start + run.numel].view(np.uint8)
                self.sources.read(run.path, raw.data, run.offset)
                read.append((run.path, run.offset, run.offset + raw.nbytes, crc32(raw)))
                start += run.numel
            out[:, column:column + width] = cast(piece.reshape(rows, width), runs[0].dtype, dtype)
            column += width
        return self.write(out, dest), read

    def _copy(self, block: Block) -> tuple[list[Segment], list[SourceSegment]]:
        run, buffer = block.run, self._buffers.get()
        itemsize, out_itemsize = DTYPE_SIZES[run.dtype], DTYPE_SIZES[block.dtype]
        per_piece = PIECE_BYTES // itemsize
        written: list[Segment] = []
        read: list[SourceSegment] = []
        try:
            for start in range(block.start, block.start + block.numel, per_piece):
                numel = min(per_piece, block.start + block.numel - start)
                source = run.offset + start * itemsize
                dest = block.dest + (start - block.start) * out_itemsize
                raw = buffer[:numel * itemsize]
                self.sources.read(run.path, raw.data, source)
                if run.dtype == block.dtype:  # the output's CRCs are the source's
                    segments = self.write(raw, dest)
                    read += [(run.path, lo - dest + source, hi - dest + source, crc) for lo, hi, crc in segments]
                else:
                    read.append((run.path, source, source + raw.nbytes, crc32(raw)))
                    segments = self.write(cast(raw.view(NUMPY_DTYPES[run.dtype]), run.dtype, block.dtype), dest)
                written += segments
        finally:
            self._buffers.put(buffer)
        return written, read

    def write(self, data: np.ndarray, dest: int) -> list[Segment]:
        return write_array(self.out, data, dest)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def write_array(out: BinFile, data: np.ndarray, dest: int) -> list[Segment]:
    """Write `data` at byte `dest` of `out`; the CRC-32 of its pieces between chunk boundaries (each piece
    CRC'd and written in turn, while it is in the cache)."""
    raw = tensor_bytes(np.require(data, requirements="C"))
    segments = []
    for lo, hi in chunk_bounds(dest, dest + len(raw), out.chunk_bytes):
        piece = raw[lo - dest:hi - dest]
        segments.append((lo, hi, crc32(piece)))
        out.write(piece, lo)
    return segments


def copy_states(out: BinFile, params: tuple[ParamPlan, ...], slots: list[TensorSlot], strict: bool,
                after_state: Callable[[StateSource], None]) -> tuple[dict[str, StoredTensor], list[SourceSegment]]:
    """Write every state of `params` (in `slots` order) into `out`; where each landed, and the source
    segments read. `after_state(source)` runs once a state is written (progress)."""
    sources = Sources()
    copier = Copier(out, sources)
    pending: list[tuple[StateSource, str, int, int, list[Future], list[Segment]]] = []
    source_segments: list[SourceSegment] = []
    keys = iter(slots)
    try:
        for p in params:
            for source in p.states.values():
                slot = next(keys)
                begin = out.begins[slot.key]
                runs = state_runs(source, strict) if p.splits is None else None
                rows = row_parts(source, strict) if p.splits is None and runs is None else None
                if runs is not None:
                    futures = [copier.submit(b) for b in blocks(runs, begin, source.dtype)]
                elif rows is not None:
                    futures = [copier.submit_rows(rows, source.dtype, begin)]
                    runs = [run for _, part in rows for run in part]
                if runs is not None:  # copied (blocks or rows), not assembled
                    futures += [copier.submit_checksum(*unread) for unread in unread_bytes(source, runs)]
                    pending.append((source, slot.key, begin, begin + slot.nbytes, futures, []))
                else:
                    segments, read = _assembled(copier, p, source, begin, strict)
                    source_segments += read
                    pending.append((source, slot.key, begin, begin + slot.nbytes, [], segments))
        stored = {}
        for source, key, begin, end, futures, segments in pending:
            for future in futures:
                written, read = future.result()
                segments += written
                source_segments += read
            out.start_writeback(end)
            whole, chunks = join_segments(segments, begin, end, out.chunk_bytes)
            stored[key] = StoredTensor(key, begin, end, whole, tuple(chunks))
            after_state(source)
    finally:
        copier.close()
        sources.close()
    return stored, source_segments


def unread_bytes(source: StateSource, runs: list[Run]) -> list[tuple[str, int, int]]:
    """(path, begin, end) of the bytes of `source`'s fragments that `runs` leave out: the other copies of a
    replica, the padding past a state's last element. Checked all the same, on the copy threads, so that the
    driver has next to nothing left to read to check whole zip entries (`ucp.convert.source_check`)."""
    used = {(run.path, run.offset): run.numel * DTYPE_SIZES[run.dtype] for run in runs}  # runs start at pieces
    out = []
    for f in source.fragments:
        begin, end = f.piece.byte_offset, f.piece.byte_offset + f.piece.numel * DTYPE_SIZES[f.piece.dtype]
        begin += used.get((f.piece.path, begin), 0)
        if begin < end:
            out.append((f.piece.path, begin, end))
    return out


def _assembled(copier: Copier, p: ParamPlan, source: StateSource, begin: int,
               strict: bool) -> tuple[list[Segment], list[SourceSegment]]:
    """A state Union computes: its fragments read whole (and CRC'd), assembled, written at `begin`."""
    pieces = [read_fragment(f) for f in source.fragments]
    read = [(f.piece.path, f.piece.byte_offset, f.piece.byte_offset + piece.nbytes, crc32(tensor_bytes(piece)))
            for f, piece in zip(source.fragments, pieces)]
    tensor = assemble(source, pieces, name=p.name, strict=strict)
    if p.splits is not None:
        tensor = to_split_major(tensor, *p.splits)
    return copier.write(tensor, begin), read
