"""Crafted pickles for tests: an object whose unpickling runs a shell command that creates a marker file."""
from __future__ import annotations

import os
import shlex
from pathlib import Path

import torch


class Payload:
    """Unpickling this object runs `touch <marker>`, as a malicious checkpoint would run its own code."""

    def __init__(self, marker: Path):
        self.marker = Path(marker)

    def __reduce__(self):
        return os.system, (f"touch {shlex.quote(str(self.marker))}",)


def plant(path: Path, marker: Path, *keys: str) -> None:
    """Rewrite the torch.save file `path` with a `Payload` at `sd[keys[0]]...[keys[-1]]` (a trusted test
    checkpoint, so loading it with torch.load here is safe)."""
    sd = torch.load(path, map_location="cpu", weights_only=False)
    holder = sd
    for key in keys[:-1]:
        holder = holder[key]
    holder[keys[-1]] = Payload(marker)
    torch.save(sd, path)
