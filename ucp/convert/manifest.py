"""Per-data-file manifests: what lets `ucp convert --resume` keep the files an interrupted run finished.

Once a bin's data file is durable (fsynced, renamed into place, directory fsynced), its writer puts
`<data file>.json` beside it: the source fingerprint, the file's size, the CRC-32 of its
safetensors header, and every stored tensor's key, absolute byte range and CRC-32 — what the index
will say about that file. The manifest is itself written to a temporary name, fsynced and renamed,
so it exists only for a complete data file. `--resume` keeps a data file whose manifest matches the
planned bin and whose bytes still match every checksum; every other bin is converted again. The
driver removes the manifests once the index is committed, since the index then says the same.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ucp.convert.executor import Report
from ucp.format.crc import crc32
from ucp.format.folder import DATA_PREFIX, PARTIAL_SUFFIX, fsync_dir
from ucp.format.index import Index, header_problems
from ucp.format.safetensors_stream import StoredTensor
from ucp.plan.index_builder import WrittenFile
from ucp.storage.fileio import read_regular

MANIFEST_SUFFIX = ".json"
_CHUNK = 16 << 20


@dataclass(frozen=True)
class BinCheck:
    """A finished bin to look for under --resume: its file, the keys it must hold in order, the source."""

    output: str
    file_name: str
    keys: tuple[str, ...]
    fingerprint: str


def manifest_name(file_name: str) -> str:
    return file_name + MANIFEST_SUFFIX


def is_manifest(name: str) -> bool:
    return name.startswith(DATA_PREFIX) and name.endswith(MANIFEST_SUFFIX)


def write_manifest(output: str, written: WrittenFile, fingerprint: str) -> None:
    """Record a durable data file (what a bin task wrote) for a later --resume."""
    data_path = os.path.join(output, written.name)
    tensors = [[key, s.begin, s.end, s.crc32, list(s.chunk_crc32)] for key, s in written.tensors.items()]
    with open(data_path, "rb") as f:
        header_crc = _crc_range(f, 0, _header_end(tensors, written.nbytes))
    body = {"fingerprint": fingerprint, "file": written.name, "bytes": written.nbytes,
            "chunk_bytes": written.chunk_bytes, "header_crc32": header_crc, "tensors": tensors}
    final = os.path.join(output, manifest_name(written.name))
    with open(final + PARTIAL_SUFFIX, "w") as f:
        json.dump(body, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(final + PARTIAL_SUFFIX, final)
    fsync_dir(Path(output))


def reusable_bin(check: BinCheck, report: Report) -> WrittenFile | None:
    """The bin's data file as its writer reported it, if its data file is intact and from this conversion.

    None when the manifest is missing, damaged, from another source or another bin layout, or when
    the data file's size or any checksum (header or tensor) disagrees with it.
    """
    try:
        with open(os.path.join(check.output, manifest_name(check.file_name))) as f:
            body = json.load(f)
        tensors = body["tensors"]
        if (body["fingerprint"] != check.fingerprint or body["file"] != check.file_name
                or tuple(t[0] for t in tensors) != check.keys):
            return None
        data_path = os.path.join(check.output, check.file_name)
        if os.path.getsize(data_path) != body["bytes"]:
            return None
        with open(data_path, "rb") as f:
            if _crc_range(f, 0, _header_end(tensors, body["bytes"])) != body["header_crc32"]:
                return None
            if any(_crc_range(f, begin, end) != crc for _, begin, end, crc, _ in tensors):
                return None
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None
    report(body["bytes"])
    stored = {key: StoredTensor(key, begin, end, crc, tuple(chunks)) for key, begin, end, crc, chunks in tensors}
    return WrittenFile(check.file_name, body["bytes"], body["chunk_bytes"], stored)


def remove_manifests(output: Path) -> None:
    for name in os.listdir(output):
        if is_manifest(name):
            os.remove(output / name)
    fsync_dir(output)


def _header_end(tensors: list, file_bytes: int) -> int:
    # Tensors follow the header back to back, so the first one starts where the header ends.
    return min((t[1] for t in tensors), default=file_bytes)


def _crc_range(f, begin: int, end: int) -> int:
    crc = 0
    f.seek(begin)
    left = end - begin
    while left > 0:
        chunk = f.read(min(_CHUNK, left))
        if not chunk:
            raise ValueError(f"{f.name}: ends before byte {end}")
        crc = crc32(chunk, crc)
        left -= len(chunk)
    return crc


def committed_damage(output: Path, index: Index) -> str | None:
    """The first way the data of the committed checkpoint `output` differs from its `index`, else None: a data
    file's safetensors header, a state's bytes or an extra file against its CRC-32 (every byte read once)."""
    for data in index.files.values():
        states = [s for e in index.params.values() for s in e.states.values() if s.file == data.name]
        problems = header_problems(output / data.name, data, states)
        if problems:
            return problems[0]
        with open(output / data.name, "rb") as f:
            for s in states:
                if _crc_range(f, s.begin, s.end) != s.crc32:
                    return f"{output / data.name}: {s.key} fails its CRC-32"
    for extra in index.extra_files.values():
        if crc32(read_regular(str(output / extra.name), follow=False)) != extra.crc32:
            return f"{output / extra.name}: fails its CRC-32"
    return None
