"""Positional reads into preallocated tensors (torch or numpy), with a counter of what touched storage."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, Union

import numpy as np

from ucp.errors import CheckpointNotFoundError, CorruptCheckpointError, OutputExistsError

if TYPE_CHECKING:
    import torch

ArrayT = TypeVar("ArrayT", bound=Union["torch.Tensor", np.ndarray])
_held_locks: set[int] = set()  # descriptors of the output folders this process holds locked
MAPPED_BUFFER_BYTES = 1 << 20  # read buffers this large get memory of their own (`read_buffer`)


def read_buffer(nbytes: int) -> torch.Tensor:
    """An uninitialised uint8 tensor of `nbytes` to read into. From 1 MiB on it is anonymous memory mapped for it
    alone, which goes back to the system as soon as the last tensor viewing it is freed: a load reads many
    buffers of a few MiB to tens of MiB one after the other, and glibc serves blocks of up to 32 MiB from its heap
    once it has freed blocks that size (its mmap threshold follows the blocks freed), and seldom gives that
    memory back, so a heap-allocated load kept hundreds of MiB it no longer used."""
    import torch

    if nbytes < MAPPED_BUFFER_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # the tensor keeps the mapping alive


@contextlib.contextmanager
def writing_alone(folder: Path) -> Iterator[None]:
    """Hold an exclusive lock on output `folder` (created if need be) while a conversion writes into it.

    A second ucp process that wants to write there is refused at once instead of interleaving its
    files with ours. The lock is the kernel's (flock on the folder itself), so it goes with the
    process; forked workers drop their inherited copy (`drop_inherited_locks`), so a worker still
    exiting never holds the folder after its driver is gone.
    """
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise OutputExistsError(f"{folder}: another ucp process is writing into it; wait for it to finish, "
                                    "or choose another output folder") from None
        _held_locks.add(fd)
        yield
    finally:
        _held_locks.discard(fd)
        os.close(fd)


def drop_inherited_locks() -> None:
    """In a forked worker: close the lock descriptors inherited from the driver (the driver keeps its lock)."""
    for fd in list(_held_locks):
        os.close(fd)
    _held_locks.clear()


class ReadCounter:
    """Counts bytes and read calls, so tests and benchmarks can see what touched storage."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0


def tensor_bytes(t: torch.Tensor | np.ndarray) -> memoryview:
    """The raw little-endian bytes of a contiguous CPU tensor or numpy array, without a copy."""
    flat = t.reshape(-1)
    if flat.shape[0] == 0:
        return memoryview(b"")
    if isinstance(flat, np.ndarray):
        return flat.view(np.uint8).data
    import torch

    return flat.view(torch.uint8).numpy().data


def open_regular(path: str, follow: bool = True) -> int:
    """A read-only descriptor of `path`, which must be a regular file (and, unless `follow`, not a symlink).

    O_NONBLOCK: opening a FIFO planted where a data file belongs returns at once instead of waiting
    for a writer forever; it is then refused as not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: missing; restore the file from the checkpoint's copy") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow:
            raise CorruptCheckpointError(f"{path}: a symbolic link stands where a file of the checkpoint belongs; "
                                         "ucp reads only the folder's own regular files, restore the file from "
                                         "a copy") from None
        raise CorruptCheckpointError(f"{path}: cannot be opened ({exc.strerror})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(f"{path}: not a regular file; a special file stands where checkpoint data "
                                     "belongs, restore the file from a copy")
    return fd


def oversized(path: object, nbytes: int, limit: int) -> CorruptCheckpointError:
    """The one line for a whole-file read refused unread (its size known from a stat, a HEAD or a GET's headers,
    before any byte of its body): the file, its size and the bound (docs/FORMAT.md names each)."""
    return CorruptCheckpointError(f"{path}: {nbytes} bytes, more than the {limit} bytes ucp reads for this file "
                                  "(docs/FORMAT.md, \"Bounds\"); it is not the file ucp expects here, or, for a "
                                  "larger ucp_index.json than any known model's, raise $UCP_INDEX_MAX_BYTES")


def read_regular(path: str, follow: bool = True, limit: int | None = None) -> bytes:
    """The whole content of regular file `path` (a FIFO or device is refused, never waited on; a symlink too
    unless `follow`); a file of more than `limit` bytes is refused unread."""
    fd = open_regular(path, follow)
    try:
        if limit is not None and os.fstat(fd).st_size > limit:
            raise oversized(path, os.fstat(fd).st_size, limit)
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def read_exactly(fd: int, path: str, view: memoryview, offset: int) -> None:
    """Fill `view` with the bytes of open file `path` (`fd`) from `offset`; a file that ends first is truncated."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise CorruptCheckpointError(f"{path}: ends at byte {offset + done}, expected at least "
                                         f"{offset + len(view)}; the file is truncated, copy it again")
        done += got


def write_exactly(fd: int, data: memoryview, offset: int, chunk: int | None = None) -> None:
    """Write all of `data` into open file `fd` at `offset` (`os.pwrite` may write less than asked), at most
    `chunk` bytes a call when given."""
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:done + chunk] if chunk else data[done:], offset + done)


def fsync_dir(directory: Path) -> None:
    """fsync `directory` itself, so that a file renamed or created in it survives a crash."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pread_into(path: str, out: ArrayT, offset: int, counter: ReadCounter | None = None) -> ArrayT:
    """Fill contiguous `out` with the bytes of `path` starting at `offset`; returns `out`."""
    view = tensor_bytes(out)
    if len(view) == 0:
        return out
    fd = open_regular(path)
    try:
        read_exactly(fd, path, view, offset)
    finally:
        os.close(fd)
    if counter is not None:
        counter.bytes += len(view)
        counter.calls += 1
    return out
