#!/usr/bin/env python
"""CRC-32 throughput of each implementation `ucp.format.crc.crc32` can use: ISA-L, zlib-ng, zlib.

    python benchmarks/crc.py [--mib 256] [--repeat 5] [--markdown-out FILE]

Checksums a buffer of random bytes in RAM, in 1 MiB pieces (the chunk size, as convert's workers, the async
save's writers and the load checks do) and in 4 KiB pieces (the per-call cost), on one thread, through
`ucp.format.crc.crc32` with each implementation installed chosen in turn (`use_crc32`); every implementation's
CRC is checked against zlib's. Reports the best of --repeat passes, in GB/s (10^9 bytes per second).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import zlib

from ucp.errors import UcpError
from ucp.format.crc import IMPLEMENTATIONS, crc32, use_crc32

PIECES = {"1 MiB": 1 << 20, "4 KiB": 4 << 10}


def throughput(data: memoryview, piece: int, repeat: int) -> float:
    """GB/s of checksumming `data` in pieces of `piece` bytes, best of `repeat` passes."""
    best = float("inf")
    for _ in range(repeat):
        began = time.perf_counter()
        for offset in range(0, len(data), piece):
            crc32(data[offset:offset + piece])
        best = min(best, time.perf_counter() - began)
    return len(data) / best / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="buffer size in MiB (default 256)")
    ap.add_argument("--repeat", type=int, default=5, help="passes per measurement; the best is reported")
    ap.add_argument("--markdown-out", metavar="FILE", help="also write the table as markdown to FILE")
    args = ap.parse_args(argv)

    data = memoryview(os.urandom(args.mib << 20))
    expected = zlib.crc32(data)
    rows = []
    for name in IMPLEMENTATIONS:
        try:
            use_crc32(name)
        except UcpError as e:
            print(f"{name}: skipped ({e})")
            continue
        if crc32(data) != expected:
            sys.exit(f"{name}: CRC-32 {crc32(data):08x}, zlib's is {expected:08x}")
        rows.append([name, *(f"{throughput(data, piece, args.repeat):.2f}" for piece in PIECES.values())])
    load = os.getloadavg()[0]
    header = ["implementation", *(f"GB/s, {label} pieces" for label in PIECES)]
    lines = [f"{args.mib} MiB of random bytes in RAM, one thread, best of {args.repeat}; {os.cpu_count()} CPUs, "
             f"1-min load average {load:.1f}", "", "| " + " | ".join(header) + " |",
             "|---|" + "---:|" * len(PIECES), *("| " + " | ".join(row) + " |" for row in rows)]
    print("\n".join(lines))
    if args.markdown_out:
        with open(args.markdown_out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
