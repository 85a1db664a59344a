"""CRC-32s: the one function every checksum of ucp goes through, and `crc32_combine`, which Python lacks.

`crc32` is zlib's CRC-32 (the polynomial of zip files and of `zlib.crc32`), computed by the fastest library
installed: ISA-L (`isal`), then zlib-ng (`zlib-ng`), else zlib itself. On the development machine they checksum
about 4.5, 4.1 and 1.9 GB/s (benchmarks/README.md, "Checksums"); all three give the same values and release the
GIL on large buffers, so the writers' threads overlap. `pip install ucp-checkpoint[fast]` brings them. The environment
variable `UCP_CRC32` (`isal`, `zlib-ng` or `zlib`) names one, to measure them against each other.

During an asynchronous save each rank checksums the run of a tensor it writes; rank 0 combines
those into the whole tensor's CRC-32 without reading a byte back. The arithmetic is zlib's
(1.2.12+): appending `len2` bytes multiplies the first CRC by x^(8·len2) modulo the CRC polynomial,
in zlib's reflected bit order, and adds the second CRC.
"""
from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable
from importlib import import_module
from typing import TYPE_CHECKING, cast

from ucp.errors import UcpError

if TYPE_CHECKING:
    from typing import Any, TypeAlias

    import numpy as np
    from typing_extensions import Buffer

    # What can be checksummed: any C-contiguous buffer (numpy's stubs declare ndarray one only from Python 3.12 on).
    Bytes: TypeAlias = Buffer | np.ndarray[Any, Any]

CRC32_ENV = "UCP_CRC32"
# The libraries `crc32` may use, fastest first: (name, module, the pip package that installs it).
FAST_IMPLEMENTATIONS = (("isal", "isal.isal_zlib", "isal"), ("zlib-ng", "zlib_ng.zlib_ng", "zlib-ng"))
IMPLEMENTATIONS = (*(name for name, _, _ in FAST_IMPLEMENTATIONS), "zlib")


def choose_crc32(wanted: str | None = None) -> tuple[str, Callable[[Bytes, int], int]]:
    """(name, crc32 function) of the implementation `wanted` names, or else of the fastest one installed."""
    if wanted not in (None, *IMPLEMENTATIONS):
        raise UcpError(f"{CRC32_ENV}={wanted!r} names no CRC-32 implementation: use one of "
                       f"{', '.join(IMPLEMENTATIONS)}, or unset it to take the fastest installed")
    for name, module, package in FAST_IMPLEMENTATIONS:
        if wanted in (None, name):
            try:
                function: Callable[[Bytes, int], int] = import_module(module).crc32
                return name, function
            except ImportError:
                if wanted is not None:
                    raise UcpError(f"{CRC32_ENV}={wanted}: {module} is not installed; pip install {package}, "
                                   f"or unset {CRC32_ENV}") from None
    return "zlib", cast("Callable[[Bytes, int], int]", zlib.crc32)  # takes numpy arrays too (Bytes)


_chosen: tuple[str, Callable[[Bytes, int], int]] | None = None


def _current() -> tuple[str, Callable[[Bytes, int], int]]:
    """This process's implementation: the one `use_crc32` chose, else (on first use) the one `UCP_CRC32` names,
    else the fastest installed."""
    global _chosen
    if _chosen is None:
        _chosen = choose_crc32(os.environ.get(CRC32_ENV) or None)
    return _chosen


def use_crc32(name: str | None = None) -> str:
    """Make `crc32` use the implementation `name` (isal, zlib-ng or zlib) in this process from now on, or the
    fastest one installed; returns its name."""
    global _chosen
    _chosen = choose_crc32(name)
    return _chosen[0]


def crc32_implementation() -> str:
    """The name of the library `crc32` uses: isal, zlib-ng or zlib."""
    return _current()[0]


def crc32(data: Bytes, value: int = 0) -> int:
    """zlib's CRC-32 of `data` (any C-contiguous buffer: bytes, memoryview, numpy array), continuing from `value`,
    the CRC-32 of the bytes before it."""
    return _current()[1](data, value)


_POLY = 0xEDB88320  # the zlib CRC-32 polynomial, reflected
_ONE = 1 << 31      # the polynomial 1 (x^0), reflected


def _multmodp(a: int, b: int) -> int:
    """a·b modulo the CRC polynomial (both reflected)."""
    product = 0
    m = _ONE
    while m:
        if a & m:
            product ^= b
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
        m >>= 1
    return product


def _x2n_table() -> tuple[int, ...]:
    """x^(2^k) modulo the polynomial, for k = 0..31."""
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return tuple(table)


_X2N = _x2n_table()


@functools.lru_cache(maxsize=64)  # chunk-sized lengths repeat
def _x8nmodp(nbytes: int) -> int:
    """x^(8·nbytes) modulo the polynomial."""
    power = _ONE
    k = 3  # 8 = 2^3
    while nbytes:
        if nbytes & 1:
            power = _multmodp(_X2N[k & 31], power)
        nbytes >>= 1
        k += 1
    return power


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B, given crc1 = crc32(A), crc2 = crc32(B) and len2 = len(B) in bytes."""
    if len2 < 0:
        raise ValueError(f"len2 must be >= 0, got {len2}")
    return _multmodp(_x8nmodp(len2), crc1 & 0xFFFFFFFF) ^ (crc2 & 0xFFFFFFFF)


# -- chunk checksums ----------------------------------------------------------------------------------
# A stored state also records the CRC-32 of each of its chunks: the runs of its bytes between file
# offsets that are multiples of `chunk_bytes` (the first and last chunk may be shorter). A reader of
# part of a state widens its read to those boundaries and checks every chunk it read, so a partial
# read is verified at the cost of at most two partial chunks more; ranks reading neighbouring parts
# can instead join their parts' CRC-32s (`crc32_combine`; docs/FORMAT.md, "Checksums").

CHUNK_BYTES = 1 << 20


def chunk_bounds(begin: int, end: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """The chunks [lo, hi) of the byte range [begin, end): cut at the multiples of `chunk_bytes`."""
    cuts = range((begin // chunk_bytes + 1) * chunk_bytes, end, chunk_bytes)
    edges = [begin, *cuts, end]
    return [(lo, hi) for lo, hi in zip(edges, edges[1:]) if hi > lo]


def segment_crcs(data: memoryview | bytes, begin: int, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(lo, hi, crc32) of `data` (bytes stored from file offset `begin` on), cut at chunk boundaries."""
    return [(lo, hi, crc32(data[lo - begin:hi - begin]))
            for lo, hi in chunk_bounds(begin, begin + len(data), chunk_bytes)]


def join_segments(segments: list[tuple[int, int, int]], begin: int, end: int,
                  chunk_bytes: int) -> tuple[int, list[int]]:
    """The CRC-32 of [begin, end) and of each of its chunks, from segments that tile it exactly and
    never straddle a chunk boundary (as `segment_crcs` cuts them, whichever rank wrote which)."""
    bounds = chunk_bounds(begin, end, chunk_bytes)
    chunks: dict[tuple[int, int], int] = {}
    starts = {lo: (lo, hi) for lo, hi in bounds}
    cursor, whole, current = begin, 0, None
    for lo, hi, crc in sorted(segments):
        if lo != cursor:
            raise ValueError(f"segments leave bytes [{cursor}, {lo}) uncovered" if lo > cursor else
                             f"segments overlap at byte {lo}")
        current = starts.get(lo, current)
        if current is None or hi > current[1]:
            raise ValueError(f"segment [{lo}, {hi}) straddles a chunk boundary")
        previous = chunks.get(current)
        chunks[current] = crc if previous is None else crc32_combine(previous, crc, hi - lo)
        whole = crc32_combine(whole, crc, hi - lo)
        cursor = hi
    if cursor != end:
        raise ValueError(f"segments leave bytes [{cursor}, {end}) uncovered")
    return whole, [chunks[b] for b in bounds]  # every chunk has its segments: they tile [begin, end)
