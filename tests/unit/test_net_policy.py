"""ucp's network policy (`ucp.storage.net`, issue #43): pure arithmetic and the retry loop, no network."""
from __future__ import annotations

import pytest

from ucp import progress
from ucp.errors import ConfigError, StorageAccessError
from ucp.storage import net


@pytest.fixture
def quick(monkeypatch):
    monkeypatch.setattr(net, "backoff_s", lambda failures: 0.0)
    for name in ("UCP_NET_TIMEOUT", "UCP_NET_ATTEMPTS", "UCP_NET_TIMEOUT_ATTEMPTS"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_defaults_end_a_silent_endpoint_within_two_minutes(quick):
    """4 tries of 20 s, 1 + 2 + 4 s of backoff at most, half a timeout of slack and one try that waits twice
    (http's HEAD, then GET): 117 s. Throttling keeps 10 tries."""
    assert (net.timeout_s(), net.timeout_attempts(), net.attempts()) == (20.0, 4, 10)
    assert net.silent_bound_s() == 4 * 20 + 1 + 2 + 4
    assert net.longest_silence_s() == 117.0 < net.SILENT_LIMIT_S == 120.0


class Stall(TimeoutError):
    pass


def test_timeouts_and_throttling_have_their_own_budgets(quick, caplog):
    quick.setenv("UCP_NET_TIMEOUT", "5")
    quick.setenv("UCP_NET_TIMEOUT_ATTEMPTS", "3")
    quick.setenv("UCP_NET_ATTEMPTS", "7")
    calls = []

    def silent():
        calls.append(1)
        raise Stall

    with pytest.raises(StorageAccessError) as e:
        net.retrying("s3://b/silent", "reading it", silent, lambda exc: True)
    assert len(calls) == 3
    assert str(e.value) == ("s3://b/silent: reading it got no answer (Stall) in 3 tries of 5 s "
                            "($UCP_NET_TIMEOUT_ATTEMPTS, $UCP_NET_TIMEOUT); check the storage and the network, then "
                            "run the command again")
    assert caplog.messages == ["s3://b/silent: no answer within 5 s; retrying, giving up after at most 26 s (bound it "
                               "with $UCP_NET_TIMEOUT seconds a try and $UCP_NET_TIMEOUT_ATTEMPTS tries)"]
    calls.clear()

    def busy():
        calls.append(1)
        raise ConnectionResetError

    with pytest.raises(StorageAccessError, match=r"failed \(ConnectionResetError\) 7 times"):
        net.retrying("s3://b/busy", "reading it", busy, lambda exc: True)
    assert len(calls) == 7  # control: the same loop, the other budget


def test_a_deadline_ends_tries_that_wait_longer_than_their_timeout(quick):
    """A try that waits twice its timeout (fsspec's HEAD, then GET) spends the deadline, not a count."""
    quick.setenv("UCP_NET_TIMEOUT", "0.1")
    quick.setenv("UCP_NET_TIMEOUT_ATTEMPTS", "3")  # deadline 0.3 + 1 + 2 s of backoff, + 0.05 s
    clock = [0.0]
    quick.setattr(net.time, "monotonic", lambda: clock[0])

    def twice():
        clock[0] += 3.0  # nearly the whole deadline
        raise Stall

    with pytest.raises(StorageAccessError, match=r"in 1 tries of 0.1 s"):
        net.retrying("http://h/x", "reading it", twice, lambda exc: True)


def test_the_first_timeout_tells_the_progress_bar(quick):
    seen = []
    quick.setattr(progress, "stall_listeners", [lambda url, s: seen.append((str(url), s))])
    quick.setenv("UCP_NET_TIMEOUT_ATTEMPTS", "2")
    with pytest.raises(StorageAccessError):
        net.retrying("s3://b/bar", "reading it", lambda: (_ for _ in ()).throw(Stall()), lambda exc: True)
    assert seen == [("s3://b/bar", 20.0)]


@pytest.mark.parametrize("name,value,kind", [("UCP_NET_TIMEOUT", "x", "a number of at least 0.1"),
                                             ("UCP_NET_TIMEOUT", "nan", "a number of at least 0.1"),
                                             ("UCP_NET_ATTEMPTS", "0", "an integer of at least 1"),
                                             ("UCP_NET_TIMEOUT_ATTEMPTS", "2.5", "an integer of at least 1")])
def test_settings_that_are_no_number_are_refused_in_one_line(quick, name, value, kind):
    quick.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        net.silent_bound_s() if name != "UCP_NET_ATTEMPTS" else net.attempts()
    assert str(e.value) == f"${name}={value!r}: must be {kind}"


def test_timeouts_are_told_from_other_failures_by_their_type():
    from botocore.exceptions import ConnectionClosedError, ReadTimeoutError
    from fsspec.exceptions import FSTimeoutError

    assert all(net.is_timeout(e) for e in (TimeoutError(), FSTimeoutError(), ReadTimeoutError(endpoint_url="u")))
    assert not any(net.is_timeout(e) for e in (ConnectionResetError(), ConnectionClosedError(endpoint_url="u")))


def test_the_progress_bar_shows_a_stall_as_a_stall():
    """A timeout puts "stalled: ..." on the open bar until bytes move again; a closed bar listens no more."""
    import io

    out = io.StringIO()
    bar = progress._Bar(total=100, desc="convert", file=out, disable=False, mininterval=0)
    bar.update(10)
    progress.report_stall("s3://b/run/data-0", 20.0)
    assert out.getvalue().splitlines()[-1].split("\r")[-1].endswith(
        "stalled: no answer from s3://b/run/data-0 for 20 s, retrying]")
    bar.update(5)
    assert "stalled" not in str(bar)
    bar.close()
    assert progress.stall_listeners == []
