"""`ucp convert` to and from any fsspec filesystem a user has installed (issue #22), against fsspec's real
in-process `memory://` filesystem, in-process through the CLI's `main` (torchrun children would not see it): the
tiny DeepSpeed checkpoint converted to memory:// writes the bytes a local conversion writes; the same DeepSpeed
folder uploaded as it is to memory:// converts from there to the same bytes and tensors, its source recorded as
the URL; converting it again finds the conversion done (the objects' modification times keep the fingerprint).
(Reads, verify, inspect, export and refusals: tests/unit/test_fsspec_storage.py.)

A 2-rank torchrun load reads a conversion through fsspec's `http://` filesystem from a web server on 127.0.0.1
(tests/support/http_files.py), a protocol other than s3:// that the ranks' processes all reach.
"""
from __future__ import annotations

import uuid
from types import SimpleNamespace

import fsspec
import pytest
import torch

import ucp
from support.checkpoints import TinySpec
from support.http_files import HttpFiles
from test_zero_conversion import compare_loads
from ucp.cli.main import main

SPEC = TinySpec(stage=1)


@pytest.fixture
def bucket():
    name = f"memory://{uuid.uuid4().hex}"
    yield name
    fs = fsspec.filesystem("memory")
    if fs.exists(name):
        fs.rm(name, recursive=True)


def test_convert_to_and_from_memory_writes_what_a_local_conversion_writes(tiny_checkpoint, tiny_conversion, bucket,
                                                                          capsys):
    save_dir, local = tiny_checkpoint(SPEC), tiny_conversion(SPEC)
    fs = fsspec.filesystem("memory")
    data = sorted(p.name for p in local.iterdir() if p.name.startswith("data-"))
    assert data

    assert main(["convert", "--input", str(save_dir), "--output", f"{bucket}/run1", "--quiet"]) == 0
    names = sorted(n.rsplit("/", 1)[-1] for n in fs.ls(f"{bucket}/run1", detail=False))
    assert names == sorted(data + ["ucp_index.json"])
    for name in data:
        assert fs.cat_file(f"{bucket}/run1/{name}") == (local / name).read_bytes(), name

    fs.put(f"{save_dir}/", f"{bucket}/ds-run", recursive=True)  # the DeepSpeed folder as it is
    assert main(["convert", "--input", f"{bucket}/ds-run", "--output", f"{bucket}/from-ds", "--quiet"]) == 0
    for name in data:
        assert fs.cat_file(f"{bucket}/from-ds/{name}") == (local / name).read_bytes(), name
    remote, here = ucp.open_checkpoint(f"{bucket}/from-ds"), ucp.open_checkpoint(local)
    assert remote.index.run.source["path"].startswith(f"{bucket}/ds-run/"), remote.index.run.source
    name = here.names[0]
    assert torch.equal(remote.tensor(name), here.tensor(name))
    capsys.readouterr()
    assert main(["convert", "--input", f"{bucket}/ds-run", "--output", f"{bucket}/from-ds", "--quiet"]) == 0
    assert "already holds this conversion" in capsys.readouterr().out


@pytest.fixture
def served(tiny_conversion):
    """The tiny conversion served read-only over HTTP on 127.0.0.1; its URL and the server's record of GETs."""
    local = tiny_conversion(SPEC)
    server = HttpFiles(local.parent).start()
    try:
        yield SimpleNamespace(server=server, url=f"{server.url}/{local.name}", local=local)
    finally:
        server.stop()


def test_a_two_rank_load_over_http_equals_a_local_load_and_reads_no_more_bytes(served, ckpt_root, capsys):
    """Each torchrun rank reads its ranges through fsspec's http:// filesystem (ranged GETs, answered 206): every
    loaded tensor is torch.equal to a local load's, and the tensor bytes the server sent are the bytes the ranks
    say they read, no more than the local load reads. verify and inspect take the URL too."""
    served.server.reset()
    ranks = compare_loads(served.local, served.url, SPEC, ckpt_root)
    for result in ranks:
        assert result["names"] and all(result["equal"]), [n for n, e in zip(result["names"], result["equal"]) if not e]
        assert result["meta_equal"]
    header_end = {f"/{served.local.name}/{name}": f.header_end
                  for name, f in ucp.open_checkpoint(served.local).index.files.items()}
    tensor_bytes = sum(get.body_bytes for get in served.server.gets if get.path in header_end
                       and get.range_begin is not None and get.range_begin >= header_end[get.path])
    local_bytes = sum(result["stats"][0]["bytes_read"] for result in ranks)
    http_bytes = sum(result["stats"][1]["bytes_read"] for result in ranks)
    assert 0 < tensor_bytes == http_bytes <= local_bytes, (tensor_bytes, http_bytes, local_bytes)
    assert not [get for get in served.server.gets if get.path in header_end and get.range_begin is None]

    capsys.readouterr()
    assert main(["verify", served.url]) == 0
    assert main(["inspect", served.url]) == 0
    assert ucp.open_checkpoint(served.url).names[0] in capsys.readouterr().out
