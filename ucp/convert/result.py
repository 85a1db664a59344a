"""What a conversion reports when it is done."""
from __future__ import annotations

from dataclasses import dataclass

from ucp.storage.locations import Location


@dataclass(frozen=True)
class ConvertResult:
    output: Location  # a local folder, or a prefix of s3:// or another fsspec protocol
    params: int
    files: tuple[str, ...]
    bytes_written: int
    already_done: bool = False
    files_written: int = 0
    redone: int = 0  # parameters this run converted: all of them, fewer when --resume kept finished files
