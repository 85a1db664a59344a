"""Cut this process's TCP connections to its peers, so that a thread blocked in a collective gets an error.

gloo's `abort` does not wake a thread waiting in a collective for a peer that is alive but stopped (SIGSTOP) or
stuck: it waits for the group's timeout (30 min by default). Shutting the connections down does: the waiting
read returns, gloo raises "Connection closed by peer" in the waiting thread, and the peers waiting for this rank
get the same error from their side (observed with torch 2.13's gloo). The connections to the job's store, which
the regroup needs, are kept (`keep_ports`: the store's port, on either end).

Linux only (it reads /proc); elsewhere nothing is cut, and a hung peer is left to the group's timeout.
"""
from __future__ import annotations

import logging
import os
import socket

logger = logging.getLogger("ucp.elastic")

_ESTABLISHED = "01"


def cut_peer_connections(keep_ports: set[int]) -> int:
    """Shut down every established TCP connection of this process whose ends are not on `keep_ports`; how many."""
    try:
        table = _tcp_table()
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return 0
    cut = 0
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if not target.startswith("socket:["):
            continue
        entry = table.get(int(target[len("socket:["):-1]))
        if entry is None or entry[2] != _ESTABLISHED or entry[0] in keep_ports or entry[1] in keep_ports:
            continue
        try:
            with socket.socket(fileno=os.dup(int(fd))) as s:
                s.shutdown(socket.SHUT_RDWR)   # acts on the connection, which the original descriptor shares
            cut += 1
        except OSError:
            pass   # closed meanwhile
    return cut


def _tcp_table() -> dict[int, tuple[int, int, str]]:
    """Socket inode -> (local port, remote port, state) of the TCP sockets of this network namespace."""
    out: dict[int, tuple[int, int, str]] = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(name) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            out[int(fields[9])] = (int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16),
                                   fields[3])
    return out
