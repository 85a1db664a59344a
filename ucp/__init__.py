"""ucp: universal checkpoints for DeepSpeed.

`ucp.open_checkpoint(path)` reads an atomic checkpoint (or a DeepSpeed one, through its plan);
`ucp.convert.convert(...)` converts. Imports are lazy, so `import ucp` stays light.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ucp.version import __version__

if TYPE_CHECKING:
    from ucp.checkpoint import AtomicCheckpoint, PlannedCheckpoint

__all__ = ["__version__", "open_checkpoint"]


def open_checkpoint(path: str | os.PathLike[str], tag: str | None = None) -> AtomicCheckpoint | PlannedCheckpoint:
    """Open a ucp checkpoint directory, or a DeepSpeed checkpoint through its conversion plan."""
    from ucp.checkpoint import open_checkpoint as _open

    return _open(path, tag)
