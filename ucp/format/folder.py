"""The atomic checkpoint format: names, the JSON index, and its atomic commit.

See docs/FORMAT.md for the specification. A directory is a ucp checkpoint exactly when it holds a
complete `ucp_index.json`; the index is written last, to a temporary name, fsynced, and renamed.
A save directory holds one checkpoint per tag and a `latest` file naming the newest committed one,
replaced atomically only after that checkpoint's index is committed. In an object store (`ucp.storage.layer`)
there is no rename: the index object is written after every data object, and `latest` after the index, each in
one request, so a checkpoint is committed by the order its objects are written in.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote

from ucp.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
)
from ucp.format.index import Index, index_json, parse_index
from ucp.storage.layer import PARTIAL_SUFFIX as PARTIAL_SUFFIX  # re-exported: the format's names live here
from ucp.storage.layer import exclusive_lock, is_file, list_names, read_file, read_small, shared_lock, write_whole
from ucp.storage.layer import fsync_dir as fsync_dir
from ucp.storage.locations import Location, ObjectPath, local_only, location

INDEX_NAME = "ucp_index.json"
DATA_PREFIX = "data-"
LATEST_NAME = "latest"
LATEST_MAX_BYTES = 4096  # a tag name; DeepSpeed writes e.g. "global_step1000"
# The largest index read ($UCP_INDEX_MAX_BYTES): parsing costs about 7x its size in memory, so a hostile one is
# refused unread. A 1-trillion-parameter model with Adam states writes about 300 MiB (docs/FORMAT.md, "Bounds").
INDEX_MAX_BYTES = 512 << 20


def local_path(path: str | os.PathLike[str] | ObjectPath, entry_point: str = "this command") -> Path:
    """`path` as a local Path for an entry point that takes no object storage yet (`storage.local_only`): taken
    for a path, `s3://bucket/run` would read or write a local folder named `s3:` and report success."""
    return local_only(path, entry_point)


def data_file_name(i: int, n: int) -> str:
    return f"{DATA_PREFIX}{i:05d}-of-{n:05d}.safetensors"


def tensor_key(name: str, state: str) -> str:
    """The safetensors key of one state of one parameter."""
    return f"{name}:{state}"


def is_ucp_file(name: str) -> bool:
    """Whether ucp itself writes files of this name into a checkpoint directory."""
    return name == INDEX_NAME or name.startswith(DATA_PREFIX) or name.startswith(INDEX_NAME)


def commit_index(directory: str | os.PathLike[str] | ObjectPath, index: Index) -> Location:
    """Write the index whole and durably (`write_whole`); call it once every data file is written."""
    final = location(directory) / INDEX_NAME
    write_whole(final, (json.dumps(index_json(index), indent=1, sort_keys=False) + "\n").encode())
    return final


def commit_latest(save_dir: str | os.PathLike[str] | ObjectPath, tag: str) -> None:
    """Point `<save_dir>/latest` at `tag` atomically; call only once that tag's index is committed."""
    write_whole(location(save_dir) / LATEST_NAME, tag.encode())


def latest_checkpoint(save_dir: str | os.PathLike[str] | ObjectPath) -> Location | None:
    """The committed ucp checkpoint `<save_dir>/latest` names, or None when there is none."""
    tag = read_latest(save_dir)
    if tag is None:
        return None
    folder = location(save_dir) / tag
    return folder if is_file(folder / INDEX_NAME) else None


def read_latest(save_dir: str | os.PathLike[str] | ObjectPath) -> str | None:
    """The tag `<save_dir>/latest` names, or None when there is no `latest`.

    `latest` is a regular file (as `engine.save_checkpoint` and `commit_latest` write it) holding the name of
    a folder inside `save_dir`. Anything else is refused, its content never echoed into the message: a
    symbolic link (which may reach any file on the machine, never read), a special file, binary or multi-line
    text, an absolute path or one that climbs out with `..` (which would load another run's checkpoint).
    """
    pointer = location(save_dir) / LATEST_NAME
    raw = read_small(pointer, limit=LATEST_MAX_BYTES, follow=False)
    if raw is None:
        return None
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        tag = ""
    if not plain_tag(tag):
        raise CorruptCheckpointError(f"{pointer}: does not hold the name of a tag folder inside {save_dir} "
                                     f"({len(raw)} bytes that are not one); write the tag's name into it, or "
                                     "pass the tag folder itself (--tag)")
    return tag


def plain_tag(tag: str) -> bool:
    """Whether `tag` names one folder directly inside a save folder: a printable single name, also once
    percent-decoded (a web server or object store decodes `%2e%2e` to `..` and `%2f` to `/`), so neither `.`,
    `..`, empty, nor holding `/`, `\\` or NUL. Anything else would read another folder than the one named:
    `%2e%2e/other/global_step3` over http(s):// verified and loaded another run's checkpoint."""
    decoded = tag
    for _ in range(3):  # %252e%252e -> %2e%2e -> ..
        decoded = unquote(decoded)
    return (bool(tag) and tag.isprintable() and decoded.isprintable() and decoded not in (".", "..")
            and not any(c in decoded for c in "/\\"))


def check_tag(tag: str) -> str:
    """`tag` as given by a caller (`--tag`, `tag=`) when `plain_tag`, else one line saying what a tag is."""
    if not plain_tag(tag):
        raise CheckpointNotFoundError(f"tag {tag!r}: not the name of a tag folder (one plain name, such as "
                                      "global_step100: no '/', '\\', '.', '..' nor their %-escapes); pass the name "
                                      "of a folder inside the save folder")
    return tag


def _lock_path(directory: Location) -> Location:
    """The lock file of a tag folder: beside it, so that reading never writes into a checkpoint."""
    return directory.parent / f".{directory.name}.lock"


@contextmanager
def reading(directory: Location) -> Iterator[None]:
    """Hold a shared lock on a checkpoint folder while reading it, so retention (`"keep"`) leaves it alone.

    Where the lock cannot be taken (a read-only folder, an object store, which has no locks), the read goes on
    without it."""
    with shared_lock(_lock_path(directory)):
        yield


@contextmanager
def locked_for_removal(directory: Location) -> Iterator[bool]:
    """Whether no reader holds `directory` (`reading`); while True, none can start until the block ends."""
    with exclusive_lock(_lock_path(directory)) as free:
        yield free


def index_max_bytes() -> int:
    """The largest `ucp_index.json` read: $UCP_INDEX_MAX_BYTES, else INDEX_MAX_BYTES."""
    return int(os.environ.get("UCP_INDEX_MAX_BYTES", INDEX_MAX_BYTES))


def read_index(directory: str | os.PathLike[str] | ObjectPath) -> Index:
    """The committed index of a ucp checkpoint, checked in full (see `ucp.format.index`), or a clear error
    saying why there is none."""
    directory = location(directory)
    path = directory / INDEX_NAME
    raw = read_file(path, limit=index_max_bytes())
    if raw is None:
        if any(n.startswith(DATA_PREFIX) for n in list_names(directory)):
            raise IncompleteCheckpointError(
                f"incomplete checkpoint at {directory}: data files but no {INDEX_NAME}; the conversion or save "
                "that wrote it did not finish. Run it again (ucp convert ... --resume continues it)")
        raise CheckpointNotFoundError(f"{directory}: not a ucp checkpoint (no {INDEX_NAME})")
    try:
        index = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, over-long integers
        raise CorruptCheckpointError(f"{path}: damaged index ({exc}); convert the checkpoint again") from None
    return parse_index(index, directory, path)
