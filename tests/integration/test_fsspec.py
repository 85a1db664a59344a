"""`ucp convert` to and from any fsspec filesystem a user has installed (issue #22), against fsspec's real
in-process `memory://` filesystem, in-process through the CLI's `main` (torchrun children would not see it): the
tiny DeepSpeed checkpoint converted to memory:// writes the bytes a local conversion writes; the same DeepSpeed
folder uploaded as it is to memory:// converts from there to the same bytes and tensors, its source recorded as
the URL; converting it again finds the conversion done (the objects' modification times keep the fingerprint).
(Reads, verify, inspect, export and refusals: tests/unit/test_fsspec_storage.py.)
"""
from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

import ucp
from support.checkpoints import TinySpec
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
