"""The progress bar of long work (conversion, export): bytes done of a total, on stderr when it is a terminal."""
from __future__ import annotations

from tqdm import tqdm


def progress_bar(total_bytes: int, desc: str, enabled: bool) -> tqdm:
    # disable=None lets tqdm hide itself when stderr is not a terminal (CI logs, pipes).
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None if enabled else True, dynamic_ncols=True)
