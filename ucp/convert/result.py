"""What a conversion reports when it is done."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ConvertResult:
    output: Path
    params: int
    files: tuple[str, ...]
    bytes_written: int
    already_done: bool = False
    files_written: int = 0
    redone: int = 0  # parameters this run converted: all of them, fewer when --resume kept finished files
