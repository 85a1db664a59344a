"""An object-storage URL is never taken for a local path (issue #22): every entry point refuses it in one line
and writes nothing, where `ucp convert --output s3://bucket/run1` used to write a local folder `s3:` and exit 0."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ucp
import ucp.deepspeed
from ucp.convert.driver import convert
from ucp.deepspeed.async_save import SaveEvery
from ucp.errors import UnsupportedStorageError
from ucp.export import to_dcp, to_hf
from ucp.format.folder import local_path

URLS = ["s3://bucket/run1", "gs://bucket/run1", "file:///tmp/run1", "hf+s3://x/y"]
UCP = [sys.executable, "-m", "ucp.cli.main"]


@pytest.mark.parametrize("url", URLS)
def test_a_url_is_refused_naming_itself(url):
    with pytest.raises(UnsupportedStorageError, match=url.replace("+", r"\+")):
        local_path(url)


@pytest.mark.parametrize("path", ["ckpt/run1", "/abs/s3:/x", "s3:bucket", "./s3://x", "weird name://not a url"])
def test_local_paths_pass_unchanged(path):
    """Only `scheme://` at the very start is a URL; a folder named `s3:` or a path that holds `://` later is
    a path (control)."""
    assert local_path(path) == Path(path)


@pytest.mark.parametrize("call", [
    lambda tmp: convert(tmp / "in", "s3://bucket/run1", progress=False),
    lambda tmp: convert("s3://bucket/run1", tmp / "out", progress=False),
    lambda tmp: ucp.open_checkpoint("s3://bucket/run1"),
    lambda tmp: to_hf(tmp / "in", "s3://bucket/hf", progress=False),
    lambda tmp: to_dcp(tmp / "in", "s3://bucket/dcp", progress=False),
    lambda tmp: SaveEvery.from_config({"dir": "s3://bucket/ckpt", "every": 1}),
    lambda tmp: ucp.deepspeed.load(object(), "s3://bucket/ckpt"),
    lambda tmp: ucp.deepspeed.save(object(), "s3://bucket/ckpt"),
], ids=["convert-output", "convert-input", "open_checkpoint", "to_hf", "to_dcp", "save-config", "deepspeed.load",
        "deepspeed.save"])
def test_api_entry_points_refuse_urls_before_touching_disk(call, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError):
        call(tmp_path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", [
    ["convert", "--input", "IN", "--output", "s3://bucket/run1"],
    ["verify", "s3://bucket/run1"],
    ["inspect", "s3://bucket/run1"],
    ["export", "--to", "hf", "--input", "IN", "--output", "s3://bucket/hf"],
])
def test_cli_refuses_urls_in_one_line_and_writes_nothing(argv, tmp_path):
    (tmp_path / "IN").mkdir()
    out = subprocess.run([*UCP, *argv], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "s3://bucket/" in out.stderr, out.stderr
    assert sorted(os.listdir(tmp_path)) == ["IN"]
