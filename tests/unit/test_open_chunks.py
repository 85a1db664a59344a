"""Chunks that ranks read only parts of are checked by their owner rank from every rank's parts
(checked_read.close_chunks)."""
import zlib

import pytest

from ucp.errors import CorruptCheckpointError
from ucp.format.checked_read import OpenChunk, close_chunks
from ucp.storage.fileio import ReadCounter

DATA = bytes(range(256)) * 4  # one chunk of 1,024 bytes at file offset 0


def _part(lo: int, hi: int, data: bytes = DATA) -> tuple[int, int, int]:
    return lo, hi, zlib.crc32(data[lo:hi])


def _open(part) -> OpenChunk:
    return OpenChunk("f", 0, len(DATA), zlib.crc32(DATA), part, "f: w:fp32")


@pytest.fixture
def root(tmp_path):
    (tmp_path / "f").write_bytes(DATA)
    return tmp_path


def test_parts_that_tile_the_chunk_check_it_without_reading(root):
    mine, theirs = _open(_part(0, 300)), _open(_part(300, 1024))
    counter = ReadCounter()
    assert close_chunks(root, [mine, theirs], counter) == 0 and counter.bytes == 0


def test_overlapping_parts_of_replicated_reads_still_join(root):
    parts = [_open(_part(0, 300)), _open(_part(0, 700)), _open(_part(700, 1024)), _open(_part(300, 1024))]
    assert close_chunks(root, parts, ReadCounter()) == 0


def test_what_no_rank_read_is_read_and_only_that(root):
    mine = _open(_part(100, 300))
    counter = ReadCounter()
    assert close_chunks(root, [mine], counter) == 1024 - 200 == counter.bytes


def test_a_part_read_from_damaged_bytes_fails_the_chunk(root):
    damaged = DATA[:500] + bytes([DATA[500] ^ 1]) + DATA[501:]
    mine, theirs = _open(_part(0, 300)), _open(_part(300, 1024, damaged))  # the other rank read a flipped bit
    with pytest.raises(CorruptCheckpointError, match=r"f: w:fp32 bytes \[0, 1024\) fail their checksum"):
        close_chunks(root, [mine, theirs], ReadCounter())


def test_a_damaged_gap_fails_the_chunk(root):
    (root / "f").write_bytes(DATA[:900] + b"\0" + DATA[901:])
    mine = _open(_part(0, 300))
    with pytest.raises(CorruptCheckpointError, match="fail their checksum"):
        close_chunks(root, [mine], ReadCounter())
