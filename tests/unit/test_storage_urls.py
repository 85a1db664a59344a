"""An object-storage URL is never taken for a local path (issue #22). `s3://bucket/prefix` (and the URL of any
other fsspec filesystem installed: test_fsspec_storage.py) is an `ObjectPath` where ucp reads and writes object
storage (`ucp convert`, inspect, verify, `ucp export`, `open_checkpoint`, `ucp.deepspeed.load` and `save`,
`ucp.transformers.train`, `ucp.accelerate.load_state`; tests/integration/test_s3.py runs them against a real S3
server, and checks their refusals of other URLs); every other entry point refuses it in one line that says where
URLs work, and a protocol fsspec does not know, or whose package is not installed, is refused everywhere, writing
nothing, where `ucp convert --output s3://bucket/run1` used to write a local folder `s3:` and exit 0.

Issue #32's pure parts: `redact` shows a URL without its credentials (every error, `ObjectPath`'s str and repr),
an IPv6 host is no chained URL, and a tag is one plain name once percent-decoded (test_network.py drives them
through the CLI against real servers)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ucp
import ucp.deepspeed
from ucp.convert.driver import convert
from ucp.deepspeed.config import SaveOptions
from ucp.errors import UnsupportedStorageError
from ucp.export import to_dcp, to_hf
from ucp.format.folder import local_path
from ucp.storage.locations import ObjectPath, location

# gs:// needs gcsfs, not installed here; hf+s3:// is no protocol fsspec knows
URLS = ["s3://bucket/run1", "gs://bucket/run1", "hf+s3://x/y", "memory://bucket/run1"]
OTHER_PROTOCOLS = URLS[1:3]
UCP = [sys.executable, "-m", "ucp.cli.main"]


@pytest.mark.parametrize("url", URLS)
def test_a_url_is_refused_where_local_folders_only_go_naming_itself(url):
    with pytest.raises(UnsupportedStorageError, match=url.replace("+", r"\+")):
        local_path(url)


def test_gcsfs_is_not_installed_here():
    """The refusals below take gs:// for a protocol whose package is missing."""
    import importlib.util

    assert importlib.util.find_spec("gcsfs") is None


def test_local_only_entry_points_say_where_s3_works():
    with pytest.raises(UnsupportedStorageError, match="ucp convert --format deepspeed --output takes local .* URLs: "
                                                      "s3:// and the protocols of any fsspec filesystem installed .* "
                                                      "with ucp convert --input and --output, ucp inspect, ucp "
                                                      "verify, ucp export --input and --output, ucp.open_checkpoint"):
        local_path("s3://bucket/run1", "ucp convert --format deepspeed --output")


@pytest.mark.parametrize("url, bucket, key", [("s3://bucket/run1", "bucket", "run1"),
                                              ("s3://bucket/a/b/", "bucket", "a/b"), ("S3://bucket", "bucket", "")])
def test_s3_urls_are_object_paths(url, bucket, key):
    place = location(url)
    assert place == ObjectPath("s3", bucket, key)
    assert str(place / "ucp_index.json") == f"s3://{bucket}/{key + '/' if key else ''}ucp_index.json"
    assert place.name == key.rsplit("/", 1)[-1] and (place / "checkpoint-3").name == "checkpoint-3"  # as Path.name
    assert (place / "checkpoint-3").parent == place and place.parent == ObjectPath("s3", bucket, key.rpartition("/")[0])
    assert not hasattr(place, "__fspath__")  # never opened as a local file by mistake


@pytest.mark.parametrize("url", OTHER_PROTOCOLS + ["s3:///no-bucket", "file://otherhost/run1", "memory://",
                                 "simplecache::memory://bucket/run1", "zip://a.txt::memory://bucket/a.zip"])
def test_other_protocols_are_refused_in_one_line(url):
    with pytest.raises(UnsupportedStorageError, match=url.replace("+", r"\+")) as info:
        location(url)
    assert "\n" not in str(info.value)


def test_s3_without_boto3_is_refused_in_one_line():
    code = ("import sys; sys.modules['boto3'] = None; from ucp.storage.locations import location; "
            "location('s3://bucket/run1')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "UnsupportedStorageError: s3://bucket/run1: object storage needs boto3" in out.stderr


def test_file_urls_are_local_paths():
    assert location("file:///tmp/run1") == local_path("file:///tmp/run1") == Path("/tmp/run1")
    assert location("file://localhost/tmp/run1") == Path("/tmp/run1")


@pytest.mark.parametrize("path", ["ckpt/run1", "/abs/s3:/x", "s3:bucket", "./s3://x", "weird name://not a url",
                                  "a::b/c", "./simplecache::s3://x"])
def test_local_paths_pass_unchanged(path):
    """Only `scheme://` at the very start is a URL; a folder named `s3:` or a path that holds `://` later is
    a path (control)."""
    assert local_path(path) == Path(path)
    assert location(path) == Path(path)


@pytest.mark.parametrize("call", [
    lambda tmp: convert(tmp / "in", "s3://bucket/run1", fmt="deepspeed", progress=False),
    lambda tmp: convert(tmp / "in", "s3://bucket/run1", resume=True, progress=False),
], ids=["convert-output-deepspeed-format", "convert-output-resume"])
def test_options_without_object_storage_refuse_s3_before_touching_disk(call, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError, match="s3://bucket/"):
        call(tmp_path)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("url", OTHER_PROTOCOLS)
@pytest.mark.parametrize("call", [
    lambda tmp, url: convert(tmp / "in", url, progress=False),
    lambda tmp, url: convert(url, tmp / "out", progress=False),
    lambda tmp, url: to_hf(tmp / "in", url, progress=False),
    lambda tmp, url: to_dcp(tmp / "in", url, progress=False),
    lambda tmp, url: ucp.open_checkpoint(url),
    lambda tmp, url: ucp.deepspeed.load(object(), url),
    lambda tmp, url: SaveOptions.from_config({"dir": url, "every": 1}),
    lambda tmp, url: ucp.deepspeed.save(object(), url),
], ids=["convert-output", "convert-input", "to_hf", "to_dcp", "open_checkpoint", "deepspeed.load", "save-config",
        "deepspeed.save"])
def test_entry_points_with_object_storage_refuse_other_protocols(call, url, tmp_path, monkeypatch):
    """s3:// is taken (tests/integration/test_s3.py), and memory:// (test_fsspec_storage.py); a protocol whose
    package is missing, or one fsspec does not know, is refused, nothing written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsupportedStorageError, match="s3://"):
        call(tmp_path, url)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv", [
    ["convert", "--input", "gs://bucket/run1", "--output", "OUT"],
    ["convert", "--input", "IN", "--output", "gs://bucket/run1"],
    ["verify", "gs://bucket/run1"],
    ["inspect", "file://bucket/run1"],
    ["export", "--to", "hf", "--input", "IN", "--output", "nosuchprotocol://bucket/hf"],
])
def test_cli_refuses_urls_in_one_line_and_writes_nothing(argv, tmp_path):
    (tmp_path / "IN").mkdir()
    out = subprocess.run([*UCP, *argv], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "://bucket/" in out.stderr, out.stderr
    assert sorted(os.listdir(tmp_path)) == ["IN"]


@pytest.mark.parametrize("kind", [str, Path])
def test_local_reads_fill_the_buffer_whether_named_by_str_or_path(kind, tmp_path):
    """A local file named by a plain `str` (as callers outside ucp do) is read like a `Path`: the layer once
    skipped it, leaving the caller's buffer as it was, so a checked read failed its checksum on intact bytes."""
    from ucp.storage.fileio import ReadCounter
    from ucp.storage.layer import read_ranges

    data = os.urandom(4096)
    (tmp_path / "f").write_bytes(data)
    out = bytearray(1000)
    counter = ReadCounter()
    read_ranges([(kind(tmp_path / "f"), 123, memoryview(out))], counter)
    assert bytes(out) == data[123:1123]
    assert (counter.bytes, counter.calls) == (1000, 1)


@pytest.mark.parametrize("url, shown", [
    ("s3://AKIAKEY:SeCrEt@bucket/x", "s3://***@bucket/x"),
    ("http://user:SeCrEt@host:8080/run", "http://***@host:8080/run"),
    ("http://user:p@SeCrEt@host/run", "http://***@host/run"),  # an unescaped "@" in the password
    ("https://h/o?X-Amz-Algorithm=AWS4&X-Amz-Credential=SeCrEt%2F1&X-Amz-Signature=SeCrEt&x=1",
     "https://h/o?X-Amz-Algorithm=AWS4&X-Amz-Credential=***&X-Amz-Signature=***&x=1"),
    ("https://h/o?X-Amz-Security-Token=SeCrEt", "https://h/o?X-Amz-Security-Token=***"),
    ("https://acct.blob/c/o?sv=2020&sig=SeCrEt&se=1", "https://acct.blob/c/o?sv=2020&sig=***&se=1"),
    ("http://h/x?token=SeCrEt&signature=SeCrEt", "http://h/x?token=***&signature=***"),
    ("ucp verify: error: http://u:SeCrEt@h/x: failed; see s3://b/y",
     "ucp verify: error: http://***@h/x: failed; see s3://b/y"),
    ("http://[::1]:8080/run", "http://[::1]:8080/run"),  # nothing to hide: unchanged
    ("/local/path?key", "/local/path?key"),
])
def test_redact_hides_user_info_and_secret_query_values(url, shown):
    """`redact`, the one function behind every message, log line and index source that names a URL."""
    from ucp.errors import UcpError, redact

    assert redact(url) == shown
    assert "SeCrEt" not in str(UcpError(url))  # every ucp error, as it is made


def test_an_object_path_shows_no_credentials_but_requests_with_them():
    place = location("http://user:SeCrEt@host/run")
    assert str(place / "ucp_index.json") == "http://***@host/run/ucp_index.json" and "SeCrEt" not in repr(place)
    assert place.url == "http://user:SeCrEt@host/run"


def test_ipv6_hosts_are_urls_and_chained_urls_are_not():
    assert location("http://[::1]:8080/run") == ObjectPath("http", "[::1]:8080", "run")
    for url in ("simplecache::http://[::1]:8080/run", "simplecache::gs://bucket/run"):
        with pytest.raises(UnsupportedStorageError, match="chained fsspec URLs"):
            location(url)


@pytest.mark.parametrize("tag, plain", [
    ("global_step3", True), ("checkpoint-500", True), ("", False), (".", False), ("..", False), ("a/b", False),
    ("a\\b", False), ("%2e%2e", False), ("%2E%2e%2fother", False), ("%252e%252e", False), ("x%2fy", False),
    ("step\x00", False), ("%00", False), ("../other/global_step3", False),
])
def test_a_tag_is_one_plain_name_after_percent_decoding(tag, plain):
    from ucp.format.folder import plain_tag

    assert plain_tag(tag) is plain
