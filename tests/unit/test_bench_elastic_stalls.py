"""benchmarks/elastic.py's save_stalls: which steps count as plain steps beside a save's stall."""
from benchmarks.elastic import save_stalls


def steps(times: list[float], tp: int = 2, stalls: dict[int, float] | None = None, first: int = 1) -> list[dict]:
    out = []
    for i, t in enumerate(times):
        r = {"step": first + i, "time": t, "tp": tp}
        if stalls and first + i in stalls:
            r["save_stall_s"] = stalls[first + i]
        out.append(r)
    return out


def test_plain_steps_skip_the_first_the_save_steps_and_the_steps_after_them():
    # step durations: 2: 10, 3: 10, 4 (save): 14, 5 (after the save): 30, 6: 10
    recs = steps([0, 10, 20, 34, 64, 74], stalls={4: 4.0})
    assert save_stalls(recs, every=4, layout={"tp": 2}) == {"layout": {"tp": 2}, "stall_s": [4.0], "step_s": 10}


def test_negative_control_counting_save_steps_would_change_the_median():
    # durations: 3: 30, 4 (save): 30, 5 (after it): 30, 6: 10, 7: 10 -- with the save step and the one after it
    # counted the median would be 30; the plain steps 3, 6 and 7 give 10
    recs = steps([0, 10, 40, 70, 100, 110, 120], stalls={4: 4.0})
    assert save_stalls(recs, every=4, layout={"tp": 2})["step_s"] == 10


def test_steps_at_another_layout_and_across_a_restart_are_left_out():
    before = steps([0, 10, 20, 30], stalls={4: 1.0})   # T=2: steps 1-4
    after = steps([100, 105, 110, 115], tp=1, first=3, stalls={4: 0.5})   # T=1 after a restart, steps 3-6
    result = save_stalls(before + after, every=4, layout={"tp": 2})
    assert result == {"layout": {"tp": 2}, "stall_s": [1.0], "step_s": 10}
    at_tp1 = save_stalls(before + after, every=4, layout={"tp": 1})
    assert at_tp1 == {"layout": {"tp": 1}, "stall_s": [0.5], "step_s": 5}
