"""A read-only HTTP file server on 127.0.0.1 for tests: it serves one local folder as a web server serves a
checkpoint (HEAD for sizes, HTML listings of folders, GETs with a `Range: bytes=A-B` header answered 206), which is
what fsspec's `http://` filesystem reads. It records every GET: path, first byte asked for and body bytes sent.

The standard library's `SimpleHTTPRequestHandler` serves files and listings but ignores `Range` (it answers 200
with the whole file), so ranged GETs are answered here. For the network tests (test_network.py) it can also
behave as a bad server would: ignore `Range` again (`ignore_range`), cut the body of the next `cut` ranged GETs
halfway (Content-Length promising all of it) and, with `stall_s`, stop sending for that long before closing.
"""
from __future__ import annotations

import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

_RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


@dataclass(frozen=True)
class Get:
    path: str  # /relative/path, as requested
    range_begin: int | None
    body_bytes: int
    cut: bool = False


class HttpFiles:
    def __init__(self, root: Path, host: str = "127.0.0.1"):
        self.gets: list[Get] = []
        self.ignore_range = False
        self.cut = 0
        self.stall_s = 0.0
        self._lock = threading.Lock()
        server = self

        class Handler(SimpleHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                wanted = _RANGE.match(self.headers.get("Range", ""))
                local = Path(self.translate_path(self.path))
                if wanted is None or not local.is_file() or server.ignore_range:
                    return super().do_GET()  # a whole file, or a folder's listing
                size = local.stat().st_size
                begin = int(wanted.group(1))
                end = min(int(wanted.group(2)) + 1 if wanted.group(2) else size, size)
                if begin >= size:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return None
                with open(local, "rb") as f:
                    f.seek(begin)
                    body = f.read(end - begin)
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {begin}-{end - 1}/{size}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                cut = server._take_cut()
                self.wfile.write(body[:len(body) // 2] if cut else body)
                server._record(Get(self.path, begin, len(body) // 2 if cut else len(body), cut))
                if cut:
                    self.wfile.flush()
                    time.sleep(server.stall_s)
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                return None

            def copyfile(self, source, outputfile) -> None:  # type: ignore[no-untyped-def]
                size = source.seek(0, os.SEEK_END)  # a file, or the listing's BytesIO
                source.seek(0)
                super().copyfile(source, outputfile)
                server._record(Get(self.path, None, size))

        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._server = type("Server", (ThreadingHTTPServer,), {"address_family": family})(
            (host, 0), partial(Handler, directory=str(root)))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host = self._server.server_address[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{self._server.server_address[1]}"

    def _take_cut(self) -> bool:
        with self._lock:
            if self.cut > 0:
                self.cut -= 1
                return True
            return False

    def _record(self, get: Get) -> None:
        with self._lock:
            self.gets.append(get)

    def reset(self) -> None:
        with self._lock:
            self.gets = []

    def start(self) -> HttpFiles:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
