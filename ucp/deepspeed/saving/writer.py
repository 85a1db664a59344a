"""The host side of an asynchronous save: snapshot into a reusable buffer, write it in the background.

A rank's pieces (its runs of elements of each tensor) are packed into one host buffer in file
order, so pieces that are adjacent in a data file are adjacent in the buffer and leave in one
large `pwrite`. The buffer is allocated once, at the size of this rank's share, and reused by every
save; a save waits for the previous one to finish writing before it overwrites the buffer.

Why a thread and not a writer process: the snapshot is already in this process's memory, and the
writer spends its time in `os.pwrite`, `os.fsync` and `crc32`, which all release the GIL on
large buffers, so a thread overlaps with training as well as a process would, without a shared
memory segment to size, pin, and clean up after a crash. (On GPU the device-to-host copies go to
pinned memory on the training stream, and the writer waits on a CUDA event, not on training.)
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ucp.deepspeed.saving.files import SaveFile, WrittenPiece
from ucp.errors import SaveError
from ucp.format.crc import CHUNK_BYTES, chunk_bounds, crc32
from ucp.format.folder import PARTIAL_SUFFIX
from ucp.format.safetensors_stream import TORCH_DTYPES
from ucp.storage.fileio import tensor_bytes, write_exactly

logger = logging.getLogger("ucp.save")


@dataclass(frozen=True)
class SavePiece:
    """Elements [start, start + numel) of tensor `key`, stored as `dtype` at bytes [begin, end) of `file`."""

    key: str
    file: str
    begin: int
    end: int
    dtype: str
    start: int

    @property
    def numel(self) -> int:
        return (self.end - self.begin) // TORCH_DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class Run:
    """Pieces [first, stop) (buffer order), contiguous in `file`: bytes [begin, end), at `offset` in the buffer."""

    file: str
    begin: int
    end: int
    offset: int
    first: int
    stop: int


class SnapshotBuffer:
    """One host buffer holding every piece of this rank, in file order, reused save after save."""

    def __init__(self, pieces: Sequence[SavePiece], pin: bool = False):
        self.pieces = sorted(pieces, key=lambda p: (p.file, p.begin))
        self.offsets = []
        self.runs: list[Run] = []
        total = 0
        for i, p in enumerate(self.pieces):
            self.offsets.append(total)
            last = self.runs[-1] if self.runs else None
            if last is not None and last.file == p.file and last.end == p.begin:
                self.runs[-1] = Run(p.file, last.begin, p.end, last.offset, last.first, i + 1)
            else:
                self.runs.append(Run(p.file, p.begin, p.end, total, i, i + 1))
            total += p.end - p.begin
        self.data = torch.empty(total, dtype=torch.uint8, pin_memory=pin)
        self.data.zero_()  # touch every page now, not during the first snapshot

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def fill(self, sources: Sequence[torch.Tensor]) -> None:
        """Copy each live flat tensor into its piece (same order as `pieces`); asynchronous from a GPU."""
        if len(sources) != len(self.pieces):
            raise ValueError(f"{len(sources)} sources for {len(self.pieces)} pieces")
        for i, source in enumerate(sources):
            self.fill_pieces(i, i + 1, source)

    def fill_pieces(self, first: int, stop: int, source: torch.Tensor) -> None:
        """Copy one live flat tensor into pieces [first, stop), which lie back to back in the buffer (the rows of
        a box that one rank writes, each its own piece of the file, are one run of its shard)."""
        end = self.offsets[stop - 1] + self.pieces[stop - 1].end - self.pieces[stop - 1].begin
        slot = self.data.narrow(0, self.offsets[first], end - self.offsets[first])
        slot = slot.view(TORCH_DTYPES[self.pieces[first].dtype])
        slot.copy_(source, non_blocking=slot.is_pinned())



def partial_path(directory: Path, file: str) -> Path:
    return directory / (file + PARTIAL_SUFFIX)


def write_pieces(directory: Path, files: Sequence[SaveFile], buffer: SnapshotBuffer, *, headers: bool
                 ) -> list[WrittenPiece]:
    """pwrite this rank's pieces (and with `headers` every file's header) into `<file>.partial`; fsync.

    Every rank opens the shared partial files without truncating them; the rank writing headers
    also sets each file's final size, which leaves in place what another rank already wrote. Each
    run goes out in chunks, each checksummed right before it is written, so the buffer is read from
    memory once. The files are durable on this rank's side when this returns.
    """
    names = {f.name for f in files} if headers else {r.file for r in buffer.runs}
    fds = {}
    try:
        for name in sorted(names):
            fds[name] = os.open(partial_path(directory, name), os.O_WRONLY | os.O_CREAT, 0o644)
        if headers:
            for f in files:
                os.ftruncate(fds[f.name], f.size)
                _pwrite_all(fds[f.name], memoryview(f.header), 0)
        segments: list[list[list[int]]] = [[] for _ in buffer.pieces]
        view = tensor_bytes(buffer.data)
        for run in buffer.runs:
            size = run.end - run.begin
            for lo in range(run.offset, run.offset + size, _CHUNK):
                hi = min(lo + _CHUNK, run.offset + size)
                for i in range(run.first, run.stop):
                    a = max(lo, buffer.offsets[i])
                    b = min(hi, buffer.offsets[i] + buffer.pieces[i].end - buffer.pieces[i].begin)
                    if a < b:
                        _checksum(segments[i], view[a:b], buffer.pieces[i].begin + a - buffer.offsets[i])
                _pwrite_all(fds[run.file], view[lo:hi], run.begin + lo - run.offset)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    return [WrittenPiece(p.key, p.begin, p.end, tuple((lo, hi, crc) for lo, hi, crc in segs))
            for p, segs in zip(buffer.pieces, segments)]


def _checksum(segments: list[list[int]], data: memoryview, begin: int) -> None:
    """Add `data`, stored from file offset `begin` on, to a piece's checksummed segments: one per chunk
    (`ucp.format.crc.chunk_bounds`), a segment continued while the bytes stay in its chunk."""
    for lo, hi in chunk_bounds(begin, begin + len(data), CHUNK_BYTES):
        part = data[lo - begin:hi - begin]
        last = segments[-1] if segments else None
        if last is not None and last[1] == lo and lo % CHUNK_BYTES:
            last[1], last[2] = hi, crc32(part, last[2])
        else:
            segments.append([lo, hi, crc32(part)])


_CHUNK = 4 << 20  # bytes checksummed then written at a time: still in cache when the kernel copies them


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Every write of a save's data files goes through here (tests/support/save_faults.py wraps it to fail or
    hold a writer mid-save)."""
    write_exactly(fd, data, offset, _CHUNK)


class BackgroundSave:
    """At most one save in flight: a writer thread per save, its failure kept for the next call.

    A new save waits for the previous one to finish writing: the snapshot buffer is reused, so memory
    stays at one snapshot whatever the save frequency. The first such wait is a warning, later ones are
    counted at info level (`stalls`), so that saving every step does not flood the log.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._label = ""
        self._error: BaseException | None = None
        self.stalls = 0

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, label: str, work: Callable[[], None]) -> None:
        """Run `work` in the background once the previous save is done (raises its failure, if any)."""
        self.wait_turn(label)
        self._label = label
        self._thread = threading.Thread(target=self._run, args=(work,), name=f"ucp-save-{label}", daemon=True)
        self._thread.start()

    def wait_turn(self, label: str) -> None:
        """`wait`, saying in the log when the save in flight holds up save `label`."""
        if self.busy:
            self.stalls += 1
            logger.log(logging.WARNING if self.stalls == 1 else logging.INFO,
                       "ucp: save %s waits for save %s, which is still writing (one save is in flight at a time; "
                       "save less often to avoid this stall; said once, then counted at info level)", label,
                       self._label)
        self.wait()

    def wait(self) -> None:
        """Block until the save in flight is durable; raise `SaveError` if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if isinstance(error, SaveError):
            raise error
        if error is not None:
            raise SaveError(f"save {self._label} failed: {type(error).__name__}: {error}") from error

    def _run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:  # kept and raised to the training thread by the next start/wait
            logger.error("ucp: save %s failed: %s", self._label, exc)
            self._error = exc
