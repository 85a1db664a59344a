"""Byte counts as people read them, in every message ucp prints."""
from __future__ import annotations


def human_bytes(n: float) -> str:
    """`n` bytes as "512 B", "1.5 KiB", ..., "3.2 TiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
