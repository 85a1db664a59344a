"""ucp never removes, writes into or replaces what it did not write (#43, part 1), through the elastic torchrun
example on 2 ranks with a real DeepSpeed checkpoint (the session's tiny ZeRO-1 one): one run that saves and prunes
beside another tool's folders on disk and in memory, and starts refused in one line where a save would have to write
into them. The single-process cases (each with its exact line) are in tests/unit/test_ownership.py."""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from support.checkpoints import TinySpec, tag_dir
from support.launch import run_logged, run_torchrun, torchrun_command
from ucp.format.save_folder import PARTIAL_MARKER

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "elastic" / "torchrun" / "train.py"
PASSED_OVER = ("ucp: {}: not a ucp checkpoint (no ucp_index.json of the ucp format); ucp never removes or replaces "
               "it, move it away if it is not needed")


def digest(root: Path) -> dict[str, str]:
    """Every file under `root`, by path relative to it: its bytes' sha256."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def beside(tmp_path_factory, tiny_checkpoint) -> tuple[Path, dict[str, str], str]:
    """Three steps saved every step with "keep": 1 and the memory tier, into a save folder holding DeepSpeed's
    checkpoint (as `global_step0/`) and a memory folder holding a folder of notes (`global_step0/`): the run's
    folder, what was there before, and the log."""
    tmp = tmp_path_factory.mktemp("beside")
    save_dir, memory_dir = tmp / "ckpt", tmp / "shm"
    shutil.copytree(tag_dir(tiny_checkpoint(TinySpec(stage=1))), save_dir / "global_step0")
    (memory_dir / "global_step0").mkdir(parents=True)
    memory_dir.chmod(0o700)
    (memory_dir / "global_step0" / "notes.txt").write_text("a person's notes")
    before = digest(tmp)
    run_torchrun(EXAMPLE, ["--save-dir", save_dir, "--steps", 3, "--keep", 1, "--memory-every", 1, "--memory-dir",
                           memory_dir], 2, tmp / "log")
    return tmp, before, (tmp / "log").read_text()


def test_keep_and_the_memory_tier_leave_another_tools_folders_byte_for_byte(beside):
    tmp, before, log = beside
    save_dir, memory_dir = tmp / "ckpt", tmp / "shm"
    after = digest(tmp)
    assert {k: v for k, v in after.items() if k in before} == before
    # control: ucp's own older checkpoints went (disk "keep": 1, the memory tier keeps its newest)
    ucp_saves = sorted(p.name for p in save_dir.iterdir() if (p / "ucp_index.json").is_file())
    assert ucp_saves == ["global_step3"] and (save_dir / "latest").read_text() == "global_step3"
    assert sorted(p.name for p in memory_dir.iterdir() if (p / "ucp_index.json").is_file()) == ["global_step3"]
    assert not list(tmp.rglob(PARTIAL_MARKER))   # each committed save's marker is gone
    for folder in (save_dir / "global_step0", memory_dir / "global_step0"):
        assert log.count(PASSED_OVER.format(folder)) == 1, log


def deepspeed_save_dir(tmp_path: Path, tiny_checkpoint) -> Path:
    """A copy of DeepSpeed's save folder (`latest` naming its `global_step3/`)."""
    shutil.copytree(tiny_checkpoint(TinySpec(stage=1)), tmp_path / "ds")
    return tmp_path / "ds"


def foreign_tag_save_dir(tmp_path: Path, tiny_checkpoint) -> Path:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "global_step2").write_text("a regular file named as a tag")
    return tmp_path / "ckpt"


REFUSED = {
    # A job resuming from DeepSpeed's checkpoint in D with "save": {"dir": D, "keep": 1} removed it; a fresh "auto"
    # start in D wrote its own global_step1 into DeepSpeed's folder and replaced DeepSpeed's `latest`.
    "into DeepSpeed's folder": (deepspeed_save_dir, [], lambda d: (
        f'"ucp": {{"save": {{"dir": ...}}}}: {d / "latest"} names what is not a ucp checkpoint (another tool\'s, '
        f"such as DeepSpeed's); ucp never replaces it: save into a folder of ucp's own (e.g. {d / 'ucp'})")),
    # The memory "dir" equal to the save "dir" was accepted; the disk save of step 2 vanished, then a traceback.
    "memory dir is the save dir": (deepspeed_save_dir, ["--memory-every", 1, "--memory-dir", "{d}"], lambda d: (
        f'"ucp": {{"save": {{"memory": {{"dir": ...}}}}}}: {d} is the save "dir" {d}, inside it or holds it; the '
        'memory tier needs a folder of its own, e.g. "/dev/shm/ucp-myjob"')),
    # A regular file named global_step2: "starting fresh", then a traceback at the save of step 2.
    "a file named global_step2": (foreign_tag_save_dir, [], lambda d: (
        f'"ucp": {{"save": {{"dir": ...}}}}: {d / "global_step2"}: a file, not a ucp checkpoint, and a later save '
        "of this job is named so; ucp never writes into what it did not write: move it away, or save into a folder "
        "of ucp's own")),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_start_that_would_write_into_what_ucp_did_not_write_is_one_line(case, tmp_path, tiny_checkpoint):
    make, extra, line = REFUSED[case]
    save_dir = make(tmp_path, tiny_checkpoint)
    before, entries = digest(save_dir), sorted(os.listdir(save_dir))
    args = ["--save-dir", save_dir, "--steps", 2, "--keep", 1, *[str(a).format(d=save_dir) for a in extra]]
    cmd, env = torchrun_command(EXAMPLE, args, 2)
    with pytest.raises(RuntimeError):
        run_logged(cmd, tmp_path / "log", timeout=300, env=env)
    log = (tmp_path / "log").read_text()
    assert f"ucp.errors.ConfigError: {line(save_dir)}\n" in log, log[-3000:]
    assert digest(save_dir) == before and sorted(os.listdir(save_dir)) == entries   # nothing added or changed
    assert "starting fresh" not in log   # refused before DeepSpeed runs, not after "auto" decided
    assert "Saving model checkpoint" not in log and "saved global_step" not in log
