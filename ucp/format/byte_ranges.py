"""Byte ranges of stored files, and their coalescing into few sequential reads: pure, no I/O."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class ByteRange:
    file: str
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def coalesce(ranges: Iterable[ByteRange]) -> list[tuple[ByteRange, list[ByteRange]]]:
    """Merge touching ranges of the same file into single reads: [(merged read, [parts in it])]."""
    merged: list[tuple[ByteRange, list[ByteRange]]] = []
    for r in sorted(set(ranges), key=lambda r: (r.file, r.begin, r.end)):
        if merged:
            last, parts = merged[-1]
            if last.file == r.file and r.begin <= last.end:
                merged[-1] = (ByteRange(last.file, last.begin, max(last.end, r.end)), parts + [r])
                continue
        merged.append((r, [r]))
    return merged
