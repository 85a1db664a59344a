"""CRC-32 of a concatenation from the CRCs of its parts: zlib's `crc32_combine`, which Python lacks.

During an asynchronous save each rank checksums the run of a tensor it writes; rank 0 combines
those into the whole tensor's CRC-32 without reading a byte back. The arithmetic is zlib's
(1.2.12+): appending `len2` bytes multiplies the first CRC by x^(8·len2) modulo the CRC polynomial,
in zlib's reflected bit order, and adds the second CRC.
"""
from __future__ import annotations

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
