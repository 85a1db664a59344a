"""Checkpoints on any fsspec filesystem a user has installed (issue #22), against fsspec's real in-process
`memory://` filesystem: a ucp checkpoint uploaded there (`ucp.convert.object_output.upload`, the upload `ucp convert
--output` does, index last) opens, verifies, inspects and exports as the same checkpoint in a local folder does,
tensor for tensor; reads are ranged (a filesystem registered under its own protocol counts the bytes it serves)
and run concurrently, no more than `max_in_flight()` at once; a flipped byte is caught by verify; a write makes
the folders a file system needs but never a bucket; `file:///abs` is the local path; a protocol whose package is
missing and an unknown one are refused in one line. (`ucp convert --input/--output memory://` from a DeepSpeed
checkpoint, and asynchronous saves through fsspec: tests/integration/test_fsspec.py.)
"""
from __future__ import annotations

import importlib.util
import threading
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import ucp
from support.dcp_leaves import assert_same_leaves, dcp_leaves
from ucp.cli.main import main
from ucp.convert.object_output import upload
from ucp.convert.tensors import write_tensors
from ucp.errors import UnsupportedStorageError
from ucp.export import to_dcp
from ucp.format.folder import read_index
from ucp.storage.locations import ObjectPath, location

OPTIMIZER = {"type": "AdamW", "states": ["exp_avg"], "param_groups": [{"hyperparams": {"lr": 0.1},
                                                                      "params": ["a.weight", "b.weight"]}]}


class CountingMemoryFileSystem(MemoryFileSystem):
    """fsspec's memory filesystem under protocol "ucpcount", with a store of its own, counting every byte it
    serves however it is asked (ranged `cat_file`, or a file opened for reading), and the most ranged reads it
    has had in flight at once (each takes `delay` seconds)."""

    protocol = "ucpcount"
    store: dict = {}
    pseudo_dirs = [""]
    served = 0
    delay = 0.0
    in_flight = most_in_flight = 0
    lock = threading.Lock()

    def cat_file(self, path, start=None, end=None, **kwargs):
        cls = CountingMemoryFileSystem
        with cls.lock:
            cls.in_flight += 1
            cls.most_in_flight = max(cls.most_in_flight, cls.in_flight)
        time.sleep(cls.delay)
        data = super().cat_file(path, start=start, end=end, **kwargs)
        with cls.lock:
            cls.in_flight -= 1
            cls.served += len(data)
        return data

    def _open(self, path, mode="rb", **kwargs):
        f = super()._open(path, mode, **kwargs)
        if "r" in mode:
            CountingMemoryFileSystem.served += self.size(path)
        return f


fsspec.register_implementation("ucpcount", CountingMemoryFileSystem, clobber=True)


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> Path:
    """A small ucp checkpoint in a local folder, its chunks small so that one tensor is several ranges."""
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": {"fp32": torch.randn(64, 32, generator=g), "exp_avg": torch.randn(64, 32, generator=g)},
               "b.weight": {"fp32": torch.randn(16, 8, generator=g).to(torch.bfloat16),
                            "exp_avg": np.arange(128, dtype=np.float32).reshape(16, 8)}}
    return write_tensors(tmp_path_factory.mktemp("fsspec") / "run1", tensors, optimizer=OPTIMIZER, step=3.0,
                         chunk_bytes=1024)


def uploaded(local: Path, protocol: str = "memory") -> str:
    """`local` uploaded to a new bucket of `protocol`, as `ucp convert --output` uploads it; its URL."""
    url = f"{protocol}://{uuid.uuid4().hex}/run1"
    upload(local, location(url), read_index(local))
    return url


@pytest.fixture
def url(local):
    url = uploaded(local)
    yield url
    fsspec.filesystem("memory").rm(url.rsplit("/", 1)[0], recursive=True)


def test_a_checkpoint_on_memory_opens_verifies_and_inspects_as_the_local_one(url, local, capsys):
    assert isinstance(location(url), ObjectPath)
    remote, here = ucp.open_checkpoint(url), ucp.open_checkpoint(local)
    assert remote.names == here.names and len(remote.names) == 2
    for name in here.names:
        for state in ("fp32", "exp_avg"):
            assert torch.equal(remote.tensor(name, state), here.tensor(name, state)), (name, state)
    assert remote.verify() == []
    assert main(["verify", url]) == 0
    capsys.readouterr()
    assert main(["inspect", url]) == 0
    assert "a.weight" in capsys.readouterr().out


def test_verify_catches_a_flipped_byte_in_an_object(url, local):
    name = next(n for n in read_index(local).files)
    path = location(url) / name
    fs = fsspec.filesystem("memory")
    data = bytearray(fs.cat_file(f"{path}"))
    assert main(["verify", url]) == 0  # control: intact
    data[-10] ^= 0xFF
    fs.pipe_file(str(path), bytes(data))
    assert main(["verify", url]) == 1


def test_reads_are_ranged_the_bytes_of_the_tensor_asked_for(local):
    url = uploaded(local, "ucpcount")
    try:
        remote, here = ucp.open_checkpoint(url), ucp.open_checkpoint(local)
        total = sum(p.stat().st_size for p in local.iterdir() if p.name in read_index(local).files)
        CountingMemoryFileSystem.served = 0
        assert torch.equal(remote.tensor("b.weight"), here.tensor("b.weight"))
        assert remote.counter.bytes == here.counter.bytes > 0
        # headers checked once, then the tensor's chunks: far from the whole files (a read of whole objects)
        assert CountingMemoryFileSystem.served <= remote.counter.bytes + 4096 < total, (
            CountingMemoryFileSystem.served, remote.counter.bytes, total)
    finally:
        fsspec.filesystem("ucpcount").rm(url.rsplit("/", 1)[0], recursive=True)


def test_ranged_reads_run_concurrently_and_bounded(local, monkeypatch):
    from ucp.storage.s3 import max_in_flight

    url = uploaded(local, "ucpcount")
    try:
        monkeypatch.setenv("UCP_S3_PART_BYTES", "512")  # a.weight's 8 KiB: 16 parts or more
        monkeypatch.setattr(CountingMemoryFileSystem, "delay", 0.05)
        CountingMemoryFileSystem.most_in_flight = 0
        remote = ucp.open_checkpoint(url)
        assert torch.equal(remote.tensor("a.weight"), ucp.open_checkpoint(local).tensor("a.weight"))
        assert 1 < CountingMemoryFileSystem.most_in_flight <= max_in_flight()
    finally:
        fsspec.filesystem("ucpcount").rm(url.rsplit("/", 1)[0], recursive=True)


def test_an_export_to_memory_loads_as_a_local_export(local, tmp_path):
    bucket = f"memory://{uuid.uuid4().hex}"
    try:
        to_dcp(local, f"{bucket}/dcp", progress=False)
        to_dcp(local, tmp_path / "dcp", progress=False)
        fs = fsspec.filesystem("memory")
        names = sorted(p.name for p in (tmp_path / "dcp").iterdir())
        assert sorted(Path(p).name for p in fs.ls(f"{bucket}/dcp", detail=False)) == names and names
        fs.get(f"{bucket}/dcp/", str(tmp_path / "down"), recursive=True)
        got, want = dcp_leaves(tmp_path / "down", tmp_path), dcp_leaves(tmp_path / "dcp", tmp_path)
        assert any("a.weight" in k for k in want)
        assert_same_leaves(got, want)
    finally:
        if fsspec.filesystem("memory").exists(bucket):
            fsspec.filesystem("memory").rm(bucket, recursive=True)


def test_file_urls_are_local_paths(local):
    assert location(f"file://{local}") == local
    assert torch.equal(ucp.open_checkpoint(f"file://{local}").tensor("a.weight"),
                       ucp.open_checkpoint(local).tensor("a.weight"))
    with pytest.raises(UnsupportedStorageError, match="file:///ABSOLUTE/PATH"):
        location("file://otherhost/x")


def test_writes_make_the_folders_a_file_system_needs_but_never_a_bucket(tmp_path, monkeypatch):
    """fsspec's local filesystem (under `local://`) wants a file's folder to exist, as HDFS does: a write makes it.
    Its URL's netloc plays a bucket's part: a missing one is refused, not created (gcsfs would create a bucket)."""
    from ucp.errors import StorageAccessError
    from ucp.storage.layer import read_small, write_whole

    target = location(f"local://{tmp_path}/new/sub/ucp_index.json")
    write_whole(target, b"{}")
    assert (tmp_path / "new" / "sub" / "ucp_index.json").read_bytes() == b"{}" == read_small(target)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(StorageAccessError, match="'nobucket' does not exist") as info:
        write_whole(location("local://nobucket/run1/latest"), b"x")
    assert "\n" not in str(info.value) and not (tmp_path / "nobucket").exists()
    write_whole(location("local://new/run1/latest"), b"x")  # control: an existing one takes the folders it needs
    assert (tmp_path / "new" / "run1" / "latest").read_bytes() == b"x"


@pytest.mark.parametrize("protocol", ["memory", "local"])
def test_deleting_or_moving_a_tree_leaves_no_folder_behind(local, tmp_path, protocol):
    """Retention (`"keep"`) deletes a tag's files and setting a damaged checkpoint aside moves them; a filesystem
    that keeps folders (local://, HDFS; memory:// keeps pseudo-folders) must not keep the tag's empty folder,
    which a listing of the save folder would still show."""
    from ucp.storage.layer import delete_tree, list_folders, move_tree

    root = f"memory://{uuid.uuid4().hex}" if protocol == "memory" else f"local://{tmp_path}/saves"
    try:
        for name in ("global_step1", "global_step2"):
            upload(local, location(f"{root}/{name}"), read_index(local))
        assert sorted(list_folders(location(root))) == ["global_step1", "global_step2"]  # control
        move_tree(location(f"{root}/global_step2"), location(f"{root}/global_step2.damaged"), "ucp_index.json")
        delete_tree(location(f"{root}/global_step1"))
        assert list_folders(location(root)) == ["global_step2.damaged"]
        assert ucp.open_checkpoint(f"{root}/global_step2.damaged").verify() == []
    finally:
        if protocol == "memory":
            fsspec.filesystem("memory").rm(root, recursive=True)


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_a_protocol_whose_package_is_missing_is_refused_naming_it(capsys):
    with pytest.raises(UnsupportedStorageError, match="gs://bucket/run1: .*install gcsfs") as info:
        location("gs://bucket/run1")
    assert "\n" not in str(info.value)
    assert main(["verify", "gs://bucket/run1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "gcsfs" in err, err


@pytest.mark.parametrize("url", ["nosuchprotocol://bucket/run1", "hf+s3://x/y"])
def test_an_unknown_protocol_is_refused_in_one_line(url):
    with pytest.raises(UnsupportedStorageError, match="no protocol fsspec knows") as info:
        location(url)
    assert "\n" not in str(info.value)


def test_an_upload_shared_by_writers_is_one_whole_part_on_fsspec(tmp_path):
    """The calls an asynchronous save uploads through (`storage.start_upload` ... `complete_upload`) are S3's
    multipart upload there, and here one part per file written whole by its uploader: the save's code is the same
    for both (`ucp.deepspeed.saving.uploads`); a part that is not the whole file is refused, and an abort removes
    what the upload wrote."""
    from ucp.errors import StorageAccessError
    from ucp.storage import layer as storage

    folder = location(f"memory://uploads-{uuid.uuid4().hex}/run1/global_step1")
    source = tmp_path / "data.bin"
    source.write_bytes(bytes(range(256)) * 5)
    assert storage.part_bytes(folder) is None
    target = folder / "data-00000-of-00001.safetensors"
    upload = storage.start_upload(target)
    with pytest.raises(StorageAccessError, match="written whole"):
        storage.upload_parts(source, target, upload, [(1, 0, 640), (2, 640, 1280)])
    parts = storage.upload_parts(source, target, upload, [(1, 0, 1280)])
    storage.complete_upload(target, upload, parts)
    assert storage.read_small(target) == source.read_bytes()
    storage.abort_upload(target, upload)
    assert storage.read_small(target) is None


def test_deletes_and_locks_take_any_location(tmp_path):
    """`storage.delete`, `delete_tree` and the readers' locks work on a local folder and a prefix alike, so
    retention (`"keep"`) asks no caller which it holds; a held shared lock keeps the exclusive one from a remover
    (negative control: released, it is free), and an object store, which has no locks, is always free."""
    from ucp.storage import layer as storage

    local = tmp_path / "global_step1"
    local.mkdir()
    (local / "a").write_bytes(b"a")
    prefix = location(f"memory://locks-{uuid.uuid4().hex}/run1/global_step1")
    storage.write_whole(prefix / "a", b"a")
    for folder in (local, prefix):
        with storage.shared_lock(folder.parent / ".lock"):
            with storage.exclusive_lock(folder.parent / ".lock") as free:
                assert free is isinstance(folder, ObjectPath)
        with storage.exclusive_lock(folder.parent / ".lock") as free:
            assert free
        storage.delete(folder / "a")
        storage.delete(folder / "a")  # none there: no error
        assert storage.read_small(folder / "a") is None
        storage.write_whole(folder / "b", b"b")
        storage.delete_tree(folder)
        assert storage.list_names(folder) == []
    assert not local.exists() and not (tmp_path / ".lock").exists()


def test_what_a_location_can_do_is_asked_of_storage(tmp_path, monkeypatch):
    """The capabilities callers ask instead of a location's kind: a local folder is reached through the file
    system, takes locks, is made with its parents and is made absolute against the working directory; a
    `memory://` prefix is remote, has no locks, needs no making (nothing appears) and stays as it is. `location`
    of either is the same object (an operation resolves its path once and passes the `Location` down)."""
    from ucp.storage import layer as storage

    monkeypatch.chdir(tmp_path)
    local = Path("run1") / "global_step1"
    prefix = location(f"memory://capabilities-{uuid.uuid4().hex}/run1/global_step1")
    assert not storage.is_remote(local) and storage.has_locks(local)
    assert storage.is_remote(prefix) and not storage.has_locks(prefix)
    assert location(local) is local and location(prefix) is prefix  # resolved once: a Location is itself
    assert storage.absolute(local) == tmp_path / "run1" / "global_step1"
    assert storage.absolute(prefix) is prefix
    storage.make_folder(local)
    storage.make_folder(local)  # already there: no error
    assert (tmp_path / "run1" / "global_step1").is_dir()
    storage.make_folder(prefix)
    assert storage.list_names(prefix.parent) == [] and storage.list_folders(prefix.parent) == []


def test_read_file_is_none_where_no_file_stands(tmp_path):
    """`storage.read_file` reads a small file whole, and is None where there is none, locally also where a
    folder stands under the name (negative control: `read_small` refuses the folder)."""
    from ucp.errors import CorruptCheckpointError
    from ucp.storage import layer as storage

    prefix = location(f"memory://read-file-{uuid.uuid4().hex}/run1")
    for folder in (tmp_path, prefix):
        assert storage.read_file(folder / "a") is None
        storage.write_whole(folder / "a", b"abc")
        assert storage.read_file(folder / "a", limit=3) == b"abc"
    (tmp_path / "sub").mkdir()
    assert storage.read_file(tmp_path / "sub") is None
    with pytest.raises(CorruptCheckpointError):
        storage.read_small(tmp_path / "sub")
