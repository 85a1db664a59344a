"""Where a checkpoint's files live: a local folder, a prefix of an S3-compatible object store, or a prefix of any
other filesystem fsspec has installed (gs://, az://, hdfs://, memory://, ...).

This is the one storage layer of the format (docs/ARCHITECTURE.md): readers and writers name a file by a
`Location` (a `Path`, or an `ObjectPath` for `scheme://bucket/prefix/...`) and call the functions here, each of
which hands the work to the location's `Store` (`store`), the one protocol every backend implements.
`store_of` is the one place that tells locations apart: a local path goes to `LocalStore` (`local`:
positional reads into the caller's buffer through `fileio`, no new import), a URL to a `RemoteStore`
(`remote`) over the backend of its scheme: `s3` for s3:// (which alone imports boto3, on first
use), `fsspec` for every other protocol (which alone imports fsspec). The interface is small: ranged reads
into a caller's buffer, the size of a file, whole small files, list, delete, writes at offsets into local files
(`write_ranges`: the host-memory tier's copies in /dev/shm, staging copies), writes that commit by order
(`write_whole` for the index and `latest`, written last; `upload_file` for data, multipart when large), uploads
several writers fill by parts (`start_upload` ... `complete_upload`), and readers' locks (`shared_lock`; an object
store has none). Callers never ask which kind of location they hold; where the work differs they ask what its
store can do: whether it is reached by requests (`is_remote`: no writes at offsets, renames or locks there; the
libraries that open local files read a local copy), takes locks (`has_locks`), and get it made absolute
(`absolute`) or its folder made (`make_folder`) by the storage.
"""
from __future__ import annotations

import functools
import json
import mmap
import os
from collections.abc import Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ucp.errors import CheckpointNotFoundError, CorruptCheckpointError
from ucp.storage.fileio import ReadCounter
from ucp.storage.fileio import fsync_dir as fsync_dir  # re-exported: `folder` gives it to the format's writers
from ucp.storage.local import PARTIAL_SUFFIX as PARTIAL_SUFFIX  # re-exported, as `fsync_dir`
from ucp.storage.local import LocalStore
from ucp.storage.locations import Location, ObjectPath
from ucp.storage.remote import RemoteStore
from ucp.storage.store import Store

if TYPE_CHECKING:
    from typing_extensions import TypeIs

T = TypeVar("T", bound=tuple[Any, ...])
_LOCAL: Store[Path] = LocalStore()


def store_of(location: Location | str | os.PathLike[str]) -> Store[Any]:
    """The store that holds `location`: anything but an `ObjectPath` (a `Path`, or a `str` from a caller outside
    ucp) is a local file; an `ObjectPath` goes to the backend of its scheme (`_remote`)."""
    if isinstance(location, ObjectPath):
        return _remote(location.scheme)
    return _LOCAL


@functools.cache
def _remote(scheme: str) -> Store[ObjectPath]:
    """The store of `scheme`'s URLs, one per scheme: boto3 for s3:// (chosen by measurement, benchmarks/README.md
    "Tiers"), fsspec for any other protocol `locations.location` accepted. Both are imported on first use."""
    if scheme == "s3":
        from ucp.storage import s3

        return RemoteStore(s3)
    from ucp.storage import fsspec as fsspec_backend

    return RemoteStore(fsspec_backend)


def is_remote(location: Location) -> TypeIs[ObjectPath]:
    """Whether `location` is in a store reached by requests, any of which may be slow or fail, rather than in
    this machine's file system. Such a store takes whole files and uploads: no writes at offsets, renames or
    locks, so a conversion to it is staged and uploaded, and DeepSpeed's torch files and Accelerate's and the
    Trainer's own files, which their libraries open as local files, are read from a local copy or folder."""
    return store_of(location).remote


def has_locks(location: Location) -> bool:
    """Whether readers' locks (`shared_lock`) are taken at `location`: in a local folder; an object store has none."""
    return store_of(location).locks


def absolute(location: Location) -> Location:
    """`location` independent of the working directory: a local path resolved, a URL as it is."""
    resolved: Location = store_of(location).absolute(location)
    return resolved


def make_folder(folder: Location) -> None:
    """Make `folder` and its parents where the storage keeps folders (locally); an object store's prefix needs no
    making, its objects make it."""
    store_of(folder).make_folder(folder)


def is_file(path: Location) -> bool:
    """Whether a file (an object) is at `path`."""
    return store_of(path).is_file(path)


def size(path: Location) -> int | None:
    """The size of file `path` in bytes, or None when there is none."""
    return store_of(path).size(path)


def read_small(path: Location, limit: int | None = None, follow: bool = True) -> bytes | None:
    """The whole content of file `path` (at most `limit` bytes, else refused unread), or None when there is none.
    Locally it must be a regular file (and, unless `follow`, not a symbolic link: `fileio.read_regular`)."""
    return store_of(path).read_small(path, limit, follow)


def read_file(path: Location, limit: int | None = None) -> bytes | None:
    """`read_small`, for a file that may be absent: None also where a local folder or a special file stands at
    `path` (an object store holds files only, so it is one request there)."""
    return store_of(path).read_file(path, limit)


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
    """Fill each (file, offset, buffer) with the file's bytes from offset, each store's reads in one call: local
    files are read in turn (the page cache makes that the fast path); objects by ranged GETs, a bounded number in
    flight. `counter` counts the bytes and one call per read."""
    for store, mine in _by_store(reads).items():
        store.read_many(mine)
    if counter is not None:
        for _, _, view in reads:
            if len(view):
                counter.bytes += len(view)
                counter.calls += 1


def write_ranges(writes: Sequence[tuple[Path, int, bytes | memoryview]], sync: bool = False) -> None:
    """Write each (local file, offset, bytes) in place, creating a missing file (sparse: a node's memory copy, a
    staging copy of data files being uploaded); then fsync each file when `sync`. Object storage takes no
    writes at offsets: it is written by whole objects and multipart uploads (`upload_file`, `write_whole`)."""
    for store, mine in _by_store(writes).items():
        store.write_ranges(mine, sync)


def _by_store(items: Sequence[T]) -> dict[Store[Any], list[T]]:
    """`items` (each naming its file first) grouped by the store that holds the file, in order."""
    groups: dict[Store[Any], list[T]] = {}
    for item in items:
        groups.setdefault(store_of(item[0]), []).append(item)
    return groups


def download(path: Location, target: Path) -> None:
    """Copy file `path` to local file `target` by ranged reads (in parallel from an object store), written in
    place through a memory map, so a file of any size costs no more memory than the parts in flight. The file
    takes the source's modification time where the store records one, so that what identifies a source by size
    and mtime (`convert`'s fingerprint) stays the same from one download to the next."""
    store = store_of(path)
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
    return store_of(folder).list_names(folder)


def write_whole(path: Location, data: bytes, durable: bool = True) -> None:
    """Write file `path` so that a reader sees its old bytes or the new ones, never a part: in an object store
    one PUT (so an index or `latest` commits by being written after every object it names: docs/FORMAT.md,
    "Object storage"); locally a temporary file renamed over it, with `durable` fsynced first and the folder
    after."""
    store_of(path).write_whole(path, data, durable)


def upload_file(source: Path, path: ObjectPath) -> None:
    """Upload local file `source` to `path`: multipart with parts in parallel when large, aborted on failure."""
    store_of(path).upload_file(source, path)


def abort_uploads(prefix: ObjectPath) -> int:
    """Abort the multipart uploads open under `prefix`, which a writer killed outright leaves; how many."""
    return store_of(prefix).abort_uploads(prefix)


def delete(path: Location) -> None:
    """Delete file `path`; none there is no error."""
    store_of(path).delete(path)


def part_bytes(folder: ObjectPath) -> int | None:
    """The size of the parts of an upload several writers share under `folder` (S3's multipart), or None where a
    file goes up whole, as one part (`Store`)."""
    return store_of(folder).part_bytes()


def start_upload(path: ObjectPath) -> str:
    """Open an upload of `path` that writers fill by parts; its id (`Store`)."""
    return store_of(path).start_upload(path)


def upload_parts(source: Path, path: ObjectPath, upload: str, parts: Sequence[tuple[int, int, int]]
                 ) -> list[dict[str, Any]]:
    """Upload each (part number, begin, end) of local file `source` as that part of `upload`, in parallel; each
    part's {"PartNumber", "ETag"} for `complete_upload`."""
    return store_of(path).upload_parts(source, path, upload, parts)


def complete_upload(path: ObjectPath, upload: str, parts: Sequence[dict[str, Any]]) -> None:
    """Complete `upload` from every writer's reported parts: the object `path` appears."""
    store_of(path).complete_upload(path, upload, parts)


def abort_upload(path: ObjectPath, upload: str) -> None:
    """Abort `upload`: nothing of it is left behind."""
    store_of(path).abort_upload(path, upload)


def list_folders(folder: Location) -> list[str]:
    """The names of the folders directly inside `folder` (the sub-prefixes of a prefix); [] when none. Local
    symbolic links to folders are left out."""
    return store_of(folder).list_folders(folder)


def delete_tree(folder: Location) -> None:
    """Delete every file under `folder` (every object under the prefix), then the folder itself where the
    storage keeps folders; best effort locally (what cannot be removed stays, as `rm -rf` leaves it)."""
    store_of(folder).delete_tree(folder)


def move_tree(source: Location, target: Location, last: str) -> None:
    """Move folder `source` to `target`. A local folder is renamed (atomic); an object store has no rename:
    every object under prefix `source` is copied to the same names under `target` (object `last`, the one that
    commits, after the others), then `source`'s objects are deleted, `last` first."""
    store = store_of(source)
    if store.remote != store_of(target).remote:
        raise ValueError(f"cannot move {source} to {target}: one is local, the other in object storage")
    store.move_tree(source, target, last)


def shared_lock(lock: Location) -> AbstractContextManager[None]:
    """Hold a shared lock on file `lock` (made if missing) while the block runs. Where none can be taken (an
    object store has no locks; a read-only folder) the block runs without it."""
    return store_of(lock).shared_lock(lock)


def exclusive_lock(lock: Location) -> AbstractContextManager[bool]:
    """Whether no `shared_lock` holds `lock` (asked without waiting); while True none can start until the block
    ends, and the lock file is removed then. True where there are no locks (an object store) or none can be
    taken."""
    return store_of(lock).exclusive_lock(lock)
