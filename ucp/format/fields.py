"""Typed access to one JSON object ucp reads back (an index, a memory manifest, a progress record).

Each failure is one `CorruptCheckpointError` naming the file, the field and the fix: a missing key, a value of
another JSON type (a bool is not a number; NaN and 1e400 parse as floats, so they are not counts), or a count
outside its range.
"""
from __future__ import annotations

from typing import Any, Literal, overload

from ucp.errors import CorruptCheckpointError
from ucp.storage.locations import Location


class Fields:
    """One JSON object of file `path`, found at `where` in it; `fix` ends every message."""

    def __init__(self, where: str, value: object, path: Location, fix: str):
        self.where, self.path, self.fix = where, path, fix
        if not isinstance(value, dict):
            raise self.bad(where, f"must be an object, got {kind(value)}")
        self.value: dict[str, Any] = value

    def get(self, key: str, types: tuple[type, ...], required: bool = True) -> Any:
        """The value at `key`, of one of `types` (JSON's, as parsed), or None where it may be missing."""
        if key not in self.value:
            if required:
                raise self.bad(f"{self.where}.{key}", "is missing")
            return None
        value = self.value[key]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise self.bad(f"{self.where}.{key}", f"must be {'/'.join(t.__name__ for t in types)}, got {kind(value)}")
        return value

    @overload
    def count(self, key: str, required: Literal[True] = True, limit: int = 1 << 62, least: int = 0) -> int: ...

    @overload
    def count(self, key: str, required: bool, limit: int = 1 << 62, least: int = 0) -> int | None: ...

    def count(self, key: str, required: bool = True, limit: int = 1 << 62, least: int = 0) -> int | None:
        """A whole number in [`least`, `limit`] at `key`."""
        value: int | None = self.get(key, (int,), required)
        if value is not None and not least <= value <= limit:
            raise self.bad(f"{self.where}.{key}", f"{value} is out of range [{least}, {limit}]")
        return value

    def bad(self, where: str, problem: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path}: {where} {problem}; {self.fix}")


def kind(value: object) -> str:
    """The JSON type of `value`, as a message names it."""
    return "null" if value is None else type(value).__name__
