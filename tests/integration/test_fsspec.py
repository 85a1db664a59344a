"""`ucp convert` to and from any fsspec filesystem a user has installed (issue #22), against fsspec's real
in-process `memory://` filesystem, in-process through the Python API (torchrun children would not see it, and the
CLI refuses memory:// as an output: it dies with the command): the
tiny DeepSpeed checkpoint converted to memory:// writes the bytes a local conversion writes; the same DeepSpeed
folder uploaded as it is to memory:// converts from there to the same bytes and tensors, its source recorded as
the URL; converting it again finds the conversion done (the objects' modification times keep the fingerprint).
Converted from an http:// URL with a password in it, neither the output lines nor the index hold the password.
(Reads, verify, inspect, export and refusals: tests/unit/test_fsspec_storage.py.)

A 2-rank torchrun load reads a conversion through fsspec's `http://` filesystem from a web server on 127.0.0.1
(tests/support/http_files.py), a protocol other than s3:// that the ranks' processes all reach. A 2-rank training
job saves asynchronously through fsspec's `local://` filesystem (writable and seen by every rank's process, which
`memory://` is not): without S3's shared multipart uploads, each data file is written whole by one rank after
the others sent it their bytes.
"""
from __future__ import annotations

import uuid
from types import SimpleNamespace

import fsspec
import pytest
import torch

import ucp
from support.checkpoints import TinySpec, run_tiny, uninterrupted_losses
from support.http_files import HttpFiles
from test_zero_conversion import compare_loads
from ucp.cli.main import main
from ucp.convert import convert

SPEC = TinySpec(stage=1)


@pytest.fixture
def bucket():
    name = f"memory://{uuid.uuid4().hex}"
    yield name
    fs = fsspec.filesystem("memory")
    if fs.exists(name):
        fs.rm(name, recursive=True)


def test_convert_to_and_from_memory_writes_what_a_local_conversion_writes(tiny_checkpoint, tiny_conversion, bucket):
    """Through the Python API: `ucp convert --output memory://` is refused (the CLI's process, and the memory
    filesystem with it, ends with the command: test_network.py), while a caller of `convert` reads the result
    in its own process."""
    save_dir, local = tiny_checkpoint(SPEC), tiny_conversion(SPEC)
    fs = fsspec.filesystem("memory")
    data = sorted(p.name for p in local.iterdir() if p.name.startswith("data-"))
    assert data

    convert(save_dir, f"{bucket}/run1", progress=False)
    names = sorted(n.rsplit("/", 1)[-1] for n in fs.ls(f"{bucket}/run1", detail=False))
    assert names == sorted(data + ["ucp_index.json"])
    for name in data:
        assert fs.cat_file(f"{bucket}/run1/{name}") == (local / name).read_bytes(), name

    fs.put(f"{save_dir}/", f"{bucket}/ds-run", recursive=True)  # the DeepSpeed folder as it is
    assert not convert(f"{bucket}/ds-run", f"{bucket}/from-ds", progress=False).already_done
    for name in data:
        assert fs.cat_file(f"{bucket}/from-ds/{name}") == (local / name).read_bytes(), name
    remote, here = ucp.open_checkpoint(f"{bucket}/from-ds"), ucp.open_checkpoint(local)
    assert remote.index.run.source["path"].startswith(f"{bucket}/ds-run/"), remote.index.run.source
    name = here.names[0]
    assert torch.equal(remote.tensor(name), here.tensor(name))
    assert convert(f"{bucket}/ds-run", f"{bucket}/from-ds", progress=False).already_done


def test_a_conversion_from_a_url_with_credentials_records_and_shows_none(tiny_checkpoint, tmp_path, capsys):
    """`ucp convert --input http://user:SECRET@host/...` (the DeepSpeed folder served over HTTP; the server
    takes any user): neither its output lines nor the index's recorded source hold the password."""
    secret = "SeCrEt-77e1"
    save_dir = tiny_checkpoint(SPEC)
    server = HttpFiles(save_dir.parent).start()
    try:
        url = f"{server.url.replace('http://', f'http://user:{secret}@')}/{save_dir.name}"
        assert main(["convert", "--input", url, "--output", str(tmp_path / "out")]) == 0
    finally:
        server.stop()
    out = capsys.readouterr()
    index = (tmp_path / "out" / "ucp_index.json").read_text()
    assert secret not in out.out + out.err + index
    source = ucp.open_checkpoint(tmp_path / "out").index.run.source["path"]
    assert source.startswith(f"{server.url.replace('http://', 'http://***@')}/{save_dir.name}/"), source


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


SAVE_SPEC = TinySpec(stage=2, steps=0)  # 2 ranks at ZeRO-2: every data file holds bytes of both ranks


def save_run(url: str, steps: int, ckpt_root, tmp_path, name: str):
    """train_tiny.py on 2 ranks with `"save": {"dir": url, "every": 1, "keep": 2}` and `"load": "auto"`."""
    extra = ["--ucp-save-dir", url, "--ucp-save-every", "1", "--ucp-save-keep", "2", "--ucp-load", "auto"]
    return run_tiny(SAVE_SPEC, tmp_path / name, steps=steps, save=False, extra_args=extra)


def test_async_saves_through_fsspec_keep_the_newest_two_and_auto_resume_continues_the_run(ckpt_root, tmp_path,
                                                                                          capsys):
    """Saves every step to a `local://` URL (fsspec's filesystem, not ucp's local path) with "keep": 2, then
    "load": "auto" from there: every saved checkpoint verifies (the CRC-32s the ranks took of their own pieces
    hold for the files one rank wrote from both ranks' bytes), and the resumed run's losses are the
    uninterrupted run's (fp32, same layout)."""
    folder = tmp_path / "saves"
    url = f"local://{folder}"
    first = save_run(url, 3, ckpt_root, tmp_path, "first")
    straight = uninterrupted_losses(SAVE_SPEC, 5, ckpt_root)
    assert first.losses == straight[:3]
    assert sorted(p.name for p in folder.iterdir()) == ["global_step2", "global_step3", "latest", "ucp_progress.json"]
    data = sorted((folder / "global_step3").glob("data-*.safetensors"))
    assert data and not list(folder.rglob("*.partial*"))
    capsys.readouterr()
    assert main(["verify", f"{url}/global_step2"]) == 0 and main(["verify", url]) == 0
    assert capsys.readouterr().out.count(": OK") == 2

    resumed = save_run(url, 2, ckpt_root, tmp_path, "resumed")
    log = (tmp_path / "resumed" / "train.log").read_text()
    assert f"resuming from {url}/global_step3 (step 3)" in log, log[-3000:]
    assert resumed.losses == pytest.approx(straight[3:5], rel=1e-6)
    assert sorted(p.name for p in folder.iterdir()) == ["global_step4", "global_step5", "latest", "ucp_progress.json"]
    assert (folder / "latest").read_text() == "global_step5"
