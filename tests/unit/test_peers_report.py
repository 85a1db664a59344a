"""benchmarks/peers.py's interface without running a job: its arguments, and the JSON (`--json-out`) and table it
builds from the records its workers write (pure functions). The records here are written by hand in the
workers' shape; the benchmark's own figures come only from its runs (benchmarks/README.md, Peers)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import peers  # noqa: E402

KEYS = ("blocked_s", "durable_s", "overhead_every1", "recovery_same_size_s", "recovery_new_size_s")


def saved(tool: str, blocked: list[float], durable: list[float | None], world: int = 2) -> dict:
    """One save record as _peers_llama.measure_saves writes it."""
    return {"tool": tool, "world": world, "params": 19796480, "plain_s": [2.0, 2.0], "blocked_s": blocked,
            "durable_s": durable, "committed_s": [1.0, 1.0], "every1_s": [3.0, 3.0, 3.0], "every4_s": [2.0] * 4,
            "bytes_per_save": 316743688, "peak_rss_per_rank": [2**30, 2**30], "launcher_peak_rss": 2**28}


def recovered(total: float, old: int = 2, new: int = 2) -> dict:
    return {"old_world": old, "new_world": new, "total_s": total, "detection_s": 1.0, "startup_s": 1.0,
            "load_s": 0.5, "first_step_s": 2.0, "checkpoint_step": 3}


PINNED_REFUSED = "Ignoring pin_memory flag for checkpoint staging as pinning memoryrequires CUDA"
DCP = {**saved("dcp", [0.5, 0.6, 0.7], [2.0, 2.0, 2.0]), "staging": "shared memory, not pinned",
       "pinned_refused": PINNED_REFUSED}


SAVES = [saved("ucp", [0.1, 0.3, 0.2], [4.0, 5.0, 6.0]), saved("ucp_memory", [0.2, 0.2, 0.2], [None] * 3),
         saved("deepspeed", [3.0, 3.0, 3.0], [4.0, 4.0, 4.0]), saved("dlrover", [0.4, 0.4, 0.4], [None] * 3),
         saved("dlrover_disk", [0.5, 0.5, 0.5], [7.0, 7.0, 7.0]), DCP]
SAME = {"ucp_memory": recovered(20.0), "dlrover": recovered(25.0)}
REFUSAL = "RuntimeError: The checkpoint being loaded used a DP world size of 2 but the current world size is 1."
NEW = {"ucp_memory": recovered(10.0, 2, 1),
       "dlrover": {"load_checkpoint": {"refused": REFUSAL}, "universal": {**recovered(40.0, 2, 1), "convert_s": 9.0},
                   "tag_converted": "1"}}


def test_arguments_of_the_issue():
    quick = peers.parse_args(["--quick", "--json-out", "out.json"])
    assert (quick.quick, quick.json_out, quick.worlds, quick.model) == (True, "out.json", [2], "20m")
    full = peers.parse_args([])
    assert (full.worlds, full.model, full.json_out) == ([2, 4], "112m", None)
    assert (full.new_size_from, full.new_size_model) == (4, "112m")
    smaller = peers.parse_args(["--worlds", "2", "--new-size-from", "4", "--new-size-model", "20m"])
    assert (smaller.worlds, smaller.new_size_from, smaller.new_size_model) == ([2], 4, "20m")
    with pytest.raises(SystemExit):  # a misspelt flag is refused, not ignored
        peers.parse_args(["--quik"])


def test_json_has_every_tool_and_key_with_reasons_for_nulls():
    result = peers.summarize(SAVES, SAME, NEW)
    assert list(result) == ["ucp", "ucp_memory", "dlrover", "dlrover_disk", "deepspeed", "dcp"]
    for tool, entry in result.items():
        assert set(KEYS) <= set(entry), tool
        for key in KEYS:
            assert entry[key] is not None or key in entry["why"], (tool, key)
    assert result["ucp"]["blocked_s"] == 0.2  # the median of the rounds
    assert result["ucp"]["overhead_every1"] == pytest.approx(0.5)
    assert result["ucp_memory"]["durable_s"] is None and "memory" in result["ucp_memory"]["why"]["durable_s"]
    assert result["deepspeed"]["recovery_same_size_s"] is None
    assert result["ucp_memory"]["recovery_new_size_s"] == 10.0
    assert result["dlrover"]["recovery_new_size_s"] == 40.0
    assert REFUSAL in result["dlrover"]["why"]["recovery_new_size_s"]


def test_dcp_entry_is_the_save_reference_with_its_staging_said():
    dcp = peers.summarize(SAVES, SAME, NEW)["dcp"]
    assert (dcp["blocked_s"], dcp["durable_s"]) == (0.6, 2.0)
    assert dcp["by_world"]["2"]["staging"] == "shared memory, not pinned"
    assert dcp["recovery_same_size_s"] is None and "save stalls only" in dcp["why"]["recovery_same_size_s"]
    assert PINNED_REFUSED in dcp["why"]["pinned_staging"]
    unmeasured = peers.summarize(SAVES[:-1], SAME, NEW)["dcp"]  # control: no DCP record, no DCP figures
    assert unmeasured["blocked_s"] is None and unmeasured["why"]["blocked_s"] == "not measured"
    assert "pinned_staging" not in unmeasured["why"]


def test_start_up_is_split_into_its_parts():
    parts = {"relaunch_s": 3.0, "imports_s": 6.0, "rendezvous_s": 0.5, "model_s": 1.0, "engine_init_s": 4.0,
             "load_s": 0.5, "first_step_s": 2.0}
    restart = {"called": 104.0, "process_at": 103.0, "first_step_at": 120.0, "startup_s": 11.5, "load_s": 0.5,
               "first_step_s": 2.0, "checkpoint_step": 3, **{k: v for k, v in parts.items() if k != "relaunch_s"}}
    split = peers.split(restart, 100.0, 2, 2)
    assert split["parts"] == parts and split["total_s"] == 20.0
    table = peers.startup_table(peers.summarize(SAVES, {"ucp_memory": split, "dlrover": recovered(25.0)}, NEW))
    assert table[2] == ("| ucp_memory | same size (2 → 2) | 20.00 s | 3.00 s | 6.00 s | 0.50 s | 1.00 s | 4.00 s | "
                        "0.50 s | 2.00 s |")
    assert len(table) == 3  # control: records without the parts (the hand-written ones) make no row


def test_a_tool_not_measured_is_null_with_why_not_a_number():
    result = peers.summarize([r for r in SAVES if not r["tool"].startswith("dlrover")], {}, {})
    assert result["dlrover"]["blocked_s"] is None
    assert result["dlrover"]["why"]["blocked_s"] == "not measured"
    assert "not measured" in " ".join(peers.targets(result))


def test_table_judges_the_targets():
    text = peers.markdown(peers.summarize(SAVES, SAME, NEW), {
        "machine": "x86_64, 2 cores", "model": "19.8M-parameter Llama", "ranks": "2 CPU ranks",
        "versions": "torch 2", "load_15min": 1.0})
    for tool in ("ucp", "ucp_memory", "dlrover", "dlrover_disk", "deepspeed", "dcp"):
        assert f"| {tool} |" in text
    assert "blocked per save ≤ DLRover's memory save: **PASS**" in text  # 0.2 (ucp's slower saver) vs 0.4
    assert "⅓ of the best peer path: **PASS**" in text  # 10 vs 40 / 3
    assert "1.1× DLRover's: **PASS**" in text  # 20 vs 1.1 x 25
    slower = [saved("ucp", [0.9] * 3, [4.0] * 3), *SAVES[1:]]
    assert "memory save: **MISS**" in peers.markdown(peers.summarize(slower, SAME, NEW), {
        "machine": "m", "model": "m", "ranks": "r", "versions": "v", "load_15min": 1.0})


def test_new_size_takes_the_faster_peer_path_that_ran():
    loaded = {**NEW, "dlrover": {**NEW["dlrover"], "load_checkpoint": recovered(30.0, 2, 1)}}
    assert peers.summarize(SAVES, SAME, loaded)["dlrover"]["recovery_new_size_s"] == 30.0
    assert peers.summarize(SAVES, SAME, NEW)["dlrover"]["recovery_new_size_s"] == 40.0  # refused: the universal path


def test_worker_refuses_tools_of_two_launchers_in_one_job():
    import _peers_llama

    common = ["--phase", "save", "--save-dir", "x", "--records", "r"]
    assert _peers_llama.parse(["--tools", "ucp", "ucp_memory", "deepspeed", *common]).tools[-1] == "deepspeed"
    with pytest.raises(SystemExit):  # ucp runs under torchrun, DLRover under dlrover-run
        _peers_llama.parse(["--tools", "ucp", "dlrover", *common])


def test_only_recoveries_carries_the_recovery_columns_and_keys_alone():
    assert peers.parse_args(["--only", "recoveries"]).only == "recoveries"
    with pytest.raises(SystemExit):  # only the recoveries can run alone
        peers.parse_args(["--only", "saves"])
    result = peers.summarize([], SAME, NEW, recoveries_only=True)
    assert list(result) == ["ucp", "ucp_memory", "dlrover", "dlrover_disk", "deepspeed", "dcp"]
    for tool, entry in result.items():
        assert {"recovery_same_size_s", "recovery_new_size_s", "why"} <= set(entry), tool
        assert not set(entry) & set(peers.SAVE_KEYS), tool
        assert not set(entry["why"]) & set(peers.SAVE_KEYS), tool
    assert (result["ucp_memory"]["recovery_same_size_s"], result["dlrover"]["recovery_new_size_s"]) == (20.0, 40.0)
    meta = {"machine": "m", "model": "m", "ranks": "r", "versions": "v", "load_15min": 1.0,
            "load_before_recoveries": (0.5, 1.0, 2.0)}
    text = peers.markdown(result, meta, recoveries_only=True)
    assert "blocked per save" not in text and "| tool | blocked" not in text
    assert "began 0.5/1.0/2.0" in text and "1.1× DLRover's: **PASS**" in text
    # control: the same records with the saves summarized the usual way carry the save keys, null with why
    full = peers.summarize([], SAME, NEW)["ucp"]
    assert full["blocked_s"] is None and full["why"]["blocked_s"] == "not measured"


def test_the_why_splits_each_restart_by_part():
    parts = {"engine init: DeepSpeed's initialize": {"s": 4.0, "calls": 1},
             "load: CRC-32": {"s": 0.25, "calls": 3}, "first step: forward": {"s": 1.0, "calls": 1}}
    restart = {"called": 104.0, "first_step_at": 120.0, "startup_s": 11.5, "load_s": 0.5, "first_step_s": 2.0,
               "sections": parts, "params": 7}
    same = {"ucp_memory": peers.split(restart, 100.0, 2, 2), "dlrover": recovered(25.0)}
    table = peers.sections_table(peers.summarize([], same, NEW, recoveries_only=True))
    assert table[2] == "| part | ucp_memory, same size |"
    assert table[4:] == ["| engine init: DeepSpeed's initialize | 4.00 s |", "| load: CRC-32 | 0.25 s (3×) |",
                         "| first step: forward | 1.00 s |"]
    assert peers.sections_table(peers.summarize([], SAME, NEW)) == []  # control: records without parts, no table


def test_sections_time_what_they_wrap():
    import types

    import _peers_llama

    module = types.ModuleType("peers_sections_probe")
    module.work = lambda n: sum(range(n))  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        sections = _peers_llama.Sections(((module.__name__, "work", "work"),))
        assert module.work(10) == 45 and module.work(3) == 3  # the wrapped function still answers
        report = sections.report()
        assert report["work"]["calls"] == 2 and report["work"]["s"] >= 0
        module.work = sections._timed(lambda n: n, "other")  # type: ignore[attr-defined]
        assert "other" not in sections.report()  # control: a section that never ran is not reported
    finally:
        del sys.modules[module.__name__]
