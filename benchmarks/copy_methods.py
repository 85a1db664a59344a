#!/usr/bin/env python
"""Ways to copy a file's bytes and CRC-32 them on the way, timed on one rank file (what `ucp.convert.bin_copy`
chose from).

    python benchmarks/copy_methods.py FILE [--repeat 3]

Each method copies FILE (warm in the page cache) into a new file in the same folder, CRCs every byte, and
fsyncs; the table gives the median seconds before the fsync, of the fsync, and both:

* `pread+crc+pwrite B`: read B bytes into a reused buffer, CRC them, write them (what ucp does, B = 1 MiB);
* `mmap+crc+pwrite B`: map B bytes of the source (MAP_POPULATE), CRC and write straight from the mapping;
* `copy_file_range+pread crc B`: the kernel copies (no user-space copy of the data), and the same bytes are
  read from the page cache to be CRC'd, which the output's and the source's checksums need anyway.
"""
from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time

from ucp.format.crc import crc32


def pread_crc_write(src: int, out: int, size: int, block: int) -> None:
    buffer = memoryview(bytearray(block))
    offset = 0
    while offset < size:
        n = os.preadv(src, [buffer[:min(block, size - offset)]], offset)
        crc32(buffer[:n])
        os.pwrite(out, buffer[:n], offset)
        offset += n


def mmap_crc_write(src: int, out: int, size: int, block: int) -> None:
    offset = 0
    while offset < size:
        n = min(block, size - offset)
        with mmap.mmap(src, n, prot=mmap.PROT_READ, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, offset=offset) as m:
            view = memoryview(m)
            crc32(view)
            os.pwrite(out, view, offset)
            view.release()
        offset += n


def copy_range_crc(src: int, out: int, size: int, block: int) -> None:
    buffer = memoryview(bytearray(block))
    offset = 0
    while offset < size:
        n = os.preadv(src, [buffer[:min(block, size - offset)]], offset)
        crc32(buffer[:n])
        done = 0
        while done < n:
            done += os.copy_file_range(src, out, n - done, offset + done, offset + done)
        offset += n


METHODS = {"pread+crc+pwrite": pread_crc_write, "mmap+crc+pwrite": mmap_crc_write,
           "copy_file_range+pread crc": copy_range_crc}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--blocks", default="262144,1048576,8388608", help="block sizes in bytes, comma-separated")
    args = ap.parse_args()
    size = os.path.getsize(args.file)
    target = args.file + ".copy-methods"
    src = os.open(args.file, os.O_RDONLY)
    with open(args.file, "rb") as f:  # warm the page cache
        while f.read(8 << 20):
            pass
    print(f"{args.file}: {size / 2**20:.0f} MiB; medians of {args.repeat}; load average {os.getloadavg()[0]:.1f}")
    print("| method | block | copy+crc s | fsync s | total s |\n|---|---:|---:|---:|---:|")
    for block in (int(b) for b in args.blocks.split(",")):
        for name, method in METHODS.items():
            runs = []
            for _ in range(args.repeat):
                os.sync()
                out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                t0 = time.perf_counter()
                method(src, out, size, block)
                t1 = time.perf_counter()
                os.fsync(out)
                t2 = time.perf_counter()
                os.close(out)
                os.remove(target)
                runs.append((t1 - t0, t2 - t1))
            copy, sync = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
            print(f"| {name} | {block >> 10} KiB | {copy:.3f} | {sync:.3f} | {copy + sync:.3f} |", flush=True)
    os.close(src)


if __name__ == "__main__":
    main()
