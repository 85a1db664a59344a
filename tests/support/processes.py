"""Watching the processes a fault test starts: the `ucp` command line, waiting on a condition, a dead pid."""
from __future__ import annotations

import sys
import time

import psutil


def ucp_command(*argv: str) -> list[str]:
    """The `ucp` command line, run by this interpreter."""
    return [sys.executable, "-m", "ucp.cli.main", *argv]


def wait_for(predicate, timeout: float = 120.0, what: str = "condition"):
    """`predicate()`'s first true value, polled every 50 ms; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie counts: it runs no more code)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def kill_tree(pid: int) -> None:
    """SIGKILL process `pid` and every process under it (torchrun's workers run in sessions of their own, so
    killing the launcher's process group leaves them running)."""
    try:
        root = psutil.Process(pid)
        victims = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=30)
