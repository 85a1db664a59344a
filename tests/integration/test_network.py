"""Network and URL hardening (issue #32), against real servers on 127.0.0.1 and real clients: moto's S3 server
behind the fault-injecting proxy (boto3, support/s3_proxy.py), a local web server (fsspec's http://,
support/http_files.py) and a server that accepts connections and never answers (support/silent_server.py). One
small ucp checkpoint written in-process (no DeepSpeed run) is uploaded to s3:// and served over HTTP.

* A ranged GET whose body is cut halfway is asked for again from where it stopped, with the backoff of a 503;
  verify and open_checkpoint read the same tensors as from the local folder; cut every time, one line.
* Every network wait is bounded ($UCP_NET_TIMEOUT, $UCP_NET_TIMEOUT_ATTEMPTS for no answer, $UCP_NET_ATTEMPTS for
  throttling): a silent endpoint and a body that stalls are said at the first timeout and end in one line (or,
  stalled once, in success) within a bound (issue #43).
* Credentials in a URL (user info; signed-URL and token query values) appear in no output line.
* `latest` that is not one plain name after percent-decoding is refused (it climbed out over http://).
* An IPv6 host is a URL, not a chained one; a server that ignores Range is named as such; an index larger than
  the bound is refused before its body is read; `ucp convert/export --output memory://` is refused.
(The DeepSpeed-input conversion from a URL with credentials, and its index's source: test_fsspec.py.)
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import ucp
from support.http_files import HttpFiles
from support.s3_proxy import BUCKET, Cut, Fault
from support.silent_server import SilentServer
from ucp.cli.main import main
from ucp.convert.object_output import upload
from ucp.convert.tensors import write_tensors
from ucp.errors import CorruptCheckpointError
from ucp.format.folder import read_index, read_latest
from ucp.storage import net as net_policy
from ucp.storage.locations import location

OPTIMIZER = {"type": "AdamW", "states": ["exp_avg"], "param_groups": [{"hyperparams": {"lr": 0.1},
                                                                      "params": ["a.weight", "b.weight"]}]}
SECRET = "SeCrEt-8f2c1d"  # what must appear nowhere


@pytest.fixture(scope="module")
def ckpt(s3, tmp_path_factory):
    """A small ucp checkpoint (chunks of 1 KiB: a tensor is many ranges) in a local folder `local`, uploaded
    to `url` (s3://) and served by `http` (whose root also holds `other/global_step3`, a second checkpoint)."""
    root = tmp_path_factory.mktemp("net")
    g = torch.Generator().manual_seed(0)
    tensors = {"a.weight": {"fp32": torch.randn(64, 48, generator=g), "exp_avg": torch.randn(64, 48, generator=g)},
               "b.weight": {"fp32": torch.randn(16, 8, generator=g),
                            "exp_avg": np.arange(128, dtype=np.float32).reshape(16, 8)}}
    local = write_tensors(root / "run1", tensors, optimizer=OPTIMIZER, step=3.0, chunk_bytes=1024)
    other = write_tensors(root / "other" / "global_step3", {"z": {"fp32": torch.ones(4)}}, step=1.0)
    url = f"s3://{BUCKET}/net/run1"
    upload(local, location(url), read_index(local))
    http = HttpFiles(root).start()
    try:
        yield SimpleNamespace(local=local, url=url, http=http, root=root, other=other)
    finally:
        http.stop()


@pytest.fixture
def net(monkeypatch, s3):
    """Short network settings for one test, and a clean proxy."""
    monkeypatch.setenv("UCP_NET_TIMEOUT", "1")
    monkeypatch.setenv("UCP_NET_ATTEMPTS", "4")
    s3.proxy.reset()
    return monkeypatch


def same_tensors(url: str, local: Path) -> None:
    remote, here = ucp.open_checkpoint(url), ucp.open_checkpoint(local)
    for name in here.names:
        for state in here.states(name):
            assert torch.equal(remote.tensor(name, state), here.tensor(name, state)), (name, state)


def one_line(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    return err + captured.out


# -- 1. short reads ------------------------------------------------------------------------------------------

def test_cut_s3_bodies_are_re_requested_from_where_they_stopped(s3, ckpt, net, capsys):
    s3.proxy.cuts.append(Cut(times=1000, every=7, when=lambda path: "/data-" in path))
    assert main(["verify", ckpt.url]) == 0, capsys.readouterr().err
    same_tensors(ckpt.url, ckpt.local)
    seen = list(s3.proxy.seen)
    cuts = [i for i, r in enumerate(seen) if r.cut]
    assert len(cuts) >= 3, "the proxy cut some bodies (control)"
    for i in cuts:  # the next GET of that object asks for exactly the missing remainder
        cut = seen[i]
        again = next(r for r in seen[i + 1:] if r.path == cut.path and r.range_end == cut.range_end)
        assert again.range_begin == cut.range_begin + cut.body_bytes, (cut, again)


def test_without_retries_the_same_cut_fails_naming_the_url(s3, ckpt, net, capsys):
    """Negative control (one attempt: the code before the fix), and the one line once retries are spent."""
    net.setenv("UCP_NET_ATTEMPTS", "1")
    s3.proxy.cuts.append(Cut(times=1, when=lambda path: "/data-" in path))
    assert main(["verify", ckpt.url]) == 2
    err = one_line(capsys)
    assert ckpt.url in err and "1 times" in err and "reading bytes" in err, err
    net.setenv("UCP_NET_ATTEMPTS", "3")
    s3.proxy.reset()
    s3.proxy.cuts.append(Cut(times=1000, when=lambda path: "/data-" in path))  # every body, every time
    assert main(["verify", ckpt.url]) == 2
    err = one_line(capsys)
    assert ckpt.url in err and "3 times" in err and "UCP_NET_ATTEMPTS" in err, err


def test_cut_http_bodies_are_read_again(ckpt, net, capsys):
    url = f"{ckpt.http.url}/run1"
    ckpt.http.cut = 3
    assert main(["verify", url]) == 0, capsys.readouterr().err
    assert sum(g.cut for g in ckpt.http.gets) == 3  # control: they were cut
    same_tensors(url, ckpt.local)
    net.setenv("UCP_NET_ATTEMPTS", "2")
    ckpt.http.cut = 1000
    try:
        assert main(["verify", url]) == 2
    finally:
        ckpt.http.cut = 0
    err = one_line(capsys)
    assert url in err and "2 times" in err, err


# -- 2. bounded waits -------------------------------------------------------------------------------------

SILENCE = ("no answer within 1 s; retrying, giving up after at most {bound} s (bound it with $UCP_NET_TIMEOUT "
           "seconds a try and $UCP_NET_TIMEOUT_ATTEMPTS tries)")
NO_ANSWER = ("{doing} got no answer ({kind}) in {tries} tries of 1 s ($UCP_NET_TIMEOUT_ATTEMPTS, $UCP_NET_TIMEOUT); "
             "check the storage and the network, then run the command again")


@pytest.mark.parametrize("scheme", ["s3", "http"])
def test_a_silent_endpoint_says_so_at_once_and_ends_in_one_line_within_the_bound(scheme, net, capsys):
    """Timeouts have their own budget ($UCP_NET_TIMEOUT_ATTEMPTS, 3 here), whatever the throttling one
    ($UCP_NET_ATTEMPTS, 50 here); the first timeout is said at once; no backoff."""
    net.setenv("UCP_NET_TIMEOUT_ATTEMPTS", "3")
    net.setenv("UCP_NET_ATTEMPTS", "50")
    net.setattr(net_policy, "backoff_s", lambda failures: 0.0)
    silent = SilentServer().start()
    try:
        if scheme == "s3":
            net.setenv("AWS_ENDPOINT_URL", silent.url)
        url = f"s3://{BUCKET}/run1" if scheme == "s3" else f"{silent.url}/run1"
        start = time.monotonic()
        assert main(["verify", url]) == 2
        took = time.monotonic() - start
        kind = "ReadTimeoutError" if scheme == "s3" else "SocketTimeoutError"
        lines = capsys.readouterr().err.strip().splitlines()
        assert lines[0] == f"ucp verify: {url}/ucp_index.json: " + SILENCE.format(bound="8"), lines  # 3 x 1 s + 3 + 1.5
        # how many tries fit the deadline depends on how long the client's try waits (http: HEAD, then GET)
        assert len(lines) == 2 and re.fullmatch(re.escape(f"ucp verify: error: {url}/ucp_index.json: ")
                                                + re.escape(NO_ANSWER.format(doing="reading its size", kind=kind,
                                                                             tries="@")).replace("@", "[23]"),
                                                lines[1]), lines
        assert took < 15, took  # 3 tries of 1 s
        assert silent.accepted >= 2  # it was tried again
    finally:
        silent.stop()


def test_the_first_timeout_is_said_while_ucp_still_waits():
    """`ucp verify` as users run it, bounds far away (100 tries of 2 s): the line comes after the first 2 s
    timeout, while the command still waits; no silent minute."""
    silent = SilentServer().start()
    env = {**os.environ, "UCP_NET_TIMEOUT": "2", "UCP_NET_TIMEOUT_ATTEMPTS": "100"}
    proc = subprocess.Popen([sys.executable, "-m", "ucp.cli.main", "verify", f"{silent.url}/run1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stderr.readline()  # the import takes a few seconds under load; then 2 s
        assert line.startswith(f"ucp verify: {silent.url}/run1/ucp_index.json: no answer within 2 s; retrying, "
                               "giving up after at most "), line
        assert proc.poll() is None  # still waiting: the line came first
    finally:
        proc.kill()
        proc.wait()
        silent.stop()


def test_without_the_timeout_a_silent_endpoint_holds_verify(tmp_path):
    """Negative control: with $UCP_NET_TIMEOUT at 60 s, verify still waits 3 s after connecting, where 1 s ends
    it above."""
    silent = SilentServer().start()
    env = {**os.environ, "UCP_NET_TIMEOUT": "60"}
    proc = subprocess.Popen([sys.executable, "-m", "ucp.cli.main", "verify", f"{silent.url}/run1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while silent.accepted == 0 and time.monotonic() < deadline:  # until it has connected (imports first)
            time.sleep(0.1)
        time.sleep(3)
        assert proc.poll() is None and silent.accepted >= 1
    finally:
        proc.kill()
        proc.wait()
        silent.stop()


def test_a_body_that_always_stalls_ends_in_one_line_within_the_bound(s3, ckpt, net, capsys):
    """Every data body stops halfway and stays silent: a timeout each time, the timeouts' budget (not the 50 of
    throttling), the parts still queued cancelled; one warning, one error line, over s3:// and http://."""
    net.setenv("UCP_NET_TIMEOUT_ATTEMPTS", "2")
    net.setenv("UCP_NET_ATTEMPTS", "50")
    net.setattr(net_policy, "backoff_s", lambda failures: 0.0)
    s3.proxy.cuts.append(Cut(times=100000, when=lambda path: "/data-" in path, stall_s=30))
    http = f"{ckpt.http.url}/run1"
    ckpt.http.cut, ckpt.http.stall_s = 100000, 30.0
    try:
        for url, kind in ((ckpt.url, "ReadTimeoutError"), (http, "FSTimeoutError")):
            start = time.monotonic()
            assert main(["verify", url]) == 2
            took = time.monotonic() - start
            lines = capsys.readouterr().err.strip().splitlines()
            assert len(lines) == 2 and re.fullmatch(
                rf"ucp verify: {re.escape(url)}/data-\S+: " + re.escape(SILENCE.format(bound="4")), lines[0]), lines
            assert re.fullmatch(rf"ucp verify: error: {re.escape(url)}/data-\S+: reading bytes \[\d+, \d+\) got "
                                rf"no answer \({kind}\) in [12] tries of 1 s .*", lines[1]), lines
            assert took < 20, took
    finally:
        ckpt.http.cut, ckpt.http.stall_s = 0, 0.0


def test_throttling_keeps_its_long_patience(s3, ckpt, net, capsys):
    """503 SlowDown on every GET of the index: tried $UCP_NET_ATTEMPTS (5) times although timeouts get 1 try."""
    net.setenv("UCP_NET_TIMEOUT_ATTEMPTS", "1")
    net.setenv("UCP_NET_ATTEMPTS", "5")
    net.setattr(net_policy, "backoff_s", lambda failures: 0.0)
    s3.proxy.faults.append(Fault(503, "SlowDown", 1000, lambda m, p, q: m == "GET" and p.endswith("ucp_index.json")))
    assert main(["verify", ckpt.url]) == 2
    assert one_line(capsys) == (f"ucp verify: error: {ckpt.url}/ucp_index.json: reading it failed (SlowDown, HTTP "
                                "503) 5 times, each try waiting at most 1 s for the network ($UCP_NET_ATTEMPTS, "
                                "$UCP_NET_TIMEOUT); check the storage and the network, then run the command again")
    assert s3.proxy.injected in (5, 10)  # 5 tries of each read of the index (verify may read it twice)


def test_a_body_that_stalls_once_is_read_again_within_the_timeout(s3, ckpt, net, capsys):
    s3.proxy.cuts.append(Cut(times=1, when=lambda path: "/data-" in path, stall_s=20))
    start = time.monotonic()
    same_tensors(ckpt.url, ckpt.local)
    assert time.monotonic() - start < 10  # 1 s timeout, then the rest again; not the stall's 20 s
    assert s3.proxy.injected == 1
    url = f"{ckpt.http.url}/run1"
    ckpt.http.cut, ckpt.http.stall_s = 1, 20
    try:
        start = time.monotonic()
        assert main(["verify", url]) == 0, capsys.readouterr().err
        assert time.monotonic() - start < 10
    finally:
        ckpt.http.cut, ckpt.http.stall_s = 0, 0.0


# -- 3. credentials never leak ----------------------------------------------------------------------------

QUERY_SECRETS = [f"X-Amz-Signature={SECRET}", f"X-Amz-Credential=AKIA%2F{SECRET}",
                 f"X-Amz-Security-Token={SECRET}", f"token={SECRET}", f"sig={SECRET}", f"signature={SECRET}"]


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_urls_with_credentials_are_shown_without_them(ckpt, command, tmp_path, capsys):
    http = ckpt.http.url.replace("http://", f"http://user:{SECRET}@")
    assert main([command, f"{http}/run1"]) == 0  # the server takes any user; the line names the URL
    out = capsys.readouterr()
    assert SECRET not in out.out + out.err and "http://***@127.0.0.1" in out.out + out.err
    failing = [f"s3://AKIAKEY:{SECRET}@{BUCKET}/run1", f"{http}/no-such-run",
               *(f"{ckpt.http.url}/run1?X-Amz-Algorithm=AWS4-HMAC-SHA256&{q}" for q in QUERY_SECRETS)]
    for url in failing:
        assert main([command, url]) == 2, url
        err = one_line(capsys)
        assert SECRET not in err and "***" in err, err
    assert main(["convert", "--input", failing[0], "--output", str(tmp_path / "out")]) == 2
    err = one_line(capsys)
    assert SECRET not in err and "credentials in an s3:// URL" in err, err


# -- 4. escapes -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tag", ["%2e%2e/other/global_step3", "../other/global_step3", "%2E%2E%2Fother",
                                 "run1/..", ".", "a\\b", "%252e%252e"])
def test_a_latest_that_is_no_plain_name_is_refused_over_http_and_s3(s3, ckpt, tag, capsys):
    save = ckpt.root / "save"
    save.mkdir(exist_ok=True)
    (save / "latest").write_text(tag)
    s3.client.put_object(Bucket=BUCKET, Key="net/save/latest", Body=tag.encode())
    for url in (f"{ckpt.http.url}/save", f"s3://{BUCKET}/net/save"):
        assert main(["verify", url]) == 2, url
        err = one_line(capsys)
        assert f"{url}/latest" in err and "does not hold the name of a tag folder" in err, err
        assert "%" not in tag or tag not in err  # never echoed
        with pytest.raises(CorruptCheckpointError):
            ucp.open_checkpoint(url)


def test_the_escape_was_real_over_http(ckpt):
    """Control: the server does serve the other checkpoint's index at `save/%2e%2e/other/global_step3/...`."""
    with urllib.request.urlopen(f"{ckpt.http.url}/save/%2e%2e/other/global_step3/ucp_index.json") as r:
        assert r.read() == (ckpt.other / "ucp_index.json").read_bytes()
    (ckpt.root / "save").mkdir(exist_ok=True)
    (ckpt.root / "save" / "latest").write_text("global_step3")  # a plain name: taken (here it holds nothing)
    assert read_latest(f"{ckpt.http.url}/save") == "global_step3"


def test_a_tag_argument_that_is_no_plain_name_is_refused(ckpt, capsys):
    for tag in ("../run1", "%2e%2e", ""):
        assert main(["inspect", str(ckpt.local), "--tag", tag]) == 2
        assert "not the name of a tag folder" in one_line(capsys)


# -- 5. smaller -------------------------------------------------------------------------------------------

def test_an_ipv6_url_is_a_url_and_reads(ckpt, capsys):
    v6 = HttpFiles(ckpt.root, host="::1").start()
    try:
        assert v6.url.startswith("http://[::1]:")
        assert main(["verify", f"{v6.url}/run1"]) == 0, capsys.readouterr().err
        same_tensors(f"{v6.url}/run1", ckpt.local)
    finally:
        v6.stop()
    assert main(["verify", "simplecache::http://[::1]:1/run1"]) == 2  # a chained one still is refused
    assert "chained fsspec URLs" in one_line(capsys)


def test_a_server_that_ignores_range_is_named(ckpt, capsys):
    ckpt.http.ignore_range = True
    try:
        assert main(["verify", f"{ckpt.http.url}/run1"]) == 2
    finally:
        ckpt.http.ignore_range = False
    err = one_line(capsys)
    assert f"{ckpt.http.url}/run1/data-" in err and "ignores Range requests" in err, err


def test_an_index_over_the_bound_is_refused_before_its_body_is_read(s3, ckpt, monkeypatch, capsys):
    nbytes = (ckpt.local / "ucp_index.json").stat().st_size
    monkeypatch.setenv("UCP_INDEX_MAX_BYTES", str(nbytes - 1))
    ckpt.http.reset()
    for url in (str(ckpt.local), ckpt.url, f"{ckpt.http.url}/run1"):
        assert main(["verify", url]) == 2
        err = one_line(capsys)
        assert f"{url}/ucp_index.json: {nbytes} bytes, more than the {nbytes - 1}" in err, err
    assert not [g for g in ckpt.http.gets if g.path.endswith("ucp_index.json")]  # HEAD only: nothing downloaded
    monkeypatch.setenv("UCP_INDEX_MAX_BYTES", str(nbytes))  # control: at the bound, read
    assert main(["verify", f"{ckpt.http.url}/run1"]) == 0
    monkeypatch.delenv("UCP_INDEX_MAX_BYTES")
    big = ckpt.root / "big"
    big.mkdir()
    with open(big / "ucp_index.json", "wb") as f:  # sparse: 600 MiB on no disk, over the default 512 MiB
        f.truncate(600 << 20)
    start = time.monotonic()
    assert main(["verify", str(big)]) == 2
    assert "more than the 536870912 bytes" in one_line(capsys) and time.monotonic() - start < 5


def test_the_cli_refuses_to_write_to_memory(ckpt, capsys):
    for argv in (["convert", "--input", str(ckpt.local), "--output", "memory://b/run"],
                 ["export", "--input", str(ckpt.local), "--output", "memory://b/hf", "--to", "dcp"]):
        assert main(argv) == 2
        err = one_line(capsys)
        assert "memory://b/" in err and "gone when the command ends" in err, err
