"""When the engine saves: the `"save"` section of the `"ucp"` config, read and checked once, and the test of
each optimizer step against it (`ucp.deepspeed.life` runs the saves it calls for)."""
from __future__ import annotations

import os
from dataclasses import dataclass

from ucp.deepspeed.memory_files import MemoryEvery
from ucp.errors import ConfigError
from ucp.format.locations import Location, location


@dataclass(frozen=True)
class SaveEvery:
    """The `"save"` section of the `"ucp"` config: save into `dir` after every `every`-th optimizer step, and
    keep the newest `keep` committed checkpoints there (all when None; `ucp.elastic.retention.prune`); with
    `memory`, save into the host-memory tier too (`ucp.deepspeed.memory_tier`)."""

    dir: Location
    every: int
    keep: int | None = None
    memory: MemoryEvery | None = None

    @classmethod
    def from_config(cls, options: object) -> SaveEvery:
        if not isinstance(options, dict) or not isinstance(options.get("dir"), (str, os.PathLike)):
            raise ConfigError(f'"ucp": {{"save": {options!r}}}: needs "dir", the folder to save into, e.g. '
                              '{"dir": "/ckpt/ucp", "every": 100}')
        for key in ("every", "keep"):
            value = options.get(key)
            if key == "keep" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                what = "optimizer steps" if key == "every" else "checkpoints to keep (at least 1)"
                raise ConfigError(f'"ucp": {{"save": {{"{key}": {value!r}}}}}: must be a positive number of {what}')
        unknown = set(options) - {"dir", "every", "keep", "memory"}
        if unknown:
            raise ConfigError(f'"ucp": {{"save": ...}}: unknown key {sorted(unknown)[0]!r}; known: "dir", "every", '
                              '"keep", "memory"')
        folder = location(options["dir"])  # a URL no storage takes is refused in one line, before training
        memory = MemoryEvery.from_config(options["memory"], os.fspath(options["dir"])) if "memory" in options else None
        return cls(folder, options["every"], options.get("keep"), memory)

    def disk_due(self, steps: int, last: int | None) -> bool:
        """Whether the optimizer step that made `steps` calls for a disk save (`last`: the step last saved)."""
        return steps % self.every == 0 and steps != last

    def memory_due(self, steps: int, last: int | None) -> bool:
        """Whether it calls for a save into the memory tier (`last`: the step the tier last saved)."""
        return self.memory is not None and steps % self.memory.every == 0 and steps != last
