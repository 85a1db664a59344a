"""The allow-list reader of `torch.save` files (ucp.converters.torch_zip) against hostile zip and pickle
structure: it refuses, as one `CorruptCheckpointError`, every file `torch.load` refuses, and reads what
`torch.load` reads, never the bytes of a neighbouring entry.

Each file is a real `torch.save` archive of one tensor whose `data.pkl` is replaced by a pickle that rebuilds
the tensor with chosen storage offset, size and declared storage size (what a tampered file can say).
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import signal
import zipfile
from pathlib import Path

import pytest
import torch

from ucp.converters.torch_zip import load_lazy, read_tensor, storage_entries
from ucp.errors import CorruptCheckpointError

ELEMENTS = 4


class _StorageRef:
    """Pickled as the persistent id of the archive's one storage (`data/0`)."""


class _Tensor:
    def __init__(self, offset: int, size: int):
        self.offset, self.size = offset, size

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2,
                (_StorageRef(), self.offset, (self.size,), (1,), False, collections.OrderedDict()))


def crafted(path: Path, offset: int, size: int, declared: int = ELEMENTS, duplicate: bool = False) -> Path:
    """`torch.save({"t": ...})` of a float32 storage of ELEMENTS elements, its tensor rebuilt at `offset` with
    `size` elements from a storage said to hold `declared`; `duplicate` adds a second `data/0` entry of zeros."""
    real = io.BytesIO()
    torch.save(torch.arange(1.0, ELEMENTS + 1), real)

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", torch.FloatStorage, "0", "cpu", declared) if isinstance(obj, _StorageRef) else None

    pkl = io.BytesIO()
    Pickler(pkl, protocol=2).dump({"t": _Tensor(offset, size)})
    with zipfile.ZipFile(real) as source, zipfile.ZipFile(path, "w") as out:
        for info in source.infolist():
            data = pkl.getvalue() if info.filename.endswith("/data.pkl") else source.read(info)
            out.writestr(info.filename, data)
            if duplicate and info.filename.endswith("/data/0"):
                with pytest.warns(UserWarning, match="Duplicate name"):
                    out.writestr(info.filename, bytes(len(data)))
    return path


def test_what_torch_load_reads_ucp_reads(tmp_path):
    """Negative control: a crafted file within bounds reads the same through both."""
    path = crafted(tmp_path / "ok.pt", 1, 2)
    assert torch.equal(read_tensor(load_lazy(path)["t"]), torch.load(path, weights_only=True)["t"])


@pytest.mark.parametrize("offset, size, declared, what", [
    (-8, 2, ELEMENTS, "storage offset -8"),         # before the entry: the bytes of the entry ahead
    (1, ELEMENTS, ELEMENTS, r"elements \[1, 5\)"),  # one past its end: the next entry's first bytes
    (2 ** 62, 1, ELEMENTS, r"elements \[4611686018427387904, "),  # a huge offset: was an OverflowError
    (0, 2, 2 * ELEMENTS, "declares 8 float32 elements"),  # a storage larger than its entry
    (0, 2, 2, "declares 2 float32 elements"),             # ... or smaller
], ids=["offset-8", "offset+1", "huge-offset", "storage-larger", "storage-smaller"])
def test_a_tensor_outside_its_zip_entry_is_refused_as_torch_load_refuses_it(tmp_path, offset, size, declared, what):
    path = crafted(tmp_path / "bad.pt", offset, size, declared)
    with pytest.raises(RuntimeError):  # torch.load refuses it too
        torch.load(path, weights_only=True)
    with pytest.raises(CorruptCheckpointError, match=f"{path}: .*{what}.*copy it again"):
        load_lazy(path)


def test_a_duplicate_zip_entry_name_is_refused(tmp_path):
    """Two entries named `data/0`: zipfile and torch.load would each pick one; ucp refuses the file."""
    path = crafted(tmp_path / "twice.pt", 0, ELEMENTS, duplicate=True)
    with pytest.raises(CorruptCheckpointError, match=r"holds 2 entries named '.*/data/0'"):
        load_lazy(path)
    with pytest.raises(CorruptCheckpointError, match="entries named"):
        storage_entries(path)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_special_file_is_refused_without_blocking_or_reading(tmp_path, kind):
    """A FIFO (opening it for reading would wait for a writer forever) and /dev/zero (endless zeros)."""
    path = tmp_path / "rank.pt"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    def hang(signum, frame):
        raise TimeoutError(f"{kind}: no answer in 10 s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(10)
    try:
        for read in (load_lazy, storage_entries):
            with pytest.raises(CorruptCheckpointError, match=f"{path}: not a regular file"):
                read(path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
