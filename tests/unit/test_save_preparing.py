"""`saving.snapshot.Preparing`: the snapshot's layout and buffer prepared on a thread of its own, ahead of the first
save (issue #28: the first save at a layout stalled training for them). The timing itself is measured in
benchmarks/README.md (trace P); here: the work runs off the calling thread, `result` waits for it, and a failure
reaches the caller instead of being lost with the thread."""
from __future__ import annotations

import threading

import pytest

from ucp.deepspeed.saving.snapshot import Preparing


def test_the_layout_is_prepared_off_the_calling_thread_and_result_waits_for_it():
    release, ran_on = threading.Event(), []
    layout = object()

    def work():
        ran_on.append(threading.get_ident())
        release.wait(10)
        return layout

    preparing = Preparing(("exp_avg", "exp_avg_sq"), work)
    assert preparing.moments == ("exp_avg", "exp_avg_sq")
    waiter = threading.Thread(target=preparing.result)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()        # result waits while the work is not done
    release.set()
    waiter.join(10)
    assert preparing.result() is layout
    assert ran_on and ran_on[0] != threading.get_ident()
    # Negative control: the same check on work run by the caller itself fails.
    ran_on.clear()
    work()
    assert ran_on[0] == threading.get_ident()


def test_a_failed_preparation_is_raised_to_the_save():
    def work():
        raise MemoryError("no room for the snapshot buffer")

    preparing = Preparing(("exp_avg",), work)
    with pytest.raises(MemoryError, match="snapshot buffer"):
        preparing.result()
    with pytest.raises(MemoryError):  # and again at the next save, not swallowed once raised
        preparing.result()
