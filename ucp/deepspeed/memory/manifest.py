"""The manifest of a node's copy of a memory checkpoint (`ucp_memory.json`), as one typed model.

A node's copy is a checkpoint folder whose data files are sparse: they hold the byte ranges of the saving
ranks the manifest lists under "holds" (saving rank -> [file, begin, end] ranges), besides every data file's
header ("files": name, size, header bytes). The manifest also names the tag, the step, the index's
fingerprint (the copies of one save agree on it), the saving group's size, and the job that wrote it: the
identity of its disk save folder (`MemoryEvery.job`), so that a job never resumes from another's memory.

`parse_manifest` accepts exactly that and turns anything else into one `CorruptCheckpointError` naming the
manifest and the field: a JSON list, a missing `holds`, a step of NaN or 1e400, a rank named `x`, a file name
that is not a plain name in the folder (the fill writes files by these names), a range outside its file.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ucp.errors import CorruptCheckpointError
from ucp.format.fields import Fields
from ucp.format.folder import PARTIAL_SUFFIX, fsync_dir
from ucp.format.index import MAX_STEP, plain_name
from ucp.storage.layer import read_json

MANIFEST_NAME = "ucp_memory.json"
MANIFEST_MAX_BYTES = 64 << 20  # a few ranges per data file and saving rank
MAX_RANKS = 1 << 24
_FIX = "the memory checkpoint is passed over; remove its folder"
Range = tuple[str, int, int]  # file, begin, end


@dataclass(frozen=True)
class Manifest:
    tag: str
    step: int
    fingerprint: str
    job: str                                   # the save folder of the job that wrote it
    ranks: int                                 # the saving group's size
    holds: dict[int, tuple[Range, ...]]        # saving rank -> the byte ranges of its pieces
    files: tuple[tuple[str, int, int], ...]    # data file name, size, header bytes


def manifest_json(m: Manifest) -> dict[str, Any]:
    return {"tag": m.tag, "step": m.step, "fingerprint": m.fingerprint, "job": m.job, "ranks": m.ranks,
            "holds": {str(rank): [list(r) for r in ranges] for rank, ranges in m.holds.items()},
            "files": [list(f) for f in m.files]}


def write_manifest(tag_dir: Path, manifest: Manifest) -> None:
    """Write `ucp_memory.json` atomically (temp file, fsync, rename)."""
    tmp = tag_dir / (MANIFEST_NAME + PARTIAL_SUFFIX)
    with open(tmp, "w") as f:
        json.dump(manifest_json(manifest), f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tag_dir / MANIFEST_NAME)
    fsync_dir(tag_dir)


def read_manifest(tag_dir: Path) -> Manifest:
    """The checked manifest of the node copy in `tag_dir` (a regular file of bounded size, never a link)."""
    path = tag_dir / MANIFEST_NAME
    raw = read_json(path, MANIFEST_MAX_BYTES, _FIX)
    if raw is None:
        raise CorruptCheckpointError(f"{path}: missing; {_FIX}")
    return parse_manifest(raw, path)


def parse_manifest(raw: object, path: Path) -> Manifest:
    top = Fields("manifest", raw, path, _FIX)
    ranks = top.count("ranks", least=1, limit=MAX_RANKS)
    files = []
    for i, entry in enumerate(top.get("files", (list,))):
        if not (isinstance(entry, list) and len(entry) == 3 and plain_name(entry[0])
                and all(_whole(n) for n in entry[1:]) and entry[2] <= entry[1]):
            raise top.bad(f"manifest.files[{i}]", "must be [plain file name, size, header bytes <= size]")
        files.append((entry[0], entry[1], entry[2]))
    sizes = dict((name, size) for name, size, _ in files)
    holds: dict[int, tuple[Range, ...]] = {}
    for key, ranges in Fields("manifest.holds", top.get("holds", (dict,)), path, _FIX).value.items():
        if not (key.isascii() and key.isdigit() and int(key) < ranks):
            raise top.bad("manifest.holds", f"names saving rank {key!r}, not one of 0..{ranks - 1}")
        if not isinstance(ranges, list) or not all(
                isinstance(r, list) and len(r) == 3 and r[0] in sizes and _whole(r[1]) and _whole(r[2])
                and r[1] <= r[2] <= sizes[r[0]] for r in ranges):
            raise top.bad(f"manifest.holds[{key!r}]", "must be [file, begin, end] ranges inside the manifest's files")
        holds[int(key)] = tuple((r[0], r[1], r[2]) for r in ranges)
    return Manifest(top.get("tag", (str,)), top.count("step", limit=MAX_STEP), top.get("fingerprint", (str,)),
                    top.get("job", (str,)), ranks, holds, tuple(files))


def _whole(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 62
