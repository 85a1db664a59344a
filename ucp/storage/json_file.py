"""A small JSON file ucp reads from a folder it does not own (a layout, a plan): read as a regular file of bounded
size, decoded strictly, every failure one line (issue #43).

A FIFO would block a read forever and a device such as /dev/zero never end, so neither is opened for reading (the
open itself does not wait: O_NONBLOCK); a file larger than the bound is refused unread; bytes that are not UTF-8,
JSON that is cut or nested deeper than Python's recursion allows, and the non-finite numbers Python's `json`
takes by default (`NaN`, `Infinity`, and `1e400`, which it reads as infinity) are refused with the file's name.
"""
from __future__ import annotations

import json
import math
import os
import stat
from typing import NoReturn

from ucp.errors import UcpError

MAX_JSON_BYTES = 16 << 20  # a layout of 60,000 ranks is about 1 MiB


def read_json_file(path: str | os.PathLike[str], error: type[UcpError], fix: str,
                   limit: int = MAX_JSON_BYTES) -> object:
    """The JSON value of file `path`; `error(...)` naming the path and `fix` when it cannot be read as one."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise error(f"{path}: no such file; {fix}") from None
    except OSError as exc:
        raise error(f"{path}: cannot be opened ({exc.strerror}); {fix}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise error(f"{path}: not a regular file (a FIFO, a device or a folder); {fix}")
        if info.st_size > limit:
            raise error(f"{path}: {info.st_size} bytes, more than the {limit} such a file may hold; {fix}")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:  # grew while read
        raise error(f"{path}: more than the {limit} bytes such a file may hold; {fix}")
    return parse_json(data, path, error, fix)


def _refuse_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is no JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} is too large a number")
    return value


def parse_json(data: bytes | str, where: object, error: type[UcpError], fix: str) -> object:
    """`data` as JSON, strictly (module docstring); `error(...)` naming `where` and `fix` otherwise."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise error(f"{where}: not UTF-8 text (byte {exc.start}); {fix}") from None
    try:
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite)
    except RecursionError:
        raise error(f"{where}: JSON nested too deeply; {fix}") from None
    except json.JSONDecodeError as exc:
        raise error(f"{where}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); {fix}") from None
    except ValueError as exc:
        raise error(f"{where}: not JSON ucp takes ({str(exc)[:80]}); {fix}") from None


def shown(value: object) -> str:
    """A value read from a file or a config, short enough for a one-line error: numbers, bools and null as JSON,
    a string's first 20 characters, anything else by its type (a list or an object is never quoted whole)."""
    if isinstance(value, (bool, int, float)) or value is None:
        return json.dumps(value)[:40]
    if isinstance(value, str):
        return json.dumps(value[:20] + ("..." if len(value) > 20 else ""))
    kind = "list" if isinstance(value, list) else "object" if isinstance(value, dict) else type(value).__name__
    return f"a JSON {kind}"
