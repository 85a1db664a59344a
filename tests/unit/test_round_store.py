"""`ucp.elastic.rendezvous._round_store` after a restart: a rank that reads the dead round's announcement before the
new rank 0 replaced it passes it over at once (the dead store's port refuses), not after a TCPStore probe's whole
timeout. Real TCP stores in this process: the agent's, and the new round's own, announced a moment later."""
from __future__ import annotations

import socket
import threading
import time
import uuid
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from ucp.elastic import rendezvous


def dead_port() -> int:
    """A port nothing listens on any more (a store that died with its rank 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def restart_round(delay_s: float) -> tuple[float, str, str]:
    """Rank 1 of a new round joins while the agent's store still holds the dead round's announcement; rank 0
    announces its own store `delay_s` later. (seconds rank 1 took, the token it met, the token rank 0 set)."""
    agent = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    agent.set(rendezvous._ANNOUNCEMENT, f"{dead_port()} {uuid.uuid4().hex}")
    own = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    token = uuid.uuid4().hex
    own.set(rendezvous._TOKEN, token)

    def announce() -> None:
        time.sleep(delay_s)
        agent.set(rendezvous._ANNOUNCEMENT, f"{own.port} {token}")

    rank0 = threading.Thread(target=announce)
    began = time.monotonic()
    rank0.start()
    met = rendezvous._round_store("127.0.0.1", agent.port, 1, 2, timedelta(seconds=30))
    took = time.monotonic() - began
    rank0.join()
    return took, met.get(rendezvous._TOKEN).decode(), token


def test_a_dead_rounds_announcement_is_passed_over_at_once():
    took, met, token = restart_round(0.3)
    assert met == token  # the new round's own store, live and answering after the port check
    assert took < rendezvous._PROBE.total_seconds() - 1, took


def test_control_a_store_probe_alone_waits_its_whole_timeout(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(rendezvous, "_listening", lambda host, port: True)  # as before: TCPStore probes every port
    took, met, token = restart_round(0.3)
    assert met == token
    assert took >= rendezvous._PROBE.total_seconds(), took


def test_listening_tells_a_closed_port_from_a_store():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    assert rendezvous._listening("127.0.0.1", store.port)
    assert not rendezvous._listening("127.0.0.1", dead_port())
    store.set("still", "answers")  # a connection closed without a word leaves the store serving
    assert store.get("still") == b"answers"
