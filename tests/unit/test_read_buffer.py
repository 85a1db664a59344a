"""`ucp.storage.fileio.read_buffer`: what a load reads into. A buffer from 1 MiB on is a mapping of its own, gone
from the process as soon as the last tensor viewing it is (a heap block of that size could stay with the
allocator: glibc's mmap threshold rises to 32 MiB as blocks are freed)."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from ucp.storage.fileio import MAPPED_BUFFER_BYTES, read_buffer

MAPS = Path("/proc/self/maps")
PAGE = os.sysconf("SC_PAGE_SIZE")


def mappings_of(nbytes: int) -> int:
    """How many mappings of the process are exactly `nbytes` long."""
    count = 0
    for line in MAPS.read_text().splitlines():
        begin, end = (int(x, 16) for x in line.split()[0].split("-"))
        count += end - begin == nbytes
    return count


@pytest.mark.skipif(not MAPS.exists(), reason="needs /proc/self/maps (Linux)")
def test_a_large_buffer_is_its_own_mapping_until_its_last_view_is_freed():
    nbytes = 5 * MAPPED_BUFFER_BYTES + 3 * PAGE  # a size no other mapping of the process is likely to have
    before = mappings_of(nbytes)
    buf = read_buffer(nbytes)
    assert buf.dtype == torch.uint8 and buf.numel() == nbytes
    buf.fill_(7)  # writable
    part = buf.narrow(0, PAGE, 16)
    del buf
    gc.collect()
    assert mappings_of(nbytes) == before + 1 and torch.equal(part, torch.full((16,), 7, dtype=torch.uint8))
    del part
    gc.collect()
    assert mappings_of(nbytes) == before



def test_a_small_buffer_is_a_plain_tensor():
    small = read_buffer(MAPPED_BUFFER_BYTES - 1)
    assert small.dtype == torch.uint8 and small.numel() == MAPPED_BUFFER_BYTES - 1
    small.fill_(1)
    assert int(small.sum()) == MAPPED_BUFFER_BYTES - 1
