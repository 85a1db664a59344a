"""LocalStore's uploads (the local equivalent of a multipart upload) and `storage.store_of`'s dispatch."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ucp.errors import UnsupportedStorageError
from ucp.storage import layer as storage
from ucp.storage.local import LocalStore
from ucp.storage.locations import location


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "source.bin"
    path.write_bytes(os.urandom(100_003))
    return path


def test_parts_written_out_of_order_complete_into_the_source_bytes(tmp_path, source):
    store, target = LocalStore(), tmp_path / "out" / "data.bin"
    upload = store.start_upload(target)
    reported = store.upload_parts(source, target, upload, [(3, 80_000, 100_003), (1, 0, 30_000)])
    reported += store.upload_parts(source, target, upload, [(2, 30_000, 80_000)])
    assert not target.exists()  # nothing under the final name before the upload completes
    store.complete_upload(target, upload, reported)
    assert target.read_bytes() == source.read_bytes()
    assert sorted(p["PartNumber"] for p in reported) == [1, 2, 3]
    assert os.listdir(target.parent) == ["data.bin"]  # no partial file left


def test_a_part_missing_leaves_other_bytes(tmp_path, source):
    # Negative control: the comparison above can fail.
    store, target = LocalStore(), tmp_path / "data.bin"
    upload = store.start_upload(target)
    store.upload_parts(source, target, upload, [(1, 0, 30_000), (3, 80_000, 100_003)])
    store.complete_upload(target, upload, [])
    assert target.read_bytes() != source.read_bytes()


def test_an_aborted_upload_leaves_nothing(tmp_path, source):
    store, target = LocalStore(), tmp_path / "data.bin"
    upload = store.start_upload(target)
    store.upload_parts(source, target, upload, [(1, 0, 50_000)])
    store.abort_upload(target, upload)
    assert os.listdir(tmp_path) == ["source.bin"]


def test_abort_uploads_removes_the_partial_files_under_a_folder(tmp_path, source):
    store = LocalStore()
    for target in (tmp_path / "a.bin", tmp_path / "sub" / "b.bin"):
        store.start_upload(target)
    assert store.abort_uploads(tmp_path) == 2
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["source.bin", "sub"]


def test_upload_file_copies_the_file(tmp_path, source):
    target = tmp_path / "copy" / "data.bin"
    LocalStore().upload_file(source, target)
    assert target.read_bytes() == source.read_bytes()
    assert os.listdir(target.parent) == ["data.bin"]
    assert LocalStore().part_bytes() is None


def test_store_of_tells_local_from_remote(tmp_path):
    local = storage.store_of(tmp_path)
    assert isinstance(local, LocalStore) and storage.store_of(str(tmp_path)) is local
    assert not local.remote and local.locks
    remote = storage.store_of(location("s3://bucket/run1"))
    assert remote.remote and not remote.locks
    assert storage.store_of(location("s3://other/run2")) is remote  # one store per scheme
    assert storage.is_remote(location("s3://bucket/run1")) and not storage.is_remote(tmp_path)


def test_a_remote_store_refuses_writes_at_offsets():
    with pytest.raises(UnsupportedStorageError, match="no writes at offsets"):
        storage.write_ranges([(location("s3://bucket/run1/a.bin"), 0, b"x")])  # type: ignore[list-item]


def loaded_after(statements: str) -> str:
    """Which of boto3 and fsspec a fresh interpreter has loaded after `statements`."""
    code = (f"import sys; from pathlib import Path; from ucp.storage import layer as storage, locations; {statements}; "
            "print('loaded:' + ','.join(m for m in ('boto3', 'fsspec') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip().splitlines()[-1]


def test_a_local_path_imports_no_object_store_client(tmp_path):
    written = tmp_path / "f"
    assert loaded_after(f"storage.write_whole(Path({str(written)!r}), b'x'); storage.store_of(Path('.'))"
                        ) == "loaded:"
    assert written.read_bytes() == b"x"
    # Control: an s3:// store does import boto3 once it makes a request.
    assert loaded_after("storage.store_of(locations.location('s3://b/r')).backend._client()") == "loaded:boto3"
