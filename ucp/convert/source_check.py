"""The rank files' own checksums, checked as they are converted (docs/RELIABILITY.md, "Source checksums").

`torch.save` writes a zip file whose entries are stored uncompressed, each with the CRC-32 of its
bytes in the zip directory. Every tensor storage is one entry. The conversion's workers CRC the
bytes they read, in pieces, and the bytes of their fragments that no output needs (`ucp.convert.bin_copy`);
here the driver joins the pieces of each entry that the conversion copies from, in file order, with
`crc32_combine`, reads and CRCs whatever bytes of it no worker read (tensors no state uses), and
compares the result with the zip's CRC-32, before the index is committed. Small entries of the same files
(steps and other scalars, which the plan reads into the index) are read and checked whole: they cost nothing.
Entries of tensors the conversion does not use at all (the model-states file's weights when the
fp32 masters come from the optimizer files) are not read, so not checked.

The zero-conversion load (`ucp.deepspeed.loading.source`) checks the same way, across ranks: each rank CRCs the
parts of entries it reads for the load (`EntryParts`), the parts go to one owner rank per entry, and the
owner joins them and reads only what no rank read (`close_entries`).
"""
from __future__ import annotations

import bisect
import os
import zipfile
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ucp.converters.torch_zip import ZipEntry, storage_entries
from ucp.errors import CorruptCheckpointError
from ucp.format.crc import crc32, crc32_combine
from ucp.plan.plan import ConversionPlan, StateSource
from ucp.storage.fileio import ReadCounter, open_regular

SourceSegment = tuple[str, int, int, int]  # (path, begin, end, crc32) of bytes read from a rank file
SMALL_ENTRY_BYTES = 64 << 10  # entries this small are checked whether or not a state reads them
_GAP_READ = 8 << 20


def touched_entries(plan: ConversionPlan) -> dict[str, list[ZipEntry]]:
    """The zip entries of each rank file that some fragment of `plan` reads, in file order, with the file's
    small entries (none for a file that is no zip archive: a plan built by hand over raw bytes)."""
    starts: dict[str, set[int]] = defaultdict(set)
    for p in plan.params:
        for source in p.states.values():
            for f in source.fragments:
                starts[f.piece.path].add(f.piece.byte_offset)
    touched = {}
    for path, offsets in starts.items():
        begins, entries = entries_in_file_order(path)
        if entries:
            hit = {bisect.bisect_right(begins, o) - 1 for o in offsets}
            touched[path] = [e for i, e in enumerate(entries) if i in hit or e.end - e.start <= SMALL_ENTRY_BYTES]
    return touched


def entries_in_file_order(path: str) -> tuple[list[int], list[ZipEntry]]:
    """The storage entries of rank file `path` in file order, and where each starts (none for a file that is
    no zip archive: a plan built by hand over raw bytes)."""
    fd = open_regular(path)  # a FIFO or a device where a rank file belongs is refused, never waited on
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            is_zip = zipfile.is_zipfile(f)
    finally:
        os.close(fd)
    if not is_zip:
        return [], []
    entries = sorted(storage_entries(path).values(), key=lambda e: e.start)
    return [e.start for e in entries], entries


def check_sources(plan: ConversionPlan, segments: Iterable[SourceSegment]) -> None:
    """Raise `CorruptCheckpointError` unless every entry `plan` touches has the CRC-32 its zip records.

    `segments` are the CRCs of the bytes the workers read; bytes of an entry they did not cover are
    read here. An entry recorded with CRC 0 (torch's `compute_crc32=False`) is not checked.
    """
    by_path: dict[str, list[SourceSegment]] = defaultdict(list)
    for segment in segments:
        by_path[segment[0]].append(segment)
    for path, entries in touched_entries(plan).items():
        mine = sorted(by_path.get(path, ()), key=lambda s: (s[1], s[2]))
        begins = [s[1] for s in mine]
        for entry in entries:
            if entry.crc32 == 0:
                continue
            first = bisect.bisect_left(begins, entry.start)
            inside = [s for s in mine[first:bisect.bisect_left(begins, entry.end)] if s[2] <= entry.end]
            _compare(path, entry, entry_crc(path, entry, inside))


class EntryChecks:
    """The zip entries a reader of a DeepSpeed checkpoint takes states from, each read whole and checked the
    first time one of its states is read (`ucp.open_checkpoint` on a DeepSpeed folder, and what reads
    through it: inspect, export)."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[list[int], list[ZipEntry]]] = {}
        self._checked: set[tuple[str, str]] = set()

    def check(self, source: StateSource) -> None:
        """Raise `CorruptCheckpointError` unless every entry `source`'s fragments lie in has its CRC-32."""
        for f in source.fragments:
            starts, entries = self._of(f.piece.path)
            i = bisect.bisect_right(starts, f.piece.byte_offset) - 1
            if i >= 0 and (f.piece.path, entries[i].name) not in self._checked:
                check_entry(f.piece.path, entries[i])
                self._checked.add((f.piece.path, entries[i].name))

    def _of(self, path: str) -> tuple[list[int], list[ZipEntry]]:
        if path not in self._entries:
            self._entries[path] = entries_in_file_order(path)
        return self._entries[path]


@dataclass(frozen=True)
class OpenEntry:
    """Bytes `part` = (begin, end, CRC-32) of a zip entry that one rank read: for the entry's owner to join."""

    file: str  # the rank file's path in its tag folder (the same on every rank, wherever the folder is mounted)
    entry: ZipEntry
    part: tuple[int, int, int]


class EntryParts:
    """What one rank reads of the rank files' zip entries while it checks a zero-conversion load: each part read,
    with its CRC-32 (`opened`, touching parts joined), for the entry's owner rank to close (`close_entries`);
    an entry read whole is checked at once too."""

    def __init__(self) -> None:
        self.opened: list[OpenEntry] = []
        self._files: dict[str, tuple[list[int], list[ZipEntry]]] = {}

    def entries(self, path: str) -> tuple[list[int], list[ZipEntry]]:
        """The storage entries of rank file `path` in file order, and where each starts (read once)."""
        if path not in self._files:
            self._files[path] = entries_in_file_order(path)
        return self._files[path]

    def add(self, path: str, name: str, begin: int, end: int, crc: int) -> None:
        """Bytes [begin, end) of rank file `path` (`name` on every rank), whose CRC-32 is `crc`, were read."""
        starts, entries = self.entries(path)
        if not entries:
            return  # no zip archive (a plan built by hand over raw bytes): nothing records a CRC-32
        i = bisect.bisect_right(starts, begin) - 1
        if i < 0 or end > entries[i].end:
            raise CorruptCheckpointError(f"{path}: bytes [{begin}, {end}) that its pickle names lie outside its "
                                         "tensor data; the file is damaged: save the checkpoint again or restore "
                                         "the file from a copy")
        entry = entries[i]
        if entry.crc32 == 0:
            return  # written without CRC-32s (torch's compute_crc32=False)
        last = self.opened[-1] if self.opened else None
        if last is not None and last.entry == entry and last.part[1] == begin and last.file == name:
            self.opened.pop()  # touching the previous part: one part
            begin, crc = last.part[0], crc32_combine(last.part[2], crc, end - begin)
        if (begin, end) == (entry.start, entry.end):
            _compare(path, entry, crc)  # read whole: checked now (its owner then learns it is covered)
        self.opened.append(OpenEntry(name, entry, (begin, end, crc)))


def close_entries(paths: dict[str, str], parts: Sequence[OpenEntry], counter: ReadCounter) -> int:
    """Check each entry that `parts` (every rank's parts of the entries this rank closes) are parts of, joined in
    file order, reading the bytes no rank read; `paths` gives each rank file's path by name. Returns the bytes
    read here."""
    joined: dict[tuple[str, int], list[SourceSegment]] = defaultdict(list)
    entries: dict[tuple[str, int], OpenEntry] = {}
    for p in parts:
        joined[(p.file, p.entry.start)].append((paths[p.file], *p.part))
        entries.setdefault((p.file, p.entry.start), p)
    before = counter.bytes
    for unit, p in sorted(entries.items()):
        path = paths[p.file]
        _compare(path, p.entry, entry_crc(path, p.entry, sorted(joined[unit], key=lambda s: (s[1], s[2])), counter))
    return counter.bytes - before


def check_entry(path: str, entry: ZipEntry, counter: ReadCounter | None = None) -> None:
    """Read `entry` of rank file `path` whole; raise `CorruptCheckpointError` unless it has the CRC-32 its
    zip records."""
    if entry.crc32 != 0:
        _compare(path, entry, entry_crc(path, entry, [], counter))


def _compare(path: str, entry: ZipEntry, found: int) -> None:
    if found != entry.crc32:
        raise CorruptCheckpointError(
            f"{path}: tensor data '{entry.name}' fails its CRC-32 (the zip records {entry.crc32:08x}, its "
            f"bytes give {found:08x}); the file is damaged: save the checkpoint again or restore the file "
            "from a copy")


def entry_crc(path: str, entry: ZipEntry, segments: list[SourceSegment], counter: ReadCounter | None = None) -> int:
    """The CRC-32 of `entry`'s bytes from `segments` (sorted, inside it) and reads of what they leave out
    (counted in `counter`)."""
    crc, cursor = 0, entry.start
    fd = None
    try:
        for _, begin, end, piece_crc in segments:
            if end <= cursor:
                continue  # the same bytes read twice (one state's copy of another's)
            if begin > cursor:
                fd = fd if fd is not None else open_regular(path)
                crc = crc32_combine(crc, _read_crc(fd, path, cursor, begin, counter), begin - cursor)
            elif begin < cursor:  # overlaps what is covered: CRC its new bytes from the file
                fd = fd if fd is not None else open_regular(path)
                piece_crc = _read_crc(fd, path, cursor, end, counter)
                begin = cursor
            crc = crc32_combine(crc, piece_crc, end - begin)
            cursor = end
        if cursor < entry.end:
            fd = fd if fd is not None else open_regular(path)
            crc = crc32_combine(crc, _read_crc(fd, path, cursor, entry.end, counter), entry.end - cursor)
    finally:
        if fd is not None:
            os.close(fd)
    return crc


def _read_crc(fd: int, path: str, begin: int, end: int, counter: ReadCounter | None) -> int:
    crc = 0
    while begin < end:
        data = os.pread(fd, min(_GAP_READ, end - begin), begin)
        if not data:
            raise CorruptCheckpointError(f"{path}: ends at byte {begin}, expected at least {end}; the file is "
                                         "truncated, copy it again")
        crc = crc32(data, crc)
        begin += len(data)
        if counter is not None:
            counter.bytes += len(data)
            counter.calls += 1
    return crc
