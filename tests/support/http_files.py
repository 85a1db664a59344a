"""A read-only HTTP file server on 127.0.0.1 for tests: it serves one local folder as a web server serves a
checkpoint (HEAD for sizes, HTML listings of folders, GETs with a `Range: bytes=A-B` header answered 206), which is
what fsspec's `http://` filesystem reads. It records every GET: path, first byte asked for and body bytes sent.

The standard library's `SimpleHTTPRequestHandler` serves files and listings but ignores `Range` (it answers 200
with the whole file), so ranged GETs are answered here.
"""
from __future__ import annotations

import os
import re
import threading
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


class HttpFiles:
    def __init__(self, root: Path):
        self.gets: list[Get] = []
        self._lock = threading.Lock()
        server = self

        class Handler(SimpleHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                wanted = _RANGE.match(self.headers.get("Range", ""))
                local = Path(self.translate_path(self.path))
                if wanted is None or not local.is_file():
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
                self.wfile.write(body)
                server._record(Get(self.path, begin, len(body)))
                return None

            def copyfile(self, source, outputfile) -> None:  # type: ignore[no-untyped-def]
                size = source.seek(0, os.SEEK_END)  # a file, or the listing's BytesIO
                source.seek(0)
                super().copyfile(source, outputfile)
                server._record(Get(self.path, None, size))

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

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
