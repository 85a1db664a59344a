"""The object-storage side of an asynchronous save (`ucp.deepspeed.save` to `s3://bucket/prefix`, or to the URL
of any other fsspec filesystem).

An object cannot be written at offsets by several ranks, so each data file goes up as one multipart upload
whose parts the ranks contribute (`ucp.deepspeed.saving.files.plan_parts`): the file is cut into parts of
`UCP_S3_PART_BYTES` (8 MiB by default; S3 takes parts of at least 5 MiB but the last) and each part is uploaded
by the rank that holds most of its bytes. Each rank first writes its pieces into a local staging copy of the
data files (sparse; `UCP_STAGING_DIR`, else the system's temporary folder; removed after the save), sends the
few bytes it holds in parts other ranks upload to those ranks (one all-to-all over the saver's gloo group:
only the parts where two ranks' ranges meet), then uploads its parts from its staging copy. Rank 0 opens the
uploads and, once every rank reported its parts, completes them, writes the index object, then `latest`;
on any failure it aborts every upload of the save, so no parts are left behind.

Other fsspec filesystems (`gs://`, `az://`, `hdfs://`, ...) have no multipart uploads that several writers can
share, so there each data file is one part: the rank that holds most of its bytes receives the others' bytes of
it in the same all-to-all and writes the file whole. Under ZeRO-1/2 a file's bytes mostly come from one rank
(each rank's partition is one run of every state), so little moves; under ZeRO-3 every tensor is spread over
all ranks, and (N-1)/N of each file goes through the group before its write. Both go through the same calls
of the storage layer (`storage.start_upload`, `upload_parts`, `complete_upload`, `abort_upload`): only the part
size differs (`storage.part_bytes`). A failed save aborts its uploads (a file written whole is deleted); what a
writer killed outright leaves has no index, so it is never taken for a checkpoint, and `"keep"` removes it
once a newer checkpoint is committed.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ucp.deepspeed.saving.files import Part, SaveFile
from ucp.deepspeed.saving.writer import partial_path
from ucp.storage import layer as storage
from ucp.storage.locations import ObjectPath


def part_size(save_dir: ObjectPath, files: Sequence[SaveFile]) -> int:
    """The part size of `plan_parts`: the store's (S3's `UCP_S3_PART_BYTES`), else the largest file (one part a
    file, `storage.part_bytes`)."""
    return storage.part_bytes(save_dir) or max(f.size for f in files)


def staging_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="ucp-save-staging-", dir=os.environ.get("UCP_STAGING_DIR")))


def remove_staging(staging: Path | None) -> None:
    if staging is not None:
        shutil.rmtree(staging, ignore_errors=True)


def read_ranges(staging: Path, ranges: Sequence[tuple[str, int, int]]) -> list[tuple[str, int, bytes]]:
    """The bytes of each (file, begin, end) of this rank's staging copy."""
    buffers = [bytearray(end - begin) for _, begin, end in ranges]
    storage.read_ranges([(partial_path(staging, name), begin, memoryview(buffer))
                         for (name, begin, _), buffer in zip(ranges, buffers)])
    return [(name, begin, bytes(buffer)) for (name, begin, _), buffer in zip(ranges, buffers)]


def write_ranges(staging: Path, pieces: Sequence[tuple[str, int, bytes]]) -> None:
    """Put the bytes other ranks sent (file, offset, data) into this rank's staging copy."""
    storage.write_ranges([(partial_path(staging, name), offset, data) for name, offset, data in pieces])


def open_uploads(save_dir: ObjectPath, tag_dir: ObjectPath, files: Sequence[SaveFile]) -> dict[str, str]:
    """Abort what an earlier save killed outright left open under `save_dir`, then open one upload per data file
    of this save; {file: upload id}. On failure the ones opened are aborted."""
    storage.abort_uploads(save_dir)
    uploads: dict[str, str] = {}
    try:
        for f in files:
            uploads[f.name] = storage.start_upload(tag_dir / f.name)
    except BaseException:
        abort(tag_dir, uploads)
        raise
    return uploads


def upload_mine(staging: Path, tag_dir: ObjectPath, uploads: dict[str, str], parts: Sequence[Part], me: int
                ) -> list[tuple[str, int, str]]:
    """Upload the parts this rank uploads from its staging copy, in parallel; (file, part number, ETag) each."""
    done = []
    for name in sorted({p.file for p in parts if p.uploader == me}):
        mine = [(p.number, p.begin, p.end) for p in parts if p.file == name and p.uploader == me]
        got = storage.upload_parts(partial_path(staging, name), tag_dir / name, uploads[name], mine)
        done += [(name, int(g["PartNumber"]), str(g["ETag"])) for g in got]
    return done


def complete(tag_dir: ObjectPath, uploads: dict[str, str], etags: Sequence[tuple[str, int, str]],
             parts: Sequence[Part]) -> None:
    """Check that the ranks reported every part of every file, then complete each file's upload; the data
    objects appear."""
    from ucp.errors import SaveError

    reported: dict[str, list[dict[str, Any]]] = {}
    for name, number, etag in etags:
        reported.setdefault(name, []).append({"PartNumber": number, "ETag": etag})
    for name in sorted({p.file for p in parts}):
        expected = sorted(p.number for p in parts if p.file == name)
        if sorted(int(p["PartNumber"]) for p in reported.get(name, [])) != expected:
            raise SaveError(f"{tag_dir / name}: the ranks uploaded parts {sorted(reported.get(name, []), key=str)}"
                            f" of {len(expected)}; every rank must save the same model")
    for name, upload in list(uploads.items()):
        storage.complete_upload(tag_dir / name, upload, reported[name])
        del uploads[name]  # completed: nothing left to abort


def abort(tag_dir: ObjectPath, uploads: dict[str, str]) -> None:
    """Abort the uploads still open (best effort: the save's own error says what went wrong, and the next save
    aborts whatever is still open under the save folder)."""
    for name, upload in uploads.items():
        try:
            storage.abort_upload(tag_dir / name, upload)
        except Exception:  # noqa: BLE001, S110  # see the docstring
            pass
    uploads.clear()
