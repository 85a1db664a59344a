"""A counting, fault-injecting HTTP reverse proxy in front of an S3 server (moto's, on 127.0.0.1), for tests.

Clients set `AWS_ENDPOINT_URL` to the proxy. Every request is forwarded unchanged and recorded: method, path,
query, the `ucp-rank/N` that ucp adds to its User-Agent, the status and the bytes of the response body. A
fault (`Fault`) answers matching requests itself with an S3 error, as a throttled or failing server would.
"""
from __future__ import annotations

import http.client
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

BUCKET = "ucp-test"  # the bucket the `s3` fixture (tests/integration/conftest.py) creates
PART_BYTES = 1024  # so the tiny checkpoints' data files go up as multipart uploads of several parts
_RANK = re.compile(r"ucp-rank/(\d+)")
_RANGE = re.compile(r"bytes=(\d+)-")
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


class S3Proxy:
    def __init__(self, upstream_host: str, upstream_port: int):
        self.upstream = (upstream_host, upstream_port)
        self.seen: list[Seen] = []
        self.faults: list[Fault] = []
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
        conn = http.client.HTTPConnection(*self.upstream, timeout=60)
        try:
            headers = {k: v for k, v in h.headers.items() if k.lower() not in _HOP}
            conn.request(method, h.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self._reply(h, resp.status, [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP], data)
        finally:
            conn.close()
        ranged = _RANGE.match(h.headers.get("Range", "")) if method == "GET" else None
        self._record(Seen(method, parts.path, parts.query, rank, resp.status, len(data),
                          int(ranged.group(1)) if ranged else None))

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self.seen.append(seen)

    @staticmethod
    def _reply(h: BaseHTTPRequestHandler, status: int, headers: list[tuple[str, str]], data: bytes) -> None:
        h.send_response(status)
        for k, v in headers:
            if k.lower() != "content-length" or h.command == "HEAD":  # a HEAD's length is the object's
                h.send_header(k, v)
        if h.command != "HEAD":
            h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(data)
