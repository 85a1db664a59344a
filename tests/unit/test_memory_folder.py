"""Which node copies of a memory folder a job uses, and what it refuses (#32: `ucp.deepspeed.memory.files`,
`memory.manifest`, `memory.resume`, `auto_resume.resume_auto`, `ucp.elastic.restart.read_progress`), on node copies
as the memory tier writes them (`support.atomic.memory_copy`), then damaged. One process: no torch.distributed."""
from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.atomic import memory_copy, saved_at
from ucp.deepspeed.auto_resume import resume_auto
from ucp.deepspeed.config import MemoryEvery
from ucp.deepspeed.memory.files import read_copies, remove_copies, untrusted
from ucp.deepspeed.memory.manifest import MANIFEST_NAME
from ucp.deepspeed.memory.resume import memory_resume_point
from ucp.elastic.restart import PROGRESS_NAME, Progress, read_progress, record_progress
from ucp.errors import CheckpointMismatchError, ConfigError
from ucp.format.folder import INDEX_NAME


@pytest.fixture
def tier(tmp_path) -> MemoryEvery:
    """The memory section of a job saving into tmp_path/ckpt, its memory folder tmp_path/shm."""
    return MemoryEvery.from_config({"every": 1, "dir": str(tmp_path / "shm")}, str(tmp_path / "ckpt"))


@pytest.fixture
def alarm():
    """A hang fails the test instead of the suite."""
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("hung"))
    signal.alarm(30)
    yield
    signal.alarm(0)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_manifest_that_is_a_fifo_or_a_link_to_dev_zero_is_passed_over(tier, alarm, caplog):
    copy = memory_copy(tier.path / "global_step3", 3, tier.job)
    assert list(read_copies(tier.path, tier.job)) == ["global_step3"]  # control
    manifest = copy / MANIFEST_NAME
    for plant, says in [(os.mkfifo, "not a regular file"), (lambda p: p.symlink_to("/dev/zero"), "symbolic link")]:
        manifest.unlink()
        plant(manifest)
        caplog.clear()
        assert read_copies(tier.path, tier.job) == {}
        [line] = warnings_of(caplog)
        assert str(manifest) in line and says in line and "\n" not in line


HOSTILE_MANIFESTS = {  # the sound manifest -> the text written in its place
    "a JSON list": lambda m: json.dumps([m]),
    "no holds": lambda m: json.dumps({k: v for k, v in m.items() if k != "holds"}),
    "step NaN": lambda m: json.dumps({**m, "step": float("nan")}),
    "step 1e400": lambda m: json.dumps({**m, "step": 0}).replace('"step": 0', '"step": 1e400'),
    "rank x": lambda m: json.dumps({**m, "holds": {"x": m["holds"]["0"]}}),
    "a file out of the folder": lambda m: json.dumps({**m, "files": [["../x", 8, 8]]}),
    "a range past its file": lambda m: json.dumps({**m, "holds": {"0": [[m["files"][0][0], 0, m["files"][0][1] + 1]]}}),
}


@pytest.mark.parametrize("lie", sorted(HOSTILE_MANIFESTS))
def test_a_hostile_manifest_is_one_warning_naming_it(tier, caplog, lie):
    copy = memory_copy(tier.path / "global_step3", 3, tier.job)
    manifest = copy / MANIFEST_NAME
    sound = json.loads(manifest.read_text())
    manifest.write_text(HOSTILE_MANIFESTS[lie](sound))
    assert read_copies(tier.path, tier.job) == {}
    [line] = warnings_of(caplog)
    assert line.startswith(f"ucp: {manifest}: ") and "passed over" in line and "\n" not in line, line
    manifest.write_text(json.dumps(sound))  # control
    assert list(read_copies(tier.path, tier.job)) == ["global_step3"]


def test_a_manifest_whose_step_disagrees_with_its_index_is_passed_over(tier, caplog):
    """#32: a step-3 copy whose manifest says 99 won over the disk tier's step 4."""
    copy = memory_copy(tier.path / "global_step3", 3, tier.job)
    assert memory_resume_point(tier, 2, "the disk tier") == copy  # control: step 3 is newer than 2
    manifest = json.loads((copy / MANIFEST_NAME).read_text())
    (copy / MANIFEST_NAME).write_text(json.dumps({**manifest, "step": 99}))
    assert memory_resume_point(tier, 4, "the disk tier") is None
    assert any(f"{copy}: its manifest says global_step3, step 99, its index step 3" in m for m in warnings_of(caplog))


def test_another_jobs_memory_checkpoint_is_passed_over(tier, tmp_path, caplog):
    """#32: a fresh job whose memory "dir" was another job's resumed that job's step."""
    copy = memory_copy(tier.path / "global_step3", 3, str(tmp_path / "other-job"))
    assert memory_resume_point(tier, -1, "starting fresh") is None
    assert f"{copy} is another job's memory checkpoint (of {tmp_path / 'other-job'}" in warnings_of(caplog)[0]
    remove_copies(tier.path, tier.job, lambda step: True)
    assert (copy / INDEX_NAME).is_file()  # never removed by this job
    mine = MemoryEvery.from_config({"every": 1, "dir": str(tier.path)}, str(tmp_path / "other-job"))
    assert memory_resume_point(mine, -1, "starting fresh") == copy  # control: its own job resumes from it


def test_a_tag_folder_linked_out_of_the_memory_folder_is_never_read_nor_removed(tier, tmp_path):
    """#32: the link was loaded, and at the next start the removal of newer memory checkpoints deleted the index
    of a committed checkpoint outside the memory folder through it."""
    outside = memory_copy(tmp_path / "elsewhere" / "global_step9", 9, tier.job)
    tier.path.mkdir(mode=0o700)
    (tier.path / "global_step9").symlink_to(outside, target_is_directory=True)
    newer, older = memory_copy(tier.path / "global_step5", 5, tier.job), memory_copy(tier.path / "global_step2", 2,
                                                                                      tier.job)
    assert sorted(read_copies(tier.path, tier.job)) == ["global_step2", "global_step5"]
    remove_copies(tier.path, tier.job, lambda step: step > 3)  # as a start from step 3 does
    assert (outside / INDEX_NAME).is_file() and (tier.path / "global_step9").is_symlink()
    assert not newer.exists() and (older / INDEX_NAME).is_file()  # control: this job's newer copy goes


def test_a_memory_folder_of_another_user_or_writable_by_others_is_refused(tier):
    tier.path.mkdir(mode=0o700)
    assert untrusted(tier.path) is None  # control
    tier.path.chmod(0o777)
    with pytest.raises(ConfigError, match=f"memory folder {tier.path}: writable by other users"):
        memory_resume_point(tier, -1, "starting fresh")
    tier.path.chmod(0o700)
    if os.geteuid() == 0:
        os.chown(tier.path, 65534, 65534)
        assert "owned by another user (uid 65534)" in untrusted(tier.path)


def test_a_memory_checkpoint_that_does_not_fit_the_model_falls_back_to_disk(tier, tmp_path, caplog):
    """#32: it raised CheckpointMismatchError on every rank, so every restart failed until /dev/shm was cleared."""
    disk = saved_at(tmp_path / "ckpt" / "global_step4", 4)
    memory = memory_copy(tier.path / "global_step5", 5, tier.job)
    engine = SimpleNamespace(global_steps=0)

    def load(engine, path, refuse):
        if Path(path).parent == refuse:
            raise CheckpointMismatchError(f"{path}: parameter w has shape [4], the model's [5]")
        engine.global_steps = int(Path(path).name.removeprefix("global_step"))

    resumed = resume_auto(engine, tmp_path / "ckpt", load, tier, refuse=tier.path)
    assert (resumed.path, resumed.step) == (disk, 4)
    assert any(f"{memory} fails its checks" in m and f"falling back to {disk}" in m for m in warnings_of(caplog))
    with pytest.raises(CheckpointMismatchError):  # control: a disk checkpoint that does not fit is the config's
        resume_auto(engine, tmp_path / "ckpt", load, None, refuse=disk.parent)


@pytest.mark.parametrize("record", ['{"step": 1e400, "time": 1.0, "world": 2}', '{"step": 3, "time": 1.0, "world": '
                                    '1e400}', '{"step": 3, "time": NaN, "world": 2}', "[3, 1.0, 2]", "fifo"])
def test_a_progress_record_out_of_range_is_one_warning(tmp_path, caplog, alarm, record):
    path = tmp_path / PROGRESS_NAME
    if record == "fifo":
        os.mkfifo(path)
    else:
        path.write_text(record)
    assert read_progress(tmp_path) is None
    [line] = warnings_of(caplog)
    assert line.startswith(f"ucp: {path}: ") and "\n" not in line
    path.unlink()
    record_progress(tmp_path, Progress(3, 1.5, 2))  # control
    assert read_progress(tmp_path) == Progress(3, 1.5, 2)
