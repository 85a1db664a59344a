"""Any other storage a user has an fsspec filesystem for (`gs://` with gcsfs, `az://` with adlfs, `hdfs://`,
`memory://`, ...): the storage layer's third backend, and the only module of `ucp.format` that imports fsspec (on
first use of such a URL). `s3://` stays on boto3 (`s3`, chosen by measurement: benchmarks/README.md).

Credentials and options come from the filesystem's own configuration (its package's environment variables and
files, or fsspec's config: `FSSPEC_<PROTOCOL>_<OPTION>` variables, ~/.config/fsspec/); they are never put into an
error (an error names the exception's type, not its text, which may carry a signed URL). Reads are ranged
(`cat_file` with start and end), each range cut into parts of `part_bytes()` that run concurrently, at most
`max_in_flight()` at once per process, as for s3://. A request that fails on the way (timed out, cut, reset, a
5xx) is tried again by ucp's network policy (`net`), on top of whatever retries the filesystem has; http(s)://
gets the connect and read timeouts of `net.timeout_s()`. A small
object is written in one call (`pipe_file`), which an object store (GCS, Azure) makes visible whole or not at
all; a file system without atomic writes (HDFS, a mounted folder) is not: the index and `latest` still commit by
being written last, but a reader racing the write can see a partial one, which its checks then refuse. There are
no multipart uploads to abort.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from ucp.errors import CheckpointNotFoundError, CorruptCheckpointError, StorageAccessError, UcpError
from ucp.storage import net
from ucp.storage.fileio import oversized
from ucp.storage.object_path import ObjectPath
from ucp.storage.s3 import cut_parts, max_in_flight, wait_all

T = TypeVar("T")
_lock = threading.Lock()
_pools: dict[int, ThreadPoolExecutor] = {}  # one per process (a forked worker makes its own)


def protocol_problem(scheme: str) -> str | None:
    """Why URLs of `scheme` cannot be used here (fsspec missing, a protocol it does not know, or one whose package
    is not installed, as its ImportError says), or None when they can."""
    try:
        import fsspec
    except ImportError:
        return f"{scheme}:// URLs need fsspec (and the package of the {scheme} filesystem), which is not installed"
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError as exc:  # fsspec knows the protocol; its package is missing, and the message names it
        return f"fsspec's {scheme}:// filesystem is not installed ({str(exc).splitlines()[0] if str(exc) else exc})"
    except ValueError:
        return f"{scheme}:// is no protocol fsspec knows"
    return None


def _options(scheme: str) -> dict[str, Any]:
    """The options ucp gives the filesystem: for http(s)://, aiohttp's connect and read timeouts of
    `net.timeout_s()` in place of its default (5 minutes in all, none per read); other filesystems keep their
    own (gcsfs, adlfs, ... configure theirs)."""
    if scheme not in ("http", "https"):
        return {}
    import aiohttp

    seconds = net.timeout_s()
    return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, sock_connect=seconds,
                                                                sock_read=seconds)}}


def _fs(path: ObjectPath) -> tuple[Any, str]:
    """The filesystem of `path` (fsspec caches the instance, per options) and the path it takes. Not through
    `fsspec.core.url_to_fs`, which takes every "::" for a chain (`locations` refuses chained URLs): an IPv6
    host, http://[::1]:8080/run, is one URL."""
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(path.scheme)
        options = {**cls._get_kwargs_from_urls(path.url), **_options(path.scheme)}
        return fsspec.filesystem(path.scheme, **options), cls._strip_protocol(path.url)
    except Exception as exc:  # noqa: BLE001  # e.g. zip:// or cached:// without the options they need
        raise StorageAccessError(f"{path}: fsspec cannot open the {path.scheme}:// filesystem "
                                 f"({type(exc).__name__}); check its options (fsspec's config, FSSPEC_"
                                 f"{path.scheme.upper()}_* variables) and credentials") from None


def _pool() -> ThreadPoolExecutor:
    with _lock:
        if os.getpid() not in _pools:
            _pools[os.getpid()] = ThreadPoolExecutor(max_in_flight(), thread_name_prefix="ucp-fsspec")
        return _pools[os.getpid()]


def _error(exc: BaseException, path: ObjectPath, doing: str) -> UcpError:
    """One line naming `path` and the fix; the exception's type, never its text (it may carry credentials)."""
    if isinstance(exc, PermissionError):
        return StorageAccessError(f"{path}: access refused while {doing}; give the {path.scheme}:// filesystem its "
                                  "credentials as its fsspec package documents")
    return StorageAccessError(f"{path}: {doing} failed ({type(exc).__name__}); check the storage, its credentials "
                              "and the network, then run the command again")


def _transient(exc: BaseException) -> bool:
    """Whether a request failed on the way (timed out, cut, reset, a 5xx or 429), not on the file: tried again.
    http(s)://'s aiohttp errors are told by their module, so that this module need not import aiohttp."""
    if isinstance(exc, (UcpError, FileNotFoundError, PermissionError)):
        return False
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return True
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return status >= 500 or status == 429
    return type(exc).__module__.partition(".")[0] == "aiohttp"  # payload cut short, server disconnected, ...


def _call(path: ObjectPath, doing: str, request: Callable[[], T]) -> T:
    """`request()`, retried by the network policy (`net.retrying`); any failure as one line."""
    try:
        return net.retrying(path, doing, request, _transient)
    except UcpError:
        raise
    except Exception as exc:  # noqa: BLE001  # any filesystem's failure becomes one line
        raise _error(exc, path, doing) from None


def _info(path: ObjectPath) -> dict[str, Any] | None:
    """The filesystem's record of file `path`, or None when there is no file there (a folder is no file)."""
    fs, p = _fs(path)

    def request() -> dict[str, Any] | None:
        try:
            info = fs.info(p)
        except FileNotFoundError as exc:
            if exc.__cause__ is not None and net.is_timeout(exc.__cause__):  # http's HEAD, then GET, got no answer
                raise exc.__cause__ from None
            return None
        return info if info.get("type") == "file" else None

    return _call(path, "reading its size", request)


def size(path: ObjectPath) -> int | None:
    info = _info(path)
    return None if info is None else int(info["size"])


def read_object(path: ObjectPath, limit: int | None = None) -> bytes | None:
    """The whole object (refused unread when larger than `limit`), or None when there is none."""
    nbytes = size(path)
    if nbytes is None:
        return None
    if limit is not None and nbytes > limit:
        raise oversized(path, nbytes, limit)
    fs, p = _fs(path)

    def request() -> bytes | None:
        try:
            return bytes(fs.cat_file(p))
        except FileNotFoundError:
            return None

    return _call(path, "reading it", request)


def _get_range(path: ObjectPath, view: memoryview, offset: int) -> None:
    """Fill `view` with bytes [offset, offset + len(view)) of the object by ranged reads (`net.fill`: a read
    that fails on the way is asked for again; fsspec's `cat_file` gives all of a range or nothing)."""
    fs, p = _fs(path)

    def request(begin: int, end: int) -> list[bytes]:
        try:
            data = fs.cat_file(p, start=begin, end=end)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: no such object (the index names it); upload the checkpoint "
                                          "again") from None
        if len(data) > end - begin:  # an HTTP server's 200 with the whole object
            raise StorageAccessError(f"{path}: the server ignores Range requests (it answered a read of bytes "
                                     f"[{begin}, {end}) with {len(data)} bytes); serve the checkpoint from a server "
                                     "that answers them with 206, or copy it to a local folder")
        if len(data) < end - begin:
            raise CorruptCheckpointError(f"{path}: ends at byte {begin + len(data)}, expected at least {end}; the "
                                         "object is truncated, upload it again")
        return [data]

    try:
        net.fill(path, view, offset, request, _transient)
    except UcpError:
        raise
    except Exception as exc:  # noqa: BLE001  # any filesystem's failure becomes one line
        raise _error(exc, path, f"reading bytes [{offset}, {offset + len(view)})") from None


def read_many(reads: Sequence[tuple[ObjectPath, int, memoryview]]) -> None:
    """Fill each (object, offset, buffer): every range cut into parts, all parts concurrently (bounded)."""
    pool = _pool()
    wait_all([pool.submit(_get_range, path, view[lo:hi], offset + lo)
              for path, offset, view in reads for lo, hi in cut_parts(len(view))])


def stat(path: ObjectPath) -> tuple[int, int | None] | None:
    """The file's size and modification time (ns; None where the filesystem records none), or None when there is
    no such file."""
    info = _info(path)
    if info is None:
        return None
    fs, p = _fs(path)
    try:
        mtime_ns = int(fs.modified(p).timestamp() * 1_000_000_000)
    except Exception:  # noqa: BLE001  # NotImplementedError, or no time recorded
        mtime_ns = None
    return int(info["size"]), mtime_ns


def _entries(folder: ObjectPath, kind: str) -> list[str]:
    """The names of the entries of type `kind` ("file", "directory") directly inside `folder`; [] when none."""
    fs, p = _fs(folder)

    def request() -> list[str]:
        try:
            entries = fs.ls(p, detail=True)
        except FileNotFoundError:
            return []
        root = fs._strip_protocol(p).rstrip("/")
        return [fs._strip_protocol(e["name"]).rstrip("/").rsplit("/", 1)[-1] for e in entries
                if e.get("type") == kind and fs._strip_protocol(e["name"]).rstrip("/") != root]

    return _call(folder, "listing it", request)


def list_names(folder: ObjectPath) -> list[str]:
    return _entries(folder, "file")


def list_folders(folder: ObjectPath) -> list[str]:
    return _entries(folder, "directory")


def list_tree(folder: ObjectPath) -> list[str]:
    """The names, relative to `folder` ("a/b"), of every file under it at any depth."""
    fs, p = _fs(folder)
    root = fs._strip_protocol(p).rstrip("/") + "/"

    def request() -> list[str]:
        try:
            found = fs.find(p)
        except FileNotFoundError:
            return []
        return [name[len(root):] for name in map(fs._strip_protocol, found) if name.startswith(root)]

    return _call(folder, "listing it", request)


def _writing(path: ObjectPath, doing: str, write: Callable[[Any, str], None]) -> None:
    """`write(fs, p)`; when the filesystem wants the parent folder to exist first (HDFS, local), it is made and
    the write is tried once more. A missing bucket is refused, not made (an object store's `makedirs` would
    create a bucket named by a typo)."""
    fs, p = _fs(path)
    root = _fs(ObjectPath(path.scheme, path.bucket, ""))[1]  # the bucket; "" for a host's file system (HDFS)

    def request() -> None:
        try:
            write(fs, p)
        except FileNotFoundError:
            if root.strip("/") and not fs.exists(root):
                raise StorageAccessError(f"{path}: '{path.bucket}' does not exist; create it, or correct the "
                                         "URL") from None
            fs.makedirs(fs._parent(p), exist_ok=True)
            write(fs, p)

    _call(path, doing, request)


def put_bytes(path: ObjectPath, data: bytes) -> None:
    _writing(path, "writing it", lambda fs, p: fs.pipe_file(p, data))


def upload_file(source: Path, path: ObjectPath) -> None:
    """Upload `source` to `path` (the filesystem's own upload: an object store's resumable or block upload); a
    failed upload's object is removed, as far as the filesystem allows."""
    try:
        _writing(path, "uploading it", lambda fs, p: fs.put_file(os.fspath(source), p))
    except BaseException:
        try:
            delete(path)
        except Exception:  # noqa: BLE001  # the upload's own error says what went wrong
            pass
        raise


def delete(path: ObjectPath) -> None:
    fs, p = _fs(path)

    def request() -> None:
        try:
            fs.rm_file(p)
        except FileNotFoundError:  # as S3's DELETE of a missing key
            pass

    _call(path, "deleting it", request)


def remove_folder(folder: ObjectPath) -> None:
    """Remove what is left of `folder` once its files are deleted: the empty folders a file system keeps (local,
    HDFS); an object store keeps none."""
    fs, p = _fs(folder)

    def request() -> None:
        if fs.isdir(p):
            fs.rm(p, recursive=True)

    _call(folder, "removing it", request)


def copy(source: ObjectPath, target: ObjectPath) -> None:
    """Copy an object inside the filesystem (server side where it can)."""
    if (source.scheme, source.bucket) != (target.scheme, target.bucket):
        raise StorageAccessError(f"{source}: cannot be copied to {target}, another filesystem")
    _writing(target, f"copying {source} to it", lambda fs, p: fs.copy(_fs(source)[1], p))


def part_bytes() -> None:
    """None: an fsspec filesystem has no upload several writers share (S3's multipart is `s3`'s), so a
    file goes up whole, as the one part of its upload."""
    return None


def start_upload(path: ObjectPath) -> str:
    """"": nothing to open; the one part's upload writes the file (`upload_parts`)."""
    return ""


def upload_parts(source: Path, path: ObjectPath, upload: str, parts: Sequence[tuple[int, int, int]]
                 ) -> list[dict[str, Any]]:
    """Write `source` whole to `path`: the one part (1, 0, its size) a file has here (`part_bytes`)."""
    nbytes = source.stat().st_size
    if list(parts) != [(1, 0, nbytes)]:
        raise StorageAccessError(f"{path}: written whole here, as part (1, 0, {nbytes}); got parts {list(parts)}")
    upload_file(source, path)
    return [{"PartNumber": 1, "ETag": ""}]


def complete_upload(path: ObjectPath, upload: str, parts: Sequence[dict[str, Any]]) -> None:
    """Nothing to complete: the file was written whole by its part's upload."""


def abort_upload(path: ObjectPath, upload: str) -> None:
    """Remove what the upload wrote, if anything."""
    delete(path)


def abort_uploads(prefix: ObjectPath) -> int:
    """0: a filesystem's uploads are its own; none is left open under `prefix` for ucp to abort."""
    return 0
