"""How long ucp waits on the network and how it retries, one policy for both backends of object storage
(`s3`, boto3, for s3://; `fsspec` for http(s):// and the other fsspec protocols).

Every request has a connect and a read timeout, `timeout_s()` ($UCP_NET_TIMEOUT, default 30 s). Two kinds of
failure get two budgets:

* no answer within the timeout (an endpoint that accepts connections and never answers, a body that stops
  halfway) is tried at most `timeout_attempts()` times ($UCP_NET_TIMEOUT_ATTEMPTS, default 4), and no try is
  started that could end past `silent_bound_s()` (87 s by default): a silent endpoint ends in one line within
  `longest_silence_s()` (117 s by default, under 2 minutes), and the first such timeout says so on stderr at once
  (`note_silence`), with the settings that bound it;
* an answer that says "later" (throttling, 503 SlowDown, another 5xx, a connection cut or reset) is tried
  `attempts()` times ($UCP_NET_ATTEMPTS, default 10), with botocore's standard backoff between: a busy store
  keeps its long patience.

`retrying` runs one request under that policy (boto3's own retries are off: `object_store` makes every request
through it). A ranged read whose body is cut or stalls is no corrupt object: `fill` keeps the bytes that arrived
and asks for the rest again after `backoff_s`, under the same two budgets. The CRC-32 checks of the index still
judge what arrived.
"""
from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from ucp.errors import ConfigError, StorageAccessError
from ucp.progress import report_stall

DEFAULT_TIMEOUT_S = 20.0
DEFAULT_ATTEMPTS = 10
DEFAULT_TIMEOUT_ATTEMPTS = 4
MAX_BACKOFF_S = 20.0  # botocore's ExponentialBackoff._MAX_BACKOFF
SILENT_LIMIT_S = 120.0  # what the defaults must keep a silent endpoint's wait under (issue #43)
T = TypeVar("T")
logger = logging.getLogger("ucp.net")
_noted: dict[str, float] = {}  # endpoint -> when its silence was last said
_noted_lock = threading.Lock()


def _env_number(name: str, default: float, kind: type, least: float) -> float:
    raw = os.environ.get(name)
    if raw is None:
        return default
    value: float | None
    try:
        value = float(kind(raw))
    except ValueError:
        value = None
    if value is None or value != value or value < least or value == float("inf"):
        raise ConfigError(f"${name}={raw[:40]!r}: must be {'an integer' if kind is int else 'a number'} of at least "
                          f"{least:g}")
    return value


def timeout_s() -> float:
    """Seconds a connection may take to open and a read to bring its next bytes ($UCP_NET_TIMEOUT)."""
    return float(_env_number("UCP_NET_TIMEOUT", DEFAULT_TIMEOUT_S, float, 0.1))


def attempts() -> int:
    """How many times a request that is answered "later" (throttled, 5xx, cut) is tried ($UCP_NET_ATTEMPTS)."""
    return int(_env_number("UCP_NET_ATTEMPTS", DEFAULT_ATTEMPTS, int, 1))


def timeout_attempts() -> int:
    """How many times a request that gets no answer within `timeout_s()` is tried ($UCP_NET_TIMEOUT_ATTEMPTS)."""
    return int(_env_number("UCP_NET_TIMEOUT_ATTEMPTS", DEFAULT_TIMEOUT_ATTEMPTS, int, 1))


def _longest_backoff_s(failures: int) -> float:
    return min(2.0 ** (failures - 1), MAX_BACKOFF_S)


def silent_bound_s() -> float:
    """The deadline of a request on an endpoint that never answers: every try's timeout and the longest backoff
    between tries. No try is started that could end after it (with half a timeout's slack)."""
    tries = timeout_attempts()
    return tries * timeout_s() + sum(_longest_backoff_s(k) for k in range(1, tries))


def longest_silence_s() -> float:
    """The longest a request can wait on a silent endpoint: `silent_bound_s()`, its slack, and one timeout more
    for a try that waits twice (fsspec's http(s):// asks for a size by HEAD, then by GET)."""
    return silent_bound_s() + 1.5 * timeout_s()


def backoff_s(failures: int) -> float:
    """The wait after the `failures`-th failed try: botocore's standard mode after a throttling error,
    rand(0, 1) * min(2 ** (failures - 1), 20) s."""
    return random.random() * min(2.0 ** (failures - 1), MAX_BACKOFF_S)


def is_timeout(exc: BaseException) -> bool:
    """Whether `exc` says that no answer came within the timeout, whichever client raised it: the builtin
    TimeoutError (asyncio's and aiohttp's derive from it), urllib3's and botocore's Read/ConnectTimeoutError,
    fsspec's FSTimeoutError; told by name, so that this module imports none of them."""
    return any("Timeout" in cls.__name__ for cls in type(exc).__mro__)


def _endpoint(url: object) -> str:
    scheme, bucket = getattr(url, "scheme", None), getattr(url, "bucket", None)
    return f"{scheme}://{bucket}" if scheme is not None else str(url)


def note_silence(url: object) -> None:
    """Say once per stall (not again within `longest_silence_s()` for the same endpoint) that `url` gave no answer
    within the timeout, that ucp retries, and how to bound it; and tell the stall listeners."""
    now = time.monotonic()
    report_stall(url, timeout_s())  # the progress bar, if one is open
    with _noted_lock:
        last = _noted.get(_endpoint(url))
        if last is not None and now - last < longest_silence_s():
            return
        _noted[_endpoint(url)] = now
    logger.warning("%s: no answer within %g s; retrying, giving up after at most %.0f s (bound it with "
                   "$UCP_NET_TIMEOUT seconds a try and $UCP_NET_TIMEOUT_ATTEMPTS tries)", url, timeout_s(),
                   longest_silence_s())


def _kind(exc: BaseException) -> str:
    """The exception's type, or the error code and status of a store's answer (botocore's ClientError); never its
    text, which may carry a signed URL."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and isinstance(response.get("Error"), dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", "?")
        return f"{str(response['Error'].get('Code', '?'))[:40]}, HTTP {status}"
    return type(exc).__name__


def gave_up(url: object, doing: str, exc: BaseException, tries: int | None = None) -> StorageAccessError:
    """The one line after the last try: the URL (its display form, without credentials), what failed and how
    often, and the settings that bound it."""
    if is_timeout(exc):
        return StorageAccessError(f"{url}: {doing} got no answer ({type(exc).__name__}) in "
                                  f"{tries or timeout_attempts()} tries of {timeout_s():g} s "
                                  "($UCP_NET_TIMEOUT_ATTEMPTS, $UCP_NET_TIMEOUT); check the storage and the network, "
                                  "then run the command again")
    return StorageAccessError(f"{url}: {doing} failed ({_kind(exc)}) {tries or attempts()} times, each try "
                              f"waiting at most {timeout_s():g} s for the network ($UCP_NET_ATTEMPTS, "
                              "$UCP_NET_TIMEOUT); check the storage and the network, then run the command again")


class _Budget:
    """The tries one request has left: `attempts()` for answers that say "later", `timeout_attempts()` for no
    answer at all."""

    def __init__(self) -> None:
        self.failures = 0
        self.timeouts = 0
        self.start = time.monotonic()

    def spend(self, url: object, doing: str, exc: BaseException) -> None:
        """Count one failed try; `gave_up` when its budget is spent, else wait the backoff."""
        self.failures += 1
        if is_timeout(exc):
            self.timeouts += 1
            next_end = time.monotonic() - self.start + _longest_backoff_s(self.failures) + timeout_s()
            if self.timeouts >= timeout_attempts() or next_end > silent_bound_s() + timeout_s() / 2:
                raise gave_up(url, doing, exc, self.timeouts) from None
            note_silence(url)
        elif self.failures - self.timeouts >= attempts():
            raise gave_up(url, doing, exc, self.failures - self.timeouts) from None
        time.sleep(backoff_s(self.failures))


def retrying(url: object, doing: str, request: Callable[[], T], transient: Callable[[BaseException], bool]) -> T:
    """`request()`, tried again after `backoff_s` while it fails with an error `transient` accepts, within the
    two budgets of the module docstring; then `gave_up`. Other errors pass through at once."""
    budget = _Budget()
    while True:
        try:
            return request()
        except Exception as exc:  # noqa: BLE001  # only what `transient` accepts is retried
            if not transient(exc):
                raise
            budget.spend(url, doing, exc)


class ShortRead(Exception):
    """A body that ended cleanly before the bytes its response promised (a cut connection some clients see)."""


def fill(url: object, view: memoryview, offset: int, request: Callable[[int, int], Iterable[bytes]],
         transient: Callable[[BaseException], bool]) -> None:
    """Fill `view` with bytes [offset, offset + len(view)) of `url`. `request(begin, end)` asks for [begin, end)
    and yields the body's chunks; when they stop early (cut, reset, stalled: an error `transient` accepts, or
    `ShortRead`), what arrived stays in `view` and `request` is called again for the rest only, after
    `backoff_s`, within the two budgets of the module docstring. A non-transient error (a truncated object,
    access refused) passes through."""
    done = 0
    budget = _Budget()
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
            budget.spend(url, f"reading bytes [{offset}, {end})", exc)
