"""Locations of a checkpoint's files: a local `Path`, or an `ObjectPath` for `s3://bucket/prefix/...` or any
other protocol an installed fsspec filesystem serves; a URL is never taken for a local path."""
from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path
from typing import Union

from ucp.errors import UnsupportedStorageError, redact
from ucp.storage.object_path import ObjectPath as ObjectPath  # re-exported: where every caller takes it from

OBJECT_SCHEMES = ("s3",)
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")  # scheme://..., as s3://bucket/prefix or gs://...
_CHAINED = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*::")  # fsspec's chained URLs: simplecache::gs://bucket/run
_BRACKETED = re.compile(r"\[[^\]/]*\]")  # an IPv6 host, http://[::1]:8080/run, whose "::" chains nothing
# Where a URL is accepted (issue #22); the other entry points name this list when they refuse one.
URL_ENTRY_POINTS = ("s3:// and the protocols of any fsspec filesystem installed (gs://, az://, hdfs://, ...) with "
                    "ucp convert --input and --output, ucp inspect, ucp verify, ucp export --input and --output, "
                    "ucp.open_checkpoint, "
                    "ucp.deepspeed.load and ucp.deepspeed.save (also as \"ucp\": {\"load\": ...} and "
                    "{\"save\": {\"dir\": ...}}, \"auto\" and \"keep\" included), "
                    "ucp.transformers.train(resume_from_checkpoint=...) and ucp.accelerate.load_state (the ucp "
                    "checkpoint, not Accelerate's own folder)")


Location = Union[Path, ObjectPath]


def url_scheme(text: str) -> str | None:
    """The scheme of `text` when it is a URL (`scheme://` at its very start), else None."""
    match = _URL.match(text)
    return match.group(1) if match else None


def location(path: str | os.PathLike[str] | ObjectPath) -> Location:
    """`path` as a local `Path` or, for `s3://bucket/prefix` and any other protocol an installed fsspec filesystem
    serves (`gs://bucket/prefix` with gcsfs, `hdfs://namenode/path`, `memory://...`), an `ObjectPath`;
    `file:///abs/path` is the local path `/abs/path`. Any other URL is refused in one line (taken for a path,
    `gs://bucket/run` would read or write a local folder named `gs:`)."""
    if isinstance(path, (Path, ObjectPath)):  # already resolved
        return path
    text = os.fspath(path)
    scheme = url_scheme(text)
    shown = redact(text)  # every message names the URL without its credentials
    unbracketed = _BRACKETED.sub("", text)
    if "::" in unbracketed and "://" in text and (scheme is not None or _CHAINED.match(text)):
        raise UnsupportedStorageError(f"{shown}: chained fsspec URLs (a::b://...) are not taken; pass the URL of "
                                      "the storage itself (gs://bucket/run1) or a local copy")
    if scheme is None:
        return Path(text)
    scheme = scheme.lower()
    netloc, _, key = text[len(scheme) + 3:].partition("/")
    if scheme == "file":
        if netloc not in ("", "localhost") or not key:
            raise UnsupportedStorageError(f"{shown}: a file:// URL names a local path as file:///ABSOLUTE/PATH; "
                                          "or pass the path itself")
        return Path("/" + key)
    if scheme in OBJECT_SCHEMES:
        if not netloc:
            raise UnsupportedStorageError(f"{shown}: names no bucket; write s3://BUCKET/PREFIX")
        if "@" in netloc:
            raise UnsupportedStorageError(f"{shown}: credentials in an s3:// URL are not taken (nor shown); write "
                                          "s3://BUCKET/PREFIX and give them through the standard AWS chain "
                                          "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance "
                                          "role)")
        if not _installed("boto3"):
            raise UnsupportedStorageError(f"{shown}: object storage needs boto3, which is not installed; pip install "
                                          "boto3, or copy the checkpoint to a local folder")
        return ObjectPath(scheme, netloc, key.strip("/"))
    from ucp.storage.fsspec import protocol_problem

    problem = protocol_problem(scheme)
    if problem is not None:
        raise UnsupportedStorageError(f"{shown}: {problem}; ucp reads local folders, s3:// URLs and the URLs of any "
                                      "fsspec filesystem installed: install it, copy the checkpoint to a local "
                                      "folder or a bucket, or mount the storage and pass the mount's path")
    if not netloc and not key.strip("/"):
        raise UnsupportedStorageError(f"{shown}: names no bucket nor path; write {scheme}://BUCKET/PREFIX")
    return ObjectPath(scheme, netloc, key.strip("/"))


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
        raise UnsupportedStorageError(f"{place}: {entry_point} takes local (or mounted) folders only so far; URLs: "
                                      f"{URL_ENTRY_POINTS}; copy the checkpoint to a local folder or "
                                      "mount the bucket (e.g. mountpoint-s3) and pass the mount's path")
    return place
