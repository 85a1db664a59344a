"""Which checkpoints "load": "auto" tries (ucp.elastic.resume) and "keep" removes (ucp.elastic.retention), on real
folders."""
from __future__ import annotations

import logging
import threading
from pathlib import Path

from support.atomic import saved_at
from ucp.elastic.resume import candidates, set_aside
from ucp.elastic.retention import prune
from ucp.format.folder import INDEX_NAME, locked_for_removal, reading
from ucp.format.save_folder import PARTIAL_MARKER


def tag(save_dir: Path, step: int, committed: bool = True, name: str | None = None) -> Path:
    """A checkpoint saved at `step` (named as a save names it unless `name`), or a save killed mid-write."""
    folder = save_dir / (name or f"global_step{step}")
    if committed:
        return saved_at(folder, step)
    folder.mkdir(parents=True)
    (folder / PARTIAL_MARKER).touch()   # as a save marks its folder before any data file
    (folder / "data-00000-of-00001.safetensors.partial").write_bytes(b"x")
    return folder


def names(save_dir: Path) -> list[str]:
    return sorted(p.name for p in save_dir.iterdir() if not p.name.startswith("."))


def test_candidates_are_the_committed_ones_newest_first_even_when_latest_lags(tmp_path):
    for step in (2, 10, 9):
        tag(tmp_path, step)
    tag(tmp_path, 11, committed=False)
    (tmp_path / "latest").write_text("global_step9")   # a save killed between its index and `latest`
    (tmp_path / "global_step12.damaged").mkdir()
    assert [p.name for p in candidates(tmp_path)] == ["global_step10", "global_step9", "global_step2"]
    assert candidates(tmp_path / "missing") == []


def test_keep_removes_older_committed_and_abandoned_partial_checkpoints(tmp_path):
    for step in (1, 2, 3, 4):
        tag(tmp_path, step)
    tag(tmp_path, 2 + 10, committed=False)   # a save in flight, newer than every committed one: kept
    tag(tmp_path, 0, committed=False)        # a save killed mid-write long ago: removed
    (tmp_path / "latest").write_text("global_step4")
    removed = prune(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["global_step0", "global_step1", "global_step2"]
    assert names(tmp_path) == ["global_step12", "global_step3", "global_step4", "latest"]


def test_keep_never_removes_what_latest_names(tmp_path):
    for step in (1, 2, 3):
        tag(tmp_path, step)
    (tmp_path / "latest").write_text("global_step1")
    prune(tmp_path, keep=1)
    assert names(tmp_path) == ["global_step1", "global_step3", "latest"]


def test_keep_leaves_a_checkpoint_a_reader_holds(tmp_path):
    for step in (1, 2, 3):
        tag(tmp_path, step)
    (tmp_path / "latest").write_text("global_step3")
    with reading(tmp_path / "global_step1"):
        prune(tmp_path, keep=1)
        assert names(tmp_path) == ["global_step1", "global_step3", "latest"]
    prune(tmp_path, keep=1)
    assert names(tmp_path) == ["global_step3", "latest"]


def test_a_reader_waits_for_a_removal_in_progress(tmp_path):
    """The removal holds the lock exclusively: a reader that comes meanwhile waits until it is done."""
    folder = tag(tmp_path, 1)
    entered = threading.Event()

    def read() -> None:
        with reading(folder):
            entered.set()

    with locked_for_removal(folder) as free:
        assert free
        reader = threading.Thread(target=read)
        reader.start()
        assert not entered.wait(0.3)
    reader.join(5)
    assert entered.is_set()


def test_set_aside_renames_the_failed_and_points_latest_at_the_loaded(tmp_path):
    loaded = tag(tmp_path, 3)
    failed = [tag(tmp_path, 5), tag(tmp_path, 4)]
    (tmp_path / "global_step5.damaged").mkdir()
    (tmp_path / "latest").write_text("global_step5")
    moved = set_aside(failed, loaded)
    assert [p.name for p in moved] == ["global_step5.damaged1", "global_step4.damaged"]
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert [p.name for p in candidates(tmp_path)] == ["global_step3"]


def test_auto_and_keep_go_by_the_step_each_index_records(tmp_path, caplog):
    """Folders whose name says another step than their index (#32: tried first, and "keep": 1 removed the newest
    real checkpoint) are passed over with a warning: never loaded, never removed."""
    for step in (3, 4):
        tag(tmp_path, step)
    huge = tag(tmp_path, 2, name="global_step99999999999999999999")
    padded = tag(tmp_path, 3, name="global_step003")   # a second folder claiming step 3
    (tmp_path / "latest").write_text("global_step4")
    with caplog.at_level(logging.WARNING, logger="ucp.elastic"):
        assert [p.name for p in candidates(tmp_path)] == ["global_step4", "global_step3"]
    passed = [r.getMessage() for r in caplog.records]
    assert len(passed) == 2 and all("passes over it" in m for m in passed)
    assert any(f"{huge}: its index records step 2" in m for m in passed)
    assert any(f"{padded}: its index records step 3" in m for m in passed)
    assert prune(tmp_path, keep=1) == [tmp_path / "global_step3"]
    assert names(tmp_path) == ["global_step003", "global_step4", "global_step99999999999999999999", "latest"]
    # control: a folder named as its index's step is a checkpoint like any other, the newest here
    tag(tmp_path, 5)
    assert [p.name for p in candidates(tmp_path)] == ["global_step5", "global_step4"]


def test_auto_and_keep_never_follow_a_link_out_of_the_save_folder(tmp_path):
    outside = tag(tmp_path / "other", 9)
    save_dir = tmp_path / "ckpt"
    tag(save_dir, 4)
    (save_dir / "global_step9").symlink_to(outside, target_is_directory=True)
    (save_dir / "global_step1").symlink_to(outside, target_is_directory=True)
    (save_dir / "latest").write_text("global_step4")
    assert [p.name for p in candidates(save_dir)] == ["global_step4"]
    assert prune(save_dir, keep=1) == []
    assert (outside / INDEX_NAME).is_file() and (save_dir / "global_step1").is_symlink()
    tag(save_dir, 3)   # control: a real older checkpoint goes
    assert prune(save_dir, keep=1) == [save_dir / "global_step3"]
