"""How long ucp waits on the network and how it retries, one policy for both backends of object storage
(`s3`, boto3, for s3://; `fsspec` for http(s):// and the other fsspec protocols).

Every request has a connect and a read timeout, `timeout_s()` ($UCP_NET_TIMEOUT, default 60 s), so an endpoint
that accepts connections and never answers, or stops halfway through a body, costs at most `attempts()` times
that, never a hang. A request is tried `attempts()` times ($UCP_NET_ATTEMPTS, default 10), throttling (503
SlowDown) included: botocore's "standard" retry mode does it for s3:// requests, and `retrying` for fsspec's.

A ranged read whose body is cut (the connection closed or reset before the Content-Length promised) or stalls
is no corrupt object: `fill` keeps the bytes that arrived and asks for the rest again after `backoff_s`, the wait
botocore's standard mode takes after a 503. The CRC-32 checks of the index still judge what arrived.
"""
from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from ucp.errors import StorageAccessError

DEFAULT_TIMEOUT_S = 60.0
DEFAULT_ATTEMPTS = 10
MAX_BACKOFF_S = 20.0  # botocore's ExponentialBackoff._MAX_BACKOFF
T = TypeVar("T")


def timeout_s() -> float:
    """Seconds a connection may take to open and a read to bring its next bytes ($UCP_NET_TIMEOUT)."""
    return max(0.1, float(os.environ.get("UCP_NET_TIMEOUT", DEFAULT_TIMEOUT_S)))


def attempts() -> int:
    """How many times one request (or one ranged read, with what is left of it) is tried ($UCP_NET_ATTEMPTS)."""
    return max(1, int(os.environ.get("UCP_NET_ATTEMPTS", DEFAULT_ATTEMPTS)))


def backoff_s(failures: int) -> float:
    """The wait after the `failures`-th failed try: botocore's standard mode after a throttling error,
    rand(0, 1) * min(2 ** (failures - 1), 20) s."""
    return random.random() * min(2.0 ** (failures - 1), MAX_BACKOFF_S)


def gave_up(url: object, doing: str, exc: BaseException) -> StorageAccessError:
    """The one line after the last try: the URL (its display form, without credentials), what failed and how
    often, and the settings that bound it; the exception's type only (its text may carry a signed URL)."""
    return StorageAccessError(f"{url}: {doing} failed ({type(exc).__name__}) {attempts()} times, each try waiting "
                              f"at most {timeout_s():g} s for the network ($UCP_NET_ATTEMPTS, $UCP_NET_TIMEOUT); "
                              "check the storage and the network, then run the command again")


def retrying(url: object, doing: str, request: Callable[[], T], transient: Callable[[BaseException], bool]) -> T:
    """`request()`, tried again after `backoff_s` while it fails with an error `transient` accepts, at most
    `attempts()` times; then `gave_up`. Other errors pass through at once."""
    failures = 0
    while True:
        try:
            return request()
        except Exception as exc:  # noqa: BLE001  # only what `transient` accepts is retried
            if not transient(exc):
                raise
            failures += 1
            if failures >= attempts():
                raise gave_up(url, doing, exc) from None
        time.sleep(backoff_s(failures))


class ShortRead(Exception):
    """A body that ended cleanly before the bytes its response promised (a cut connection some clients see)."""


def fill(url: object, view: memoryview, offset: int, request: Callable[[int, int], Iterable[bytes]],
         transient: Callable[[BaseException], bool]) -> None:
    """Fill `view` with bytes [offset, offset + len(view)) of `url`. `request(begin, end)` asks for [begin, end)
    and yields the body's chunks; when they stop early (cut, reset, stalled: an error `transient` accepts, or
    `ShortRead`), what arrived stays in `view` and `request` is called again for the rest only, after
    `backoff_s`, `attempts()` tries in all. A non-transient error (a truncated object, access refused) passes
    through."""
    done, failures = 0, 0
    end = offset + len(view)
    while done < len(view):
        try:
            for chunk in request(offset + done, end):
                take = min(len(chunk), len(view) - done)
                view[done:done + take] = chunk[:take]
                done += take
                if done == len(view):
                    break
            if done < len(view):
                raise ShortRead(f"{len(view) - done} bytes missing")
        except Exception as exc:  # noqa: BLE001  # only what `transient` accepts is retried
            if not isinstance(exc, ShortRead) and not transient(exc):
                raise
            failures += 1
            if failures >= attempts():
                raise gave_up(url, f"reading bytes [{offset}, {end})", exc) from None
            time.sleep(backoff_s(failures))
