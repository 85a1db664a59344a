"""The progress bar of long work (conversion, export): bytes done of a total, on stderr when it is a terminal.

A bar that stops moving because the network gave no answer says so (`report_stall`, called by
`ucp.storage.net` at each timeout): "stalled: no answer from <url> for N s, retrying" until bytes move again,
instead of a frozen count and rate that look like slow progress."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tqdm import tqdm

# The open bars' stall callbacks, (url, seconds) each.
stall_listeners: list[Callable[[object, float], None]] = []


def report_stall(url: object, seconds: float) -> None:
    """`url` gave no answer within `seconds`: every open bar shows it."""
    for listener in list(stall_listeners):
        listener(url, seconds)


class _Bar(tqdm):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.stalled = False
        stall_listeners.append(self.stall)

    def stall(self, url: object, seconds: float) -> None:
        self.stalled = True
        self.set_postfix_str(f"stalled: no answer from {url} for {seconds:g} s, retrying", refresh=True)

    def update(self, n: float | None = 1) -> bool | None:
        if self.stalled and n:
            self.stalled = False
            self.set_postfix_str("", refresh=False)
        return super().update(n)

    def close(self) -> None:
        if self.stall in stall_listeners:
            stall_listeners.remove(self.stall)
        super().close()


def progress_bar(total_bytes: int, desc: str, enabled: bool) -> tqdm:
    # disable=None lets tqdm hide itself when stderr is not a terminal (CI logs, pipes).
    return _Bar(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None if enabled else True, dynamic_ncols=True)
