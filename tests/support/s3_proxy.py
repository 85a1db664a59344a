"""A counting, fault-injecting HTTP reverse proxy in front of an S3 server (moto's, on 127.0.0.1), for tests.

Clients set `AWS_ENDPOINT_URL` to the proxy. Every request is forwarded unchanged and recorded: method, path,
query, the `ucp-rank/N` that ucp adds to its User-Agent, the status and the bytes of the response body. A
fault (`Fault`) answers matching requests itself with an S3 error, as a throttled or failing server would; a cut
(`Cut`) forwards a ranged GET but sends only the first half of its body (Content-Length promising all of it), then,
after stalling if told to, closes the connection, as a failing network would.
"""
from __future__ import annotations

import http.client
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest

BUCKET = "ucp-test"  # the bucket the `s3` fixture (tests/integration/conftest.py) creates
PART_BYTES = 1024  # so the tiny checkpoints' data files go up as multipart uploads of several parts
_RANK = re.compile(r"ucp-rank/(\d+)")
_RANGE = re.compile(r"bytes=(\d+)-(\d*)")
_HOP = {"connection", "keep-alive", "transfer-encoding", "proxy-connection", "te", "upgrade"}


@dataclass(frozen=True)
class Seen:
    method: str
    path: str  # /bucket/key
    query: str
    rank: int | None
    status: int
    body_bytes: int  # of the response
    range_begin: int | None  # the first byte a ranged GET asks for
    range_end: int | None = None  # one past the last byte it asks for
    cut: bool = False  # the body was cut halfway (`Cut`)


@dataclass
class Fault:
    """Answer up to `times` requests for which `when(method, path, query)` holds with `status` and S3 error
    `code`, after letting `skip` matching ones through. With `hold`, each waits for that event first (a server
    that stops answering), so a test can kill the client meanwhile."""

    status: int
    code: str
    times: int
    when: Callable[[str, str, str], bool] = lambda method, path, query: True
    skip: int = 0
    hold: threading.Event | None = None


@dataclass
class Cut:
    """Cut the body of every `every`-th ranged GET for which `when(path)` holds (up to `times` of them) after
    half its bytes; with `stall_s`, wait that long before closing (a body that stops coming)."""

    times: int
    every: int = 1
    when: Callable[[str], bool] = lambda path: True
    stall_s: float = 0.0
    seen: int = 0


class S3Proxy:
    def __init__(self, upstream_host: str, upstream_port: int):
        self.upstream = (upstream_host, upstream_port)
        self.seen: list[Seen] = []
        self.faults: list[Fault] = []
        self.cuts: list[Cut] = []
        self.injected = 0
        self.holding = 0  # requests a `hold` fault keeps waiting
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                try:
                    proxy._handle(self)
                except (BrokenPipeError, ConnectionResetError):  # the client went away (a test killed it)
                    self.close_connection = True

            do_PUT = do_POST = do_HEAD = do_DELETE = do_GET

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> S3Proxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def reset(self) -> None:
        with self._lock:
            self.seen.clear()
            self.faults.clear()
            self.cuts.clear()
            self.injected = 0
            self.holding = 0

    def _fault_for(self, method: str, path: str, query: str) -> Fault | None:
        with self._lock:
            for fault in self.faults:
                if fault.times > 0 and fault.when(method, path, query):
                    if fault.skip > 0:
                        fault.skip -= 1
                        return None
                    fault.times -= 1
                    self.injected += 1
                    return fault
        return None

    def _cut_for(self, path: str) -> Cut | None:
        with self._lock:
            for cut in self.cuts:
                if cut.times > 0 and cut.when(path):
                    cut.seen += 1
                    if cut.seen % cut.every == 0:
                        cut.times -= 1
                        self.injected += 1
                        return cut
        return None

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        method = h.command
        parts = urlsplit(h.path)
        length = int(h.headers.get("Content-Length") or 0)
        if h.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise RuntimeError("the proxy forwards bodies with a Content-Length only")
        body = h.rfile.read(length) if length else b""
        rank_match = _RANK.search(h.headers.get("User-Agent", ""))
        rank = int(rank_match.group(1)) if rank_match else None
        fault = self._fault_for(method, parts.path, parts.query)
        if fault is not None and fault.hold is not None:
            with self._lock:
                self.holding += 1
            fault.hold.wait(120)
        if fault is not None:
            payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{fault.code}</Code>'
                       f"<Message>injected by the test proxy</Message></Error>").encode()
            self._reply(h, fault.status, [("Content-Type", "application/xml")], payload if method != "HEAD" else b"")
            self._record(Seen(method, parts.path, parts.query, rank, fault.status, 0, None))
            return
        ranged = _RANGE.match(h.headers.get("Range", "")) if method == "GET" else None
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
            conn.request(method, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        finally:
            conn.close()
        cut = self._cut_for(parts.path) if ranged and resp.status == 206 else None
        sent = data[:len(data) // 2] if cut is not None else data
        self._reply(h, resp.status, [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP], data, sent)
        self._record(Seen(method, parts.path, parts.query, rank, resp.status, len(sent),
                          int(ranged.group(1)) if ranged else None,
                          int(ranged.group(2)) + 1 if ranged and ranged.group(2) else None, cut is not None))
        if cut is not None:
            h.wfile.flush()
            time.sleep(cut.stall_s)
            h.close_connection = True
            h.connection.shutdown(socket.SHUT_RDWR)

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, status: int, headers: list[tuple[str, str]], data: bytes,
               sent: bytes | None = None) -> None:
        """Answer with `data`'s Content-Length, and its bytes (or only `sent`, the start of them)."""
        h.send_response(status)
        for k, v in headers:
            if k.lower() != "content-length" or h.command == "HEAD":  # a HEAD's length is the object's
                h.send_header(k, v)
        if h.command != "HEAD":
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data if sent is None else sent)


@contextmanager
def s3_server() -> Iterator[SimpleNamespace]:
    """moto's S3 server and the proxy in front of it, both on 127.0.0.1, with bucket BUCKET; the environment
    points clients (this process and its children: CLI runs, torchrun ranks) at the proxy. The test extra
    brings boto3 and moto[server]: a missing one fails the tests that use this, it does not skip them."""
    import logging

    import boto3
    import moto.s3.models
    import moto.server

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # moto's server logs every request otherwise
    patch = pytest.MonkeyPatch()
    patch.setattr(moto.s3.models, "S3_UPLOAD_PART_MIN_SIZE", PART_BYTES)  # AWS's is 5 MiB, too big for tiny files
    server = moto.server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    proxy = S3Proxy(host, port).start()
    env = {"AWS_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": "test-key-id", "AWS_SECRET_ACCESS_KEY": "test-secret",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
           "UCP_S3_PART_BYTES": str(PART_BYTES)}
    for key, value in env.items():
        patch.setenv(key, value)
    patch.delenv("AWS_PROFILE", raising=False)
    direct = boto3.client("s3", endpoint_url=f"http://{host}:{port}")  # the test's own view, past the proxy
    direct.create_bucket(Bucket=BUCKET)
    try:
        yield SimpleNamespace(proxy=proxy, client=direct, endpoint=f"http://{host}:{port}")
    finally:
        proxy.stop()
        server.stop()
        patch.undo()
