"""A TCP server on 127.0.0.1 that accepts connections and never answers: an S3 or HTTP endpoint that hangs,
for the tests of ucp's network timeouts (test_network.py). It holds every connection open until `stop`."""
from __future__ import annotations

import socket
import threading


class SilentServer:
    def __init__(self) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0))
        self._held: list[socket.socket] = []
        self.accepted = 0
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._socket.getsockname()[1]}"

    def start(self) -> SilentServer:
        self._thread.start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._socket.accept()
            except OSError:  # closed by stop()
                return
            self._held.append(conn)
            self.accepted += 1

    def stop(self) -> None:
        try:
            self._socket.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress (Linux)
        except OSError:
            pass
        self._socket.close()
        for conn in self._held:
            conn.close()
