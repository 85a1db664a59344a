"""Where a checkpoint's files live: a local folder, a prefix of an S3-compatible object store, or a prefix of any
other filesystem fsspec has installed (gs://, az://, hdfs://, memory://, ...).

This is the one storage layer of the format (docs/ARCHITECTURE.md): readers and writers name a file by a
`Location` (a `Path`, or an `ObjectPath` for `scheme://bucket/prefix/...`) and call the functions here, which
take the local fast path (`fileio`: positional reads into the caller's buffer, no new import) or a store chosen by
the URL's scheme (`_store`): `object_store` for s3:// (which alone imports boto3, on first use), `fsspec_store` for
every other protocol (which alone imports fsspec). The interface is small: ranged reads into a
caller's buffer, the size of a file, whole small files, list, delete, writes at offsets into local files
(`write_ranges`: the host-memory tier's copies in /dev/shm, staging copies), writes that commit by order
(`write_whole` for the index and `latest`, written last; `upload_file` for data, multipart when large), uploads
several writers fill by parts (`start_upload` ... `complete_upload`), and readers' locks (`shared_lock`; an object
store has none). Callers never ask which kind of location they hold; where the work differs they ask what it can
do: whether it is reached by requests (`is_remote`: no writes at offsets, renames or locks there; the libraries
that open local files read a local copy), takes locks (`has_locks`), and get it made absolute (`absolute`) or its
folder made (`make_folder`) by the storage.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ucp.errors import CheckpointNotFoundError, CorruptCheckpointError
from ucp.format.fileio import ReadCounter, open_regular, read_exactly, read_regular, write_exactly
from ucp.format.locations import Location, ObjectPath

if TYPE_CHECKING:
    from typing_extensions import TypeIs

PARTIAL_SUFFIX = ".partial"  # a file being written under its final name plus this, renamed when whole


class Store(Protocol):
    """What a backend module gives for `ObjectPath`s (`object_store`, `fsspec_store`); errors are one line.

    Uploads several writers share: a file goes up in parts of `part_bytes()` (None: one part, the whole file),
    each (number, begin, end) of a local copy by whichever writer holds it, into an upload `start_upload` opened;
    the object appears at `complete_upload`, and `abort_upload` leaves nothing of it behind."""

    def size(self, path: ObjectPath) -> int | None: ...
    def read_object(self, path: ObjectPath, limit: int | None = None) -> bytes | None: ...
    def read_many(self, reads: Sequence[tuple[ObjectPath, int, memoryview]]) -> None: ...
    def stat(self, path: ObjectPath) -> tuple[int, int | None] | None: ...
    def list_names(self, folder: ObjectPath) -> list[str]: ...
    def list_folders(self, folder: ObjectPath) -> list[str]: ...
    def list_tree(self, folder: ObjectPath) -> list[str]: ...
    def put_bytes(self, path: ObjectPath, data: bytes) -> None: ...
    def upload_file(self, source: Path, path: ObjectPath) -> None: ...
    def abort_uploads(self, prefix: ObjectPath) -> int: ...
    def delete(self, path: ObjectPath) -> None: ...
    def remove_folder(self, folder: ObjectPath) -> None: ...
    def copy(self, source: ObjectPath, target: ObjectPath) -> None: ...
    def part_bytes(self) -> int | None: ...
    def start_upload(self, path: ObjectPath) -> str: ...
    def upload_parts(self, source: Path, path: ObjectPath, upload: str, parts: Sequence[tuple[int, int, int]]
                     ) -> list[dict[str, Any]]: ...
    def complete_upload(self, path: ObjectPath, upload: str, parts: Sequence[dict[str, Any]]) -> None: ...
    def abort_upload(self, path: ObjectPath, upload: str) -> None: ...


def _store(path: ObjectPath) -> Store:
    """The backend of `path`'s scheme: boto3 for s3:// (chosen by measurement, benchmarks/README.md "Tiers"),
    fsspec for any other protocol `locations.location` accepted. Both are imported on first use."""
    if path.scheme == "s3":
        from ucp.format import object_store

        return object_store
    from ucp.format import fsspec_store

    return fsspec_store


def is_remote(location: Location) -> TypeIs[ObjectPath]:
    """Whether `location` is in a store reached by requests, any of which may be slow or fail, rather than in
    this machine's file system. Such a store takes whole files and uploads: no writes at offsets, renames or
    locks, so a conversion to it is staged and uploaded, and DeepSpeed's torch files and Accelerate's and the
    Trainer's own files, which their libraries open as local files, are read from a local copy or folder."""
    return isinstance(location, ObjectPath)


def has_locks(location: Location) -> bool:
    """Whether readers' locks (`shared_lock`) are taken at `location`: in a local folder; an object store has none."""
    return not isinstance(location, ObjectPath)


def absolute(location: Location) -> Location:
    """`location` independent of the working directory: a local path resolved, a URL as it is."""
    return location if isinstance(location, ObjectPath) else location.resolve()


def make_folder(folder: Location) -> None:
    """Make `folder` and its parents where the storage keeps folders (locally); an object store's prefix needs no
    making, its objects make it."""
    if not isinstance(folder, ObjectPath):
        folder.mkdir(parents=True, exist_ok=True)


def is_file(path: Location) -> bool:
    """Whether a file (an object) is at `path`."""
    if isinstance(path, ObjectPath):
        return _store(path).size(path) is not None
    return path.is_file()


def size(path: Location) -> int | None:
    """The size of file `path` in bytes, or None when there is none."""
    if isinstance(path, ObjectPath):
        return _store(path).size(path)
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return None


def read_small(path: Location, limit: int | None = None, follow: bool = True) -> bytes | None:
    """The whole content of file `path` (at most `limit` bytes, else refused unread), or None when there is none.
    Locally it must be a regular file (and, unless `follow`, not a symbolic link: `fileio.read_regular`)."""
    if isinstance(path, ObjectPath):
        return _store(path).read_object(path, limit)
    if not os.path.lexists(path):
        return None
    return read_regular(str(path), follow=follow, limit=limit)


def read_file(path: Location, limit: int | None = None) -> bytes | None:
    """`read_small`, for a file that may be absent: None also where a local folder or a special file stands at
    `path` (an object store holds files only, so it is one request there)."""
    if not isinstance(path, ObjectPath) and not path.is_file():
        return None
    return read_small(path, limit)


def read_json(path: Location, limit: int, fix: str) -> object | None:
    """The JSON value of small file `path` (a manifest, a progress record), or None when there is none: read as
    `read_small` reads it, never through a symbolic link and never more than `limit` bytes (a FIFO, `/dev/zero`
    or a link out of the folder is refused, not waited on or followed). Anything that is not one JSON value is a
    `CorruptCheckpointError` naming the file; `fix` ends the message."""
    raw = read_small(path, limit=limit, follow=False)
    if raw is None:
        return None
    try:
        value: object = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise CorruptCheckpointError(f"{path}: not a JSON file ({type(exc).__name__}); {fix}") from None
    return value


def read_ranges(reads: Sequence[tuple[Location, int, memoryview]], counter: ReadCounter | None = None) -> None:
    """Fill each (file, offset, buffer) with the file's bytes from offset. Local files are read in turn (the
    page cache makes that the fast path); objects by ranged GETs, a bounded number in flight. `counter` counts
    the bytes and one call per read. Anything that is not an `ObjectPath` (a `Path`, or a `str` from a caller
    outside ucp) is a local file."""
    objects = [(p, offset, view) for p, offset, view in reads if isinstance(p, ObjectPath) and len(view)]
    for scheme in sorted({p.scheme for p, _, _ in objects}):
        mine = [read for read in objects if read[0].scheme == scheme]
        _store(mine[0][0]).read_many(mine)
    for p, offset, view in reads:
        if not isinstance(p, ObjectPath) and len(view):
            fd = open_regular(os.fspath(p))
            try:
                read_exactly(fd, str(p), view, offset)
            finally:
                os.close(fd)
        if counter is not None and len(view):
            counter.bytes += len(view)
            counter.calls += 1


def write_ranges(writes: Sequence[tuple[Path, int, bytes | memoryview]], sync: bool = False) -> None:
    """Write each (local file, offset, bytes) in place, creating a missing file (sparse: a node's memory copy, a
    staging copy of data files being uploaded); then fsync each file when `sync`. Object storage takes no
    writes at offsets: it is written by whole objects and multipart uploads (`upload_file`, `write_whole`)."""
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


def download(path: ObjectPath, target: Path) -> None:
    """Copy object `path` to local file `target` by ranged reads in parallel, written in place through a memory
    map, so a file of any size costs no more memory than the parts in flight. The file takes the object's
    modification time where the store records one, so that what identifies a source by size and mtime
    (`convert`'s fingerprint) stays the same from one download to the next."""
    import mmap

    store = _store(path)
    found = store.stat(path)
    if found is None:
        raise CheckpointNotFoundError(f"{path}: no such object (it was listed a moment ago; is something deleting "
                                      "the prefix?)")
    nbytes, mtime_ns = found
    with open(target, "wb+") as f:
        f.truncate(nbytes)
        if nbytes:
            with mmap.mmap(f.fileno(), nbytes) as mapped:
                view = memoryview(mapped)
                try:
                    store.read_many([(path, 0, view)])
                finally:
                    view.release()
    if mtime_ns is not None:
        os.utime(target, ns=(mtime_ns, mtime_ns))


def list_names(folder: Location) -> list[str]:
    """The names of the files directly inside `folder` (objects directly under the prefix); [] when none."""
    if isinstance(folder, ObjectPath):
        return _store(folder).list_names(folder)
    return os.listdir(folder) if folder.is_dir() else []


def write_whole(path: Location, data: bytes, durable: bool = True) -> None:
    """Write file `path` so that a reader sees its old bytes or the new ones, never a part: in an object store
    one PUT (so an index or `latest` commits by being written after every object it names: docs/FORMAT.md,
    "Object storage"); locally a temporary file renamed over it, with `durable` fsynced first and the folder
    after."""
    if isinstance(path, ObjectPath):
        _store(path).put_bytes(path, data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + PARTIAL_SUFFIX)
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
    if durable:
        fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def upload_file(source: Path, path: ObjectPath) -> None:
    """Upload local file `source` to `path`: multipart with parts in parallel when large, aborted on failure."""
    _store(path).upload_file(source, path)


def abort_uploads(prefix: ObjectPath) -> int:
    """Abort the multipart uploads open under `prefix`, which a writer killed outright leaves; how many."""
    return _store(prefix).abort_uploads(prefix)


def delete(path: Location) -> None:
    """Delete file `path`; none there is no error."""
    if isinstance(path, ObjectPath):
        _store(path).delete(path)
    else:
        path.unlink(missing_ok=True)


def part_bytes(folder: ObjectPath) -> int | None:
    """The size of the parts of an upload several writers share under `folder` (S3's multipart), or None where a
    file goes up whole, as one part (`Store`)."""
    return _store(folder).part_bytes()


def start_upload(path: ObjectPath) -> str:
    """Open an upload of `path` that writers fill by parts; its id (`Store`)."""
    return _store(path).start_upload(path)


def upload_parts(source: Path, path: ObjectPath, upload: str, parts: Sequence[tuple[int, int, int]]
                 ) -> list[dict[str, Any]]:
    """Upload each (part number, begin, end) of local file `source` as that part of `upload`, in parallel; each
    part's {"PartNumber", "ETag"} for `complete_upload`."""
    return _store(path).upload_parts(source, path, upload, parts)


def complete_upload(path: ObjectPath, upload: str, parts: Sequence[dict[str, Any]]) -> None:
    """Complete `upload` from every writer's reported parts: the object `path` appears."""
    _store(path).complete_upload(path, upload, parts)


def abort_upload(path: ObjectPath, upload: str) -> None:
    """Abort `upload`: nothing of it is left behind."""
    _store(path).abort_upload(path, upload)


def list_folders(folder: Location) -> list[str]:
    """The names of the folders directly inside `folder` (the sub-prefixes of a prefix); [] when none. Local
    symbolic links to folders are left out."""
    if isinstance(folder, ObjectPath):
        return _store(folder).list_folders(folder)
    if not folder.is_dir():
        return []
    return [p.name for p in folder.iterdir() if p.is_dir() and not p.is_symlink()]


def delete_tree(folder: Location) -> None:
    """Delete every file under `folder` (every object under the prefix), then the folder itself where the
    storage keeps folders; best effort locally (what cannot be removed stays, as `rm -rf` leaves it)."""
    if not isinstance(folder, ObjectPath):
        shutil.rmtree(folder, ignore_errors=True)
        return
    store = _store(folder)
    for name in store.list_tree(folder):
        store.delete(folder / name)
    store.remove_folder(folder)


def move_tree(source: Location, target: Location, last: str) -> None:
    """Move folder `source` to `target`. A local folder is renamed (atomic); an object store has no rename:
    every object under prefix `source` is copied to the same names under `target` (object `last`, the one that
    commits, after the others), then `source`'s objects are deleted, `last` first."""
    if not isinstance(source, ObjectPath) or not isinstance(target, ObjectPath):
        if isinstance(source, ObjectPath) or isinstance(target, ObjectPath):
            raise ValueError(f"cannot move {source} to {target}: one is local, the other in object storage")
        source.rename(target)
        return
    store = _store(source)
    names = sorted(store.list_tree(source), key=lambda n: n == last)
    for name in names:
        store.copy(source / name, target / name)
    for name in reversed(names):
        store.delete(source / name)
    store.remove_folder(source)


@contextmanager
def shared_lock(lock: Location) -> Iterator[None]:
    """Hold a shared lock on file `lock` (made if missing) while the block runs. Where none can be taken (an
    object store has no locks; a read-only folder) the block runs without it."""
    if isinstance(lock, ObjectPath) or (fd := _open_lock(lock)) is None:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


@contextmanager
def exclusive_lock(lock: Location) -> Iterator[bool]:
    """Whether no `shared_lock` holds `lock` (asked without waiting); while True none can start until the block
    ends, and the lock file is removed then. True where there are no locks (an object store) or none can be
    taken."""
    if isinstance(lock, ObjectPath) or (fd := _open_lock(lock)) is None:
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


def _open_lock(lock: Path) -> int | None:
    try:
        return os.open(lock, os.O_RDONLY | os.O_CREAT, 0o644)
    except OSError:
        return None
