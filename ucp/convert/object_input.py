"""`ucp convert --input s3://bucket/prefix`: a DeepSpeed checkpoint in an object store, converted from a local
copy of the one checkpoint the conversion reads.

DeepSpeed's rank files are torch zip archives that the converters read as local files, so the source is first
copied into a staging folder ($UCP_STAGING_DIR, else the system's temporary folder; removed afterwards): the
objects directly under the prefix (`latest`, a Trainer's small files) and the one tag folder the conversion
takes, chosen as for a local folder (`--tag`, else `latest`, else a Trainer's last `checkpoint-N`). Other tag
folders are not copied: they appear as empty folders, so that a message listing the tags lists them all. Each
object comes down by ranged GETs in parallel and keeps its modification time, so converting the same prefix
again finds the conversion already done. The staging folder needs room for that one checkpoint.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ucp.converters.tag_folder import MODEL_FILE, OPTIM_FILE
from ucp.converters.trainer_folders import last_checkpoint
from ucp.errors import CheckpointNotFoundError, UcpError
from ucp.format.folder import check_tag, read_latest
from ucp.storage.layer import download, is_remote, list_folders, list_names
from ucp.storage.locations import Location, ObjectPath


@contextmanager
def local_source(source: Location, tag: str | None) -> Iterator[Path]:
    """The local folder of the DeepSpeed checkpoint at `source`, for the body to convert: `source` itself in a
    local folder; from a store, a local copy of the checkpoint that `tag` (or `latest`, ...) picks, and an error
    the body raises names `source`, not the staging folder."""
    if not is_remote(source):
        yield source
        return
    if tag is not None:
        check_tag(tag)
    with tempfile.TemporaryDirectory(prefix="ucp-input-", dir=os.environ.get("UCP_STAGING_DIR")) as staging:
        root = Path(staging) / (source.name or source.bucket)
        root.mkdir()
        try:
            _stage(source, root, tag)
            yield root
        except UcpError as exc:
            raise type(exc)(str(exc).replace(str(root), str(source))) from None


def _stage(source: ObjectPath, root: Path, tag: str | None) -> None:
    """Copy the objects directly under `source` into `root`, then the folder the conversion takes from it."""
    names, folders = list_names(source), list_folders(source)
    if not names and not folders:
        raise CheckpointNotFoundError(f"{source}: no objects under this prefix; pass the prefix that the "
                                      "folder given to engine.save_checkpoint (or a Trainer's output_dir) was "
                                      "uploaded to")
    for name in names:
        download(source / name, root / name)
    for name in folders:
        (root / name).mkdir()
    if tag is None and any(MODEL_FILE.match(n) or OPTIM_FILE.match(n) for n in names):
        return  # a tag folder itself
    if tag is None:
        tag = read_latest(root)
    if tag is None:
        last = last_checkpoint(root)
        tag = last.name if last is not None else None
    if tag in folders:
        _stage(source / tag, root / tag, None)
