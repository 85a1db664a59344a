"""`ObjectPath`: a file or prefix named by a URL (`s3://bucket/key`, `gs://...`), what a `Path` is to a local
folder. Its own module so that the stores (`s3`, `fsspec`) and `locations`, which asks
`fsspec` whether a protocol is installed, share it without an import cycle."""
from __future__ import annotations

from dataclasses import dataclass

from ucp.errors import redact


@dataclass(frozen=True)
class ObjectPath:
    """A file or prefix in an object store, `s3://bucket/key`, or in another fsspec filesystem
    (`gs://bucket/key`, `hdfs://namenode:8020/key`, `memory://bucket/key`): what a `Path` is to a local folder.

    It has no `__fspath__`, so no local file call can take it for a path by mistake. `str()` is the form shown
    to people (messages, logs, an index's recorded source): without credentials (`redact`); `url` is the form
    requests go to."""

    scheme: str
    bucket: str  # the URL's netloc: a bucket, or a host (and port); "" in hdfs:///path
    key: str  # no leading or trailing "/"; "" for the bucket's root

    @property
    def name(self) -> str:
        """The last part of the key, as `Path.name` ("" for the bucket's root)."""
        return self.key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> ObjectPath:
        """The prefix one level up, as `Path.parent` (the bucket's root is its own parent)."""
        return ObjectPath(self.scheme, self.bucket, self.key.rpartition("/")[0])

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(self.scheme, self.bucket, f"{self.key}/{name}" if self.key else str(name))

    @property
    def url(self) -> str:
        """The whole URL, credentials included: for the storage client only, never for a message."""
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    def __str__(self) -> str:
        return redact(self.url)

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"
