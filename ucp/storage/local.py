"""Local files as a `Store`: positional reads and writes through `fileio` (no new import: the fast path),
atomic writes by a temporary file renamed over the old one, renames, and readers' locks (flock).

Its uploads are the local equivalent of a multipart upload: the parts are written at their offsets into
`<name>.partial`, which `complete_upload` fsyncs and renames into place, so a reader sees the whole file or
none, as on S3.
"""
from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ucp.storage.fileio import fsync_dir, open_regular, read_exactly, read_regular, write_exactly

PARTIAL_SUFFIX = ".partial"  # a file being written under its final name plus this, renamed when whole
_COPY_BYTES = 8 << 20  # an upload's parts are copied this much at a time


def partial(path: Path) -> Path:
    """Where `path` is written before it is renamed into place."""
    return path.with_name(path.name + PARTIAL_SUFFIX)


class LocalStore:
    """The `Store` of this machine's file system. A `str` path is taken as a `Path` where it is read."""

    remote = False
    locks = True

    def absolute(self, location: Path) -> Path:
        return location.resolve()

    def make_folder(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)

    def is_file(self, path: Path) -> bool:
        return path.is_file()

    def size(self, path: Path) -> int | None:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return None

    def stat(self, path: Path) -> tuple[int, int | None] | None:
        try:
            found = path.stat()
        except FileNotFoundError:
            return None
        return found.st_size, found.st_mtime_ns

    def read_small(self, path: Path, limit: int | None = None, follow: bool = True) -> bytes | None:
        """It must be a regular file (and, unless `follow`, not a symbolic link: `fileio.read_regular`)."""
        if not os.path.lexists(path):
            return None
        return read_regular(str(path), follow=follow, limit=limit)

    def read_file(self, path: Path, limit: int | None = None) -> bytes | None:
        """None also where a folder or a special file stands at `path`."""
        if not path.is_file():
            return None
        return self.read_small(path, limit)

    def read_many(self, reads: Sequence[tuple[Path, int, memoryview]]) -> None:
        """In turn: the page cache makes that the fast path."""
        for path, offset, view in reads:
            if not len(view):
                continue
            fd = open_regular(os.fspath(path))
            try:
                read_exactly(fd, str(path), view, offset)
            finally:
                os.close(fd)

    def list_names(self, folder: Path) -> list[str]:
        return os.listdir(folder) if folder.is_dir() else []

    def list_folders(self, folder: Path) -> list[str]:
        """Symbolic links to folders are left out."""
        if not folder.is_dir():
            return []
        return [p.name for p in folder.iterdir() if p.is_dir() and not p.is_symlink()]

    def write_whole(self, path: Path, data: bytes, durable: bool = True) -> None:
        """A temporary file renamed over `path`, with `durable` fsynced first and the folder after."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = partial(path)
        with open(tmp, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)

    def write_ranges(self, writes: Sequence[tuple[Path, int, bytes | memoryview]], sync: bool = False) -> None:
        """In place, creating a missing file (sparse); then fsync each file when `sync`."""
        fds: dict[Path, int] = {}
        try:
            for path, offset, data in writes:
                if path not in fds:
                    fds[path] = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
                write_exactly(fds[path], memoryview(data).cast("B"), offset)
            if sync:
                for fd in fds.values():
                    os.fsync(fd)
        finally:
            for fd in fds.values():
                os.close(fd)

    def delete(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def delete_tree(self, folder: Path) -> None:
        """Best effort: what cannot be removed stays, as `rm -rf` leaves it."""
        shutil.rmtree(folder, ignore_errors=True)

    def move_tree(self, source: Path, target: Path, last: str) -> None:
        """A rename, atomic: no object needs to go `last`."""
        source.rename(target)

    @contextmanager
    def shared_lock(self, lock: Path) -> Iterator[None]:
        """Without a lock where none can be taken (a read-only folder)."""
        fd = _open_lock(lock)
        if fd is None:
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            yield
        finally:
            os.close(fd)

    @contextmanager
    def exclusive_lock(self, lock: Path) -> Iterator[bool]:
        """True where none can be taken; the lock file is removed when the block ends."""
        fd = _open_lock(lock)
        if fd is None:
            yield True
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            yield False
            return
        try:
            yield True
            lock.unlink(missing_ok=True)
        finally:
            os.close(fd)

    def upload_file(self, source: Path, path: Path) -> None:
        """A durable copy: one part into `<name>.partial`, fsynced and renamed; removed on failure."""
        upload = self.start_upload(path)
        try:
            self.upload_parts(source, path, upload, [(1, 0, source.stat().st_size)])
            self.complete_upload(path, upload, [])
        except BaseException:
            self.abort_upload(path, upload)
            raise

    def abort_uploads(self, prefix: Path) -> int:
        """Remove the partial files under `prefix`, which a writer killed outright leaves; how many."""
        found = list(prefix.rglob("*" + PARTIAL_SUFFIX)) if prefix.is_dir() else []
        for path in found:
            path.unlink(missing_ok=True)
        return len(found)

    def part_bytes(self) -> None:
        """None: a local file goes up as one part, its copy is no faster cut."""
        return None

    def start_upload(self, path: Path) -> str:
        """An empty `<name>.partial`; its name is the upload's id."""
        path.parent.mkdir(parents=True, exist_ok=True)
        target = partial(path)
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        return target.name

    def upload_parts(self, source: Path, path: Path, upload: str, parts: Sequence[tuple[int, int, int]]
                     ) -> list[dict[str, Any]]:
        """Copy each (number, begin, end) byte range of `source` into the partial file at `begin`."""
        src = open_regular(os.fspath(source))
        try:
            dst = os.open(partial(path), os.O_WRONLY)
            try:
                for _, begin, end in parts:
                    _copy_range(src, str(source), dst, begin, end)
            finally:
                os.close(dst)
        finally:
            os.close(src)
        return [{"PartNumber": number, "ETag": ""} for number, _, _ in parts]

    def complete_upload(self, path: Path, upload: str, parts: Sequence[dict[str, Any]]) -> None:
        """fsync the partial file, rename it into place, fsync the folder."""
        fd = os.open(partial(path), os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(partial(path), path)
        fsync_dir(path.parent)

    def abort_upload(self, path: Path, upload: str) -> None:
        partial(path).unlink(missing_ok=True)


def _copy_range(src: int, name: str, dst: int, begin: int, end: int) -> None:
    """Bytes [begin, end) of open file `name` (`src`) into `dst` at the same offsets."""
    buffer = memoryview(bytearray(min(_COPY_BYTES, end - begin)))
    for lo in range(begin, end, _COPY_BYTES):
        view = buffer[:min(_COPY_BYTES, end - lo)]
        read_exactly(src, name, view, lo)
        write_exactly(dst, view, lo)


def _open_lock(lock: Path) -> int | None:
    try:
        return os.open(lock, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return None
