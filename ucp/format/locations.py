"""Locations of a checkpoint's files: a local `Path`, or an `ObjectPath` for `s3://bucket/prefix/...`; a URL is
never taken for a local path."""
from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from ucp.errors import UnsupportedStorageError

OBJECT_SCHEMES = ("s3",)
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")  # scheme://..., as s3://bucket/prefix or gs://...
# Where a URL is accepted (issue #22); the other entry points name this list when they refuse one.
URL_ENTRY_POINTS = ("ucp convert --input and --output, ucp inspect, ucp verify, ucp export --input and --output, "
                    "ucp.open_checkpoint, "
                    "ucp.deepspeed.load and ucp.deepspeed.save (also as \"ucp\": {\"load\": ...} and "
                    "{\"save\": {\"dir\": ...}}, \"auto\" and \"keep\" included), "
                    "ucp.transformers.train(resume_from_checkpoint=...) and ucp.accelerate.load_state (the ucp "
                    "checkpoint, not Accelerate's own folder)")


@dataclass(frozen=True)
class ObjectPath:
    """A file or prefix in an object store, `s3://bucket/key`: what a `Path` is to a local folder.

    It has no `__fspath__`, so no local file call can take it for a path by mistake."""

    scheme: str
    bucket: str
    key: str  # no leading or trailing "/"; "" for the bucket's root

    @property
    def name(self) -> str:
        """The last part of the key, as `Path.name` ("" for the bucket's root)."""
        return self.key.rsplit("/", 1)[-1]

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(self.scheme, self.bucket, f"{self.key}/{name}" if self.key else str(name))

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"


Location = Union[Path, ObjectPath]


def url_scheme(text: str) -> str | None:
    """The scheme of `text` when it is a URL (`scheme://` at its very start), else None."""
    match = _URL.match(text)
    return match.group(1) if match else None


def location(path: str | os.PathLike[str] | ObjectPath) -> Location:
    """`path` as a local `Path` or, for `s3://bucket/prefix`, an `ObjectPath`; any other URL is refused in one
    line (taken for a path, `gs://bucket/run` would read or write a local folder named `gs:`)."""
    if isinstance(path, ObjectPath):
        return path
    text = os.fspath(path)
    scheme = url_scheme(text)
    if scheme is None:
        return Path(text)
    if scheme.lower() not in OBJECT_SCHEMES:
        raise UnsupportedStorageError(f"{text}: ucp reads local folders and s3:// URLs, not {scheme}:// ones; copy "
                                      "the checkpoint to a local folder or an S3-compatible bucket, or mount the "
                                      "storage and pass the mount's path")
    bucket, _, key = text[len(scheme) + 3:].partition("/")
    if not bucket:
        raise UnsupportedStorageError(f"{text}: names no bucket; write s3://BUCKET/PREFIX")
    if not _installed("boto3"):
        raise UnsupportedStorageError(f"{text}: object storage needs boto3, which is not installed; pip install "
                                      "boto3, or copy the checkpoint to a local folder")
    return ObjectPath(scheme.lower(), bucket, key.strip("/"))


def _installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it (a local checkpoint never needs boto3)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (blocked)
        return False


def local_only(path: str | os.PathLike[str] | ObjectPath, entry_point: str) -> Path:
    """`path` as a local Path, for `entry_point`, which does not take object storage yet: a URL is refused in one
    line that says where URLs work."""
    place = location(path)
    if isinstance(place, ObjectPath):
        raise UnsupportedStorageError(f"{place}: {entry_point} takes local (or mounted) folders only so far; s3:// "
                                      f"works with {URL_ENTRY_POINTS}; copy the checkpoint to a local folder or "
                                      "mount the bucket (e.g. mountpoint-s3) and pass the mount's path")
    return place
