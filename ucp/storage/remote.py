"""A store reached by requests as a `Store`: what every such store does the same way, written once over a
`Backend`, the module that makes its requests (`s3`: boto3 for s3://; `fsspec`: any other
fsspec protocol). It holds files only: no folders to make, no writes at offsets, no renames (a folder moves by
copies), no locks.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from ucp.errors import UnsupportedStorageError
from ucp.storage.object_path import ObjectPath


class Backend(Protocol):
    """What a backend module gives for `ObjectPath`s (`s3`, `fsspec`); errors are one line.
    Its uploads are `Store`'s."""

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


class RemoteStore:
    """The `Store` of the `ObjectPath`s one `Backend` serves."""

    remote = True
    locks = False

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def absolute(self, location: ObjectPath) -> ObjectPath:
        return location

    def make_folder(self, folder: ObjectPath) -> None:
        """Nothing: a prefix needs no making, its objects make it."""

    def is_file(self, path: ObjectPath) -> bool:
        return self.backend.size(path) is not None

    def size(self, path: ObjectPath) -> int | None:
        return self.backend.size(path)

    def stat(self, path: ObjectPath) -> tuple[int, int | None] | None:
        return self.backend.stat(path)

    def read_small(self, path: ObjectPath, limit: int | None = None, follow: bool = True) -> bytes | None:
        """One GET; there are no symbolic links to follow."""
        return self.backend.read_object(path, limit)

    def read_file(self, path: ObjectPath, limit: int | None = None) -> bytes | None:
        """One GET: the store holds files only."""
        return self.backend.read_object(path, limit)

    def read_many(self, reads: Sequence[tuple[ObjectPath, int, memoryview]]) -> None:
        """Ranged GETs, a bounded number in flight."""
        self.backend.read_many(reads)

    def list_names(self, folder: ObjectPath) -> list[str]:
        return self.backend.list_names(folder)

    def list_folders(self, folder: ObjectPath) -> list[str]:
        return self.backend.list_folders(folder)

    def write_whole(self, path: ObjectPath, data: bytes, durable: bool = True) -> None:
        """One PUT, so an index or `latest` commits by being written after every object it names
        (docs/FORMAT.md, "Object storage")."""
        self.backend.put_bytes(path, data)

    def write_ranges(self, writes: Sequence[tuple[ObjectPath, int, bytes | memoryview]], sync: bool = False
                     ) -> None:
        """Refused: objects are written whole and by uploads (`write_whole`, `upload_file`)."""
        if writes:
            raise UnsupportedStorageError(f"{writes[0][0]}: object storage takes no writes at offsets; write a "
                                          "local file and upload it")

    def delete(self, path: ObjectPath) -> None:
        self.backend.delete(path)

    def delete_tree(self, folder: ObjectPath) -> None:
        """Every object under the prefix, then what the store keeps of the folder (HDFS, a mounted folder)."""
        for name in self.backend.list_tree(folder):
            self.backend.delete(folder / name)
        self.backend.remove_folder(folder)

    def move_tree(self, source: ObjectPath, target: ObjectPath, last: str) -> None:
        """There is no rename: every object under `source` is copied to the same names under `target` (object
        `last`, the one that commits, after the others), then `source`'s objects are deleted, `last` first."""
        names = sorted(self.backend.list_tree(source), key=lambda n: n == last)
        for name in names:
            self.backend.copy(source / name, target / name)
        for name in reversed(names):
            self.backend.delete(source / name)
        self.backend.remove_folder(source)

    @contextmanager
    def shared_lock(self, lock: ObjectPath) -> Iterator[None]:
        """No lock to take: the block runs at once."""
        yield

    @contextmanager
    def exclusive_lock(self, lock: ObjectPath) -> Iterator[bool]:
        """No lock to wait for: True at once."""
        yield True

    def upload_file(self, source: Path, path: ObjectPath) -> None:
        self.backend.upload_file(source, path)

    def abort_uploads(self, prefix: ObjectPath) -> int:
        return self.backend.abort_uploads(prefix)

    def part_bytes(self) -> int | None:
        return self.backend.part_bytes()

    def start_upload(self, path: ObjectPath) -> str:
        return self.backend.start_upload(path)

    def upload_parts(self, source: Path, path: ObjectPath, upload: str, parts: Sequence[tuple[int, int, int]]
                     ) -> list[dict[str, Any]]:
        return self.backend.upload_parts(source, path, upload, parts)

    def complete_upload(self, path: ObjectPath, upload: str, parts: Sequence[dict[str, Any]]) -> None:
        self.backend.complete_upload(path, upload, parts)

    def abort_upload(self, path: ObjectPath, upload: str) -> None:
        self.backend.abort_upload(path, upload)
