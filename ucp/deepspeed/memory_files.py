"""The host-memory tier's configuration and the files of a node's copy (`ucp.deepspeed.memory_tier`).

A node's copy of a memory checkpoint is a checkpoint folder whose data files are sparse: they hold the byte
ranges of the saving ranks its manifest, `ucp_memory.json`, lists under "holds" (saving rank -> [file, begin,
end] ranges), besides every data file's header ("files": name, size, header bytes). The manifest also names
the tag, step, the index's fingerprint (the copies of one save agree on it) and the saving group's size.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucp.elastic.resume import tag_step
from ucp.errors import ConfigError, UnsupportedStorageError
from ucp.format.folder import INDEX_NAME, PARTIAL_SUFFIX, fsync_dir, local_path
from ucp.format.locations import url_scheme

logger = logging.getLogger("ucp.save")
MANIFEST_NAME = "ucp_memory.json"


@dataclass(frozen=True)
class MemoryEvery:
    """The `"memory"` section of `"ucp": {"save": ...}`: a memory save after every `every`-th step, each node
    keeping copies of `replicas` other nodes' pieces, in `dir` (expanded on each node)."""

    every: int
    replicas: int
    dir: str

    @classmethod
    def from_config(cls, options: object, save_dir: str) -> MemoryEvery:
        example = '{"every": 50, "replicas": 1}'
        if not isinstance(options, dict):
            raise ConfigError(f'"ucp": {{"save": {{"memory": {options!r}}}}}: must be an object such as {example}')
        unknown = set(options) - {"every", "replicas", "dir"}
        if unknown:
            raise ConfigError(f'"ucp": {{"save": {{"memory": ...}}}}: unknown key {sorted(unknown)[0]!r}; known: '
                              '"every", "replicas", "dir"')
        every, replicas = options.get("every"), options.get("replicas", 1)
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"every": {every!r}}}}}}}: must be a positive number '
                              f"of optimizer steps, e.g. {example}")
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"replicas": {replicas!r}}}}}}}: must be the number of '
                              "other nodes that keep a copy of each node's pieces, 0 or more (1 survives the loss "
                              "of any one node)")
        folder = options.get("dir")
        if folder is None:
            named = save_dir if url_scheme(save_dir) else os.path.abspath(save_dir)  # s3://...: the same on every node
            job = hashlib.sha256(named.encode()).hexdigest()[:12]
            folder = f"/dev/shm/ucp-{job}"
        try:
            if not isinstance(folder, (str, os.PathLike)):
                raise TypeError(folder)
            local_path(folder)
        except (TypeError, UnsupportedStorageError):
            raise ConfigError(f'"ucp": {{"save": {{"memory": {{"dir": {folder!r}}}}}}}: must be a local folder in '
                              'host memory, e.g. "/dev/shm/ucp-myjob"') from None
        return cls(every, replicas, os.fspath(folder))

    @property
    def path(self) -> Path:
        """This node's memory folder."""
        return Path(os.path.expanduser(os.path.expandvars(self.dir))).resolve()


def node_key(folder: Path) -> str:
    """What the ranks of one node share: the host and its memory folder."""
    return f"{socket.gethostname()}:{folder}"


def write_manifest(tag_dir: Path, manifest: dict[str, Any]) -> None:
    """Write `ucp_memory.json` atomically (temp file, fsync, rename)."""
    tmp = tag_dir / (MANIFEST_NAME + PARTIAL_SUFFIX)
    with open(tmp, "w") as f:
        json.dump(manifest, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tag_dir / MANIFEST_NAME)
    fsync_dir(tag_dir)


def read_copies(folder: Path) -> dict[str, dict[str, Any]]:
    """The manifests of this node's committed memory checkpoints, by tag (unreadable ones left out)."""
    out: dict[str, dict[str, Any]] = {}
    if not folder.is_dir():
        return out
    for tag in folder.iterdir():
        if tag_step(tag) < 0 or not (tag / INDEX_NAME).is_file():
            continue
        try:
            out[tag.name] = json.loads((tag / MANIFEST_NAME).read_text())
        except (OSError, ValueError):
            logger.warning("ucp: %s: no readable %s; not used", tag, MANIFEST_NAME)
    return out
