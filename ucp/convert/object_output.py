"""`ucp convert --output s3://bucket/prefix`: a conversion committed into an object store by object order.

The conversion runs as it does for a local folder, into a staging folder ($UCP_STAGING_DIR, else the system's
temporary folder; removed afterwards), and is then uploaded: every data file and carried extra file first
(multipart, parts in parallel, when large), the index object last. Until the index object exists the prefix
reads as incomplete, so a conversion interrupted at any point never looks complete (docs/FORMAT.md, "Object
storage"); a failed multipart upload is aborted (`ucp.storage.s3`), and the uploads a conversion
killed outright left open are aborted by the next one to the same prefix.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

from ucp.convert.result import ConvertResult
from ucp.errors import OutputExistsError, UcpError
from ucp.format.folder import INDEX_NAME, commit_index, is_ucp_file, read_index
from ucp.format.index import Index
from ucp.storage.layer import abort_uploads, delete, is_file, list_names, upload_file
from ucp.storage.locations import ObjectPath


def convert_to_object_store(output: ObjectPath, fingerprint: str,
                            write_local: Callable[[Path], ConvertResult]) -> ConvertResult:
    """Convert with `write_local` (the local atomic writer, given a staging folder) and upload the result to
    `output`, committing it by writing its index object last. `fingerprint` identifies the source: a prefix
    that already holds this very conversion is left as it is."""
    done = _prepare(output, fingerprint)
    if done is not None:
        return ConvertResult(output, len(done.params), tuple(done.files), 0, already_done=True)
    with tempfile.TemporaryDirectory(prefix="ucp-staging-", dir=os.environ.get("UCP_STAGING_DIR")) as staging:
        folder = Path(staging) / "checkpoint"
        try:
            local = write_local(folder)
        except UcpError as exc:  # name the URL the user gave, not the staging folder it never heard of
            raise type(exc)(str(exc).replace(str(folder), str(output))) from None
        upload(folder, output, read_index(folder))
    return ConvertResult(output, local.params, local.files, local.bytes_written,
                         files_written=local.files_written, redone=local.redone)


def _prepare(output: ObjectPath, fingerprint: str) -> Index | None:
    """The index of `output` when it holds this conversion already; else make it ready (delete what an
    interrupted conversion left there), refusing a prefix that holds anything else."""
    if is_file(output / INDEX_NAME):
        index = read_index(output)
        if index.run.source.get("fingerprint") == fingerprint:
            return index
        raise OutputExistsError(f"{output}: already holds a different checkpoint (converted from "
                                f"{index.run.source.get('path', 'elsewhere')}); choose another --output or delete it")
    names = list_names(output)
    foreign = [n for n in names if not is_ucp_file(n)]
    if foreign:
        raise OutputExistsError(f"{output}: is not empty (holds '{foreign[0]}', which ucp did not write); choose "
                                "an empty or new --output prefix")
    for name in names:  # leftovers of an interrupted conversion: not a checkpoint
        delete(output / name)
    abort_uploads(output)  # and the open uploads of one killed outright
    return None


def upload(folder: Path, output: ObjectPath, index: Index) -> None:
    """Upload the committed local checkpoint `folder` to `output`: the files the index names, then the index."""
    for name in [*index.files, *index.extra_files]:
        upload_file(folder / name, output / name)
    commit_index(output, index)
