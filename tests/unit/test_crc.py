"""`ucp.format.crc.crc32`: ISA-L or zlib-ng where installed, zlib otherwise, always zlib's values; and
`crc32_combine`, `segment_crcs` and `join_segments` on top of whichever it uses."""
from __future__ import annotations

import importlib.util
import random
import re
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from ucp.errors import UcpError
from ucp.format import crc
from ucp.format.crc import (
    CRC32_ENV,
    FAST_IMPLEMENTATIONS,
    IMPLEMENTATIONS,
    choose_crc32,
    crc32_combine,
    join_segments,
    segment_crcs,
)

MODULES = {name: module for name, module, _ in FAST_IMPLEMENTATIONS}


def installed(name: str) -> bool:
    return name == "zlib" or importlib.util.find_spec(MODULES[name].split(".")[0]) is not None


@pytest.fixture(autouse=True)
def kept_choice(monkeypatch):
    """Each test leaves the process's implementation as it found it."""
    monkeypatch.setattr(crc, "_chosen", crc._chosen)


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request) -> str:
    """Each implementation in turn, made the one `crc32` uses."""
    if not installed(request.param):
        pytest.skip(f"{request.param} is not installed (pip install ucp-checkpoint[fast])")
    assert crc.use_crc32(request.param) == crc.crc32_implementation() == request.param
    return request.param


def buffers(seed: int):
    """Random buffers of random sizes (empty, a few bytes, around the 5 KiB above which the libraries release the
    GIL, several MiB), as the types ucp checksums: bytes, memoryview slices, bytearray, numpy arrays."""
    rng = random.Random(seed)
    sizes = [0, 1, 3, 5119, 5120, 5121, 1 << 20, (3 << 20) + 17] + [rng.randint(0, 70000) for _ in range(60)]
    for size in sizes:
        data = rng.randbytes(size)
        yield data, data
        yield data[1:], memoryview(data)[1:]
        yield data, bytearray(data)
        yield data, np.frombuffer(data, dtype=np.uint8)


def test_crc32_equals_zlib_on_random_buffers(implementation):
    for expected, data in buffers(21):
        assert crc.crc32(data) == zlib.crc32(expected)
        assert crc.crc32(data, 0x5EED) == zlib.crc32(expected, 0x5EED)  # continuing from an earlier CRC
    assert crc.crc32(b"ucp") != zlib.crc32(b"ucq")  # negative control


def test_crc32_refuses_a_non_contiguous_array_as_zlib_does(implementation):
    with pytest.raises((ValueError, BufferError)):
        zlib.crc32(np.zeros(8, np.uint8)[::2])
    with pytest.raises((ValueError, BufferError)):
        crc.crc32(np.zeros(8, np.uint8)[::2])


def test_crc32_combine_and_join_segments_work_on_its_crcs(implementation):
    rng = random.Random(5)
    for _ in range(100):
        a, b = rng.randbytes(rng.randint(0, 9000)), rng.randbytes(rng.randint(0, 9000))
        assert crc32_combine(crc.crc32(a), crc.crc32(b), len(b)) == zlib.crc32(a + b)
    # Negative control: a wrong length gives another CRC.
    assert crc32_combine(crc.crc32(a), crc.crc32(b), len(b) + 1) != zlib.crc32(a + b)
    # Segments of two writers cut at chunk boundaries, joined as rank 0 joins an asynchronous save's.
    data, begin, chunk = rng.randbytes(100_000), 1000, 4096
    cut = 57_344  # a chunk boundary
    segments = segment_crcs(data[:cut - begin], begin, chunk) + segment_crcs(data[cut - begin:], cut, chunk)
    whole, chunks = join_segments(segments, begin, begin + len(data), chunk)
    assert whole == zlib.crc32(data)
    bounds = crc.chunk_bounds(begin, begin + len(data), chunk)
    assert chunks == [zlib.crc32(data[lo - begin:hi - begin]) for lo, hi in bounds]


def test_the_test_environment_has_a_fast_crc32(monkeypatch):
    """`pip install ucp-checkpoint[test]` brings the `fast` extra: the suite runs what users of it run."""
    monkeypatch.delenv(CRC32_ENV, raising=False)
    assert choose_crc32()[0] in ("isal", "zlib-ng")


@pytest.fixture
def no_fast_library(monkeypatch):
    """Neither isal nor zlib-ng importable, as where they are not installed."""
    for _, module, _ in FAST_IMPLEMENTATIONS:
        monkeypatch.setitem(sys.modules, module, None)
        monkeypatch.setitem(sys.modules, module.split(".")[0], None)


def test_without_isal_or_zlib_ng_crc32_falls_back_to_zlib(no_fast_library, monkeypatch):
    assert choose_crc32() == ("zlib", zlib.crc32)
    monkeypatch.delenv(CRC32_ENV, raising=False)
    monkeypatch.setattr(crc, "_chosen", None)  # as in a new process
    assert crc.crc32_implementation() == "zlib"
    for expected, data in buffers(3):
        assert crc.crc32(data) == zlib.crc32(expected)


def test_the_environment_names_an_implementation(monkeypatch):
    monkeypatch.setenv(CRC32_ENV, "zlib")
    monkeypatch.setattr(crc, "_chosen", None)  # as in a new process
    assert crc.crc32_implementation() == "zlib"
    assert crc.crc32(b"ucp") == zlib.crc32(b"ucp")
    with pytest.raises(UcpError, match=f"{CRC32_ENV}='crc64' names no CRC-32 implementation: use one of isal, "
                                       "zlib-ng, zlib"):
        choose_crc32("crc64")


def test_an_implementation_named_but_not_installed_is_one_clear_error(no_fast_library):
    with pytest.raises(UcpError, match=f"{CRC32_ENV}=isal: isal.isal_zlib is not installed; pip install isal"):
        choose_crc32("isal")
    with pytest.raises(UcpError, match=f"{CRC32_ENV}=zlib-ng: zlib_ng.zlib_ng is not installed; pip install zlib-ng"):
        choose_crc32("zlib-ng")


def test_every_checksum_of_the_package_goes_through_crc32():
    """convert's workers and source check, the async save's writers, the load checks, manifests, extra files: no
    module but ucp.format.crc calls zlib (or a CRC library) itself."""
    root = Path(__file__).resolve().parents[2]
    sources = [p for folder in ("ucp", "converters", "patterns", "cli") for p in (root / folder).rglob("*.py")]
    assert root / "ucp" / "format" / "crc.py" in sources  # negative control: the probe reads the CRC module
    calls = re.compile(r"^\s*(import|from)\s+(zlib|isal|zlib_ng)\b|\b(zlib|isal_zlib|zlib_ng)\.crc32\(", re.M)
    assert sorted(str(p.relative_to(root)) for p in sources if calls.search(p.read_text())) == ["ucp/format/crc.py"]
