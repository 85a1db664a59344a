"""ucp removes or replaces only what it wrote itself (#43, part 1 and 4: `ucp.format.save_folder`, retention, the
memory tier's folder, the `"save"` section, the Trainer's `checkpoint-N`), on real folders; each case's files that
are not ucp's are still there afterwards, byte for byte. One process: the cases that need training are in
tests/integration/test_never_removes.py."""
from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from support.atomic import memory_copy, saved_at
from ucp.deepspeed.config import SaveOptions
from ucp.deepspeed.memory.files import MemoryEvery, checked_folder, remove_copies
from ucp.elastic.hf_trainer import auto_checkpoint
from ucp.elastic.retention import prune
from ucp.elastic.trainer_folders import missing_files, not_a_folder
from ucp.errors import ConfigError, SaveError
from ucp.format import save_folder as ownership
from ucp.format.save_folder import PARTIAL_MARKER, check_save_folder, claim_tag, latest_is_ours, replace_latest


@pytest.fixture(autouse=True)
def said_afresh():
    """`pass_over` says each path once per process: each test starts with nothing said."""
    ownership._said.clear()
    yield
    ownership._said.clear()


def deepspeed_folder(save_dir: Path, step: int) -> Path:
    """The files `engine.save_checkpoint` leaves for `step` (their content is never read here), and `latest`."""
    tag = save_dir / f"global_step{step}"
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(os.urandom(256))
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(os.urandom(512))
    (save_dir / "latest").write_text(tag.name)
    return tag


def partial_save(save_dir: Path, step: int) -> Path:
    """A ucp save killed mid-write: marked, data files not renamed, no index."""
    tag = save_dir / f"global_step{step}"
    claim_tag(tag)
    (tag / "data-00000-of-00001.safetensors.partial").write_bytes(b"x" * 8)
    return tag


def digest(root: Path) -> dict[str, str]:
    """Every file and link under `root`, by path: its bytes' sha256 (or where the link points)."""
    out = {}
    for path in sorted(root.rglob("*")):
        if path.is_symlink():
            out[str(path)] = "-> " + os.readlink(path)
        elif path.is_file():
            out[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


# -- "keep": DeepSpeed's checkpoint in the save folder


def test_keep_never_removes_a_deepspeed_checkpoint_and_says_so_once(tmp_path, caplog):
    ds = deepspeed_folder(tmp_path, 1)
    before = digest(ds)
    for step in (2, 3, 4):
        saved_at(tmp_path / f"global_step{step}", step)
    gone = partial_save(tmp_path, 0)
    (tmp_path / "latest").write_text("global_step4")
    with caplog.at_level(logging.WARNING, logger="ucp.save"):
        removed = prune(tmp_path, keep=1)
        prune(tmp_path, keep=1)   # said once, not at every save
    # control: ucp's older committed checkpoints and its abandoned partial save go
    assert sorted(p.name for p in removed) == ["global_step0", "global_step2", "global_step3"]
    assert not gone.exists() and digest(ds) == before
    assert warnings_of(caplog) == [f"ucp: {ds}: not a ucp checkpoint (no ucp_index.json of the ucp format); ucp never "
                                   "removes or replaces it, move it away if it is not needed"]


def test_keep_never_removes_an_unmarked_folder_of_notes_or_a_file_named_as_a_tag(tmp_path, caplog):
    saved_at(tmp_path / "global_step5", 5)
    notes = tmp_path / "global_step2"
    notes.mkdir()
    (notes / "data-notes.txt").write_text("a folder a person made")
    (tmp_path / "global_step3").write_text("a file")
    before = digest(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ucp.save"):
        assert prune(tmp_path, keep=1) == []
    assert digest(tmp_path) == before
    assert warnings_of(caplog) == [f"ucp: {notes}: not a ucp checkpoint (no ucp_index.json of the ucp format); ucp "
                                   "never removes or replaces it, move it away if it is not needed"]


def test_a_removal_cut_short_leaves_a_folder_marked_ucps_that_the_next_one_finishes(tmp_path, monkeypatch):
    """A node lost while "keep" or the memory tier removed a checkpoint left its data without index or marker,
    which the next start then took for another tool's folder (test_elastic_3d's spare copy, #43)."""
    for step in (1, 2):
        saved_at(tmp_path / f"global_step{step}", step)
    (tmp_path / "latest").write_text("global_step2")
    real_unlink = os.unlink

    def killed(path, *args, **kwargs):
        if "data-" in str(path):
            raise KeyboardInterrupt   # the process dies here
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", killed)
    with pytest.raises(KeyboardInterrupt):
        prune(tmp_path, keep=1)
    monkeypatch.undo()
    left = tmp_path / "global_step1"
    assert not (left / "ucp_index.json").exists() and (left / PARTIAL_MARKER).is_file()
    saved_at(tmp_path / "global_step3", 3)
    assert prune(tmp_path, keep=2) == [left]   # older than the newest committed and marked: removed
    assert not left.exists()


# -- `latest`


def test_latest_is_replaced_only_when_it_names_a_ucp_checkpoint_or_nothing(tmp_path, caplog):
    assert latest_is_ours(tmp_path)                    # none
    (tmp_path / "latest").write_text("global_step9")   # names nothing
    assert latest_is_ours(tmp_path)
    saved_at(tmp_path / "global_step9", 9)
    assert latest_is_ours(tmp_path)                    # a ucp checkpoint
    deepspeed_folder(tmp_path, 1)                      # DeepSpeed's `latest` now
    assert not latest_is_ours(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ucp.save"):
        assert not replace_latest(tmp_path, "global_step9")
    assert (tmp_path / "latest").read_text() == "global_step1"
    assert warnings_of(caplog) == [f"ucp: {tmp_path / 'latest'}: names what is not a ucp checkpoint (another "
                                   "tool's); ucp never removes or replaces it, move it away if it is not needed"]
    secret = tmp_path / "secret"
    secret.write_text("global_step9")
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").symlink_to(secret)           # a link is never followed, nor replaced
    assert not latest_is_ours(tmp_path)


# -- the save folder, checked at the start


def test_a_save_folder_whose_latest_names_a_deepspeed_checkpoint_is_refused_at_the_start(tmp_path):
    """A job resuming from the DeepSpeed checkpoint in D with "save": {"dir": D, "keep": 1} removed D/global_step1;
    a fresh "auto" start in D wrote its own global_step1 into DeepSpeed's folder and replaced its `latest`."""
    ds = deepspeed_folder(tmp_path, 1)
    before = digest(tmp_path)
    with pytest.raises(ConfigError) as refused:
        check_save_folder(tmp_path, None)
    assert str(refused.value) == (
        f'"ucp": {{"save": {{"dir": ...}}}}: {tmp_path / "latest"} names what is not a ucp checkpoint (another '
        "tool's, such as DeepSpeed's); ucp never replaces it: save into a folder of ucp's own (e.g. "
        f"{tmp_path / 'ucp'})")
    assert digest(tmp_path) == before and ds.is_dir()
    check_save_folder(tmp_path / "ucp", None)   # control: a folder of its own beside it
    check_save_folder(tmp_path / "ucp", 0)


def test_something_not_ucps_where_a_later_save_goes_is_refused_and_an_earlier_one_passed_over(tmp_path, caplog):
    (tmp_path / "global_step2").write_text("a regular file named as a tag")
    saved_at(tmp_path / "global_step1", 1)
    with pytest.raises(ConfigError) as refused:
        check_save_folder(tmp_path, 1)
    assert str(refused.value) == (
        f'"ucp": {{"save": {{"dir": ...}}}}: {tmp_path / "global_step2"}: a file, not a ucp checkpoint, and a later '
        "save of this job is named so; ucp never writes into what it did not write: move it away, or save into a "
        "folder of ucp's own")
    with caplog.at_level(logging.WARNING, logger="ucp.save"):
        check_save_folder(tmp_path, 2)   # resumed at step 2: no save of this job is named global_step2
    assert warnings_of(caplog) == [f"ucp: {tmp_path / 'global_step2'}: a file, not a ucp checkpoint; ucp never "
                                   "removes or replaces it, move it away if it is not needed"]
    assert (tmp_path / "global_step2").read_text() == "a regular file named as a tag"


@pytest.mark.parametrize("kind", ["file", "loop"])
def test_a_save_folder_that_is_a_file_or_a_link_loop_is_refused_at_the_start(tmp_path, kind):
    save_dir = tmp_path / "ckpt"
    if kind == "file":
        save_dir.write_text("not a folder")
        what = "a file"
    else:
        save_dir.symlink_to(save_dir)
        what = "a symbolic link that reaches no folder"
    with pytest.raises(ConfigError) as refused:
        check_save_folder(save_dir, None)
    assert str(refused.value) == (f'"ucp": {{"save": {{"dir": ...}}}}: {save_dir} is {what}, not a folder; choose '
                                  "a folder of ucp's own")
    linked = tmp_path / "linked"   # control: a link to a real folder is a save folder like any other
    (tmp_path / "real").mkdir()
    linked.symlink_to(tmp_path / "real")
    check_save_folder(linked, 0)


def test_a_save_never_writes_into_a_tag_folder_it_did_not_make(tmp_path):
    ds = deepspeed_folder(tmp_path, 6)
    before = digest(ds)
    with pytest.raises(SaveError) as refused:
        claim_tag(ds)
    assert str(refused.value) == (f"{ds}: not a ucp checkpoint (no ucp_index.json of the ucp format), where ucp "
                                  "saves this step; ucp never writes into what it did not write: move it away, or "
                                  "save into a folder of ucp's own")
    assert digest(ds) == before
    claim_tag(tmp_path / "global_step7")   # control: a new folder, then the same folder again (another rank)
    claim_tag(tmp_path / "global_step7")
    assert (tmp_path / "global_step7" / PARTIAL_MARKER).is_file()


@pytest.mark.parametrize("folder, why", [
    ("", '""'), (".", '"."'), ("~", '"~"'), ("~/ckpt", '"~/ckpt"'), ("$HOME/ckpt", '"$HOME/ckpt"')])
def test_a_save_dir_the_docs_do_not_promise_is_refused_in_one_line(folder, why):
    with pytest.raises(ConfigError) as refused:
        SaveOptions.from_config({"dir": folder, "every": 1, "keep": 1})
    assert str(refused.value) == (
        f"\"ucp\": {{\"save\": {{\"dir\": {folder!r}}}}}: must name a folder of its own, e.g. \"/ckpt/ucp\" (an "
        'absolute path, or a relative one below the working directory; "", "." and unexpanded "~" or "$VAR" are '
        "refused)")
    assert SaveOptions.from_config({"dir": "ckpts_ucp/", "every": 1}).every == 1   # control: the README's form


# -- the memory tier's folder


def test_a_memory_dir_of_home_is_refused_in_one_line():
    with pytest.raises(ConfigError) as refused:
        MemoryEvery.from_config({"every": 1, "dir": "~"}, "/ckpt/ucp")
    assert str(refused.value) == ('"ucp": {"save": {"memory": {"dir": \'~\'}}}: must be an absolute path of a folder '
                                  'of its own, e.g. "/dev/shm/ucp-myjob" ("~" is not expanded; "$VARS" are)')


@pytest.mark.parametrize("memory", ["ckpt", "ckpt/shm", "."])
def test_a_memory_dir_that_is_the_save_dir_inside_it_or_holding_it_is_refused_at_the_start(tmp_path, memory):
    save_dir = tmp_path / "ckpt"
    folder = os.path.normpath(tmp_path / memory)
    with pytest.raises(ConfigError) as refused:
        SaveOptions.from_config({"dir": str(save_dir), "every": 2, "memory": {"every": 1, "dir": folder}})
    assert str(refused.value) == (f'"ucp": {{"save": {{"memory": {{"dir": ...}}}}}}: {folder} is the save "dir" '
                                  f"{save_dir}, inside it or holds it; the memory tier needs a folder of its own, "
                                  'e.g. "/dev/shm/ucp-myjob"')
    control = SaveOptions.from_config({"dir": str(save_dir), "every": 2,
                                       "memory": {"every": 1, "dir": str(tmp_path / "shm")}})
    assert control.memory is not None


def test_a_memory_dir_with_vars_that_expand_to_the_save_dir_is_refused_on_the_node(tmp_path, monkeypatch):
    monkeypatch.setenv("UCP_TEST_JOB", str(tmp_path / "ckpt"))
    tier = MemoryEvery.from_config({"every": 1, "dir": "$UCP_TEST_JOB"}, str(tmp_path / "ckpt"))
    _, problem = checked_folder(tier, create=True, start_step=0)
    assert problem == (f'"ucp": {{"save": {{"memory": {{"dir": ...}}}}}}: {tmp_path / "ckpt"} is the save "dir" '
                       f"{tmp_path / 'ckpt'}, inside it or holds it; the memory tier needs a folder of its own, "
                       'e.g. "/dev/shm/ucp-myjob"')


def test_a_memory_dir_holding_other_folders_named_as_tags_keeps_them(tmp_path, caplog):
    """A memory "dir" already holding a DeepSpeed checkpoint and a folder of notes had them removed at the first
    start; now those a save of this job would be named as are refused at the start, the others passed over."""
    tier = MemoryEvery.from_config({"every": 1, "dir": str(tmp_path / "shm")}, str(tmp_path / "ckpt"))
    tier.path.mkdir(mode=0o700)
    ds = deepspeed_folder(tier.path, 4)
    (tier.path / "latest").unlink()
    notes = tier.path / "global_step1"
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    before = digest(tier.path)
    _, problem = checked_folder(tier, create=True, start_step=0)
    assert problem == (f'"ucp": {{"save": {{"memory": ...}}}}: memory folder {notes}: not a ucp checkpoint (no '
                       "ucp_index.json of the ucp format), and a later save of this job is named so; ucp never writes "
                       "into what it did not write: move it away, or save into a folder of ucp's own")
    with caplog.at_level(logging.WARNING, logger="ucp.save"):
        assert checked_folder(tier, create=True, start_step=4)[1] is None   # resumed at step 4: passed over
        remove_copies(tier.path, tier.job, lambda saved: True)              # what the tier removes at each save
    assert digest(tier.path) == before and ds.is_dir()
    assert warnings_of(caplog) == [
        f"ucp: {notes}: not a ucp checkpoint (no ucp_index.json of the ucp format); ucp never removes or replaces "
        "it, move it away if it is not needed",
        f"ucp: {ds}: not a ucp checkpoint (no ucp_index.json of the ucp format); ucp never removes or replaces it, "
        "move it away if it is not needed"]
    # control: this job's memory checkpoint and its abandoned partial save go
    memory_copy(tier.path / "global_step5", 5, tier.job)
    partial_save(tier.path, 6)
    remove_copies(tier.path, tier.job, lambda saved: True)
    assert not (tier.path / "global_step5").exists() and not (tier.path / "global_step6").exists()
    assert digest(tier.path) == before


# -- the Trainer's checkpoint-N (part 4: what a warning quotes)


def trainer_folder(output_dir: Path, step: int) -> Path:
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
    return folder


def test_a_trainer_latest_linking_to_a_secret_is_never_quoted(tmp_path):
    folder = trainer_folder(tmp_path, 3)
    secret = tmp_path / "secret"
    secret.write_text("AKIA-THE-SECRET-KEY")
    (folder / "latest").symlink_to(secret)
    why = missing_files(folder)
    assert why == "its 'latest' is a symbolic link, which ucp never follows"
    (folder / "latest").unlink()
    (folder / "latest").write_text("global_step9")   # control: a plain `latest` naming a missing tag is quoted
    assert missing_files(folder) == "its 'latest' names 'global_step9', which it does not hold"


def test_a_10_mb_trainer_latest_is_a_short_line(tmp_path):
    folder = trainer_folder(tmp_path, 3)
    (folder / "latest").write_bytes(b"A" * (10 << 20))
    assert missing_files(folder) == "its 'latest' is larger than 4096 bytes or unreadable, not a tag name"
    (folder / "latest").write_bytes(b"global_step3" + b"\x1b[2J" * 5 + b"B" * 100)
    assert missing_files(folder) == ("its 'latest' names 'global_step3?[2J?[2J?[2J?[2J?[2JBBBBBBBB'... (132 bytes), "
                                     "which it does not hold")


@pytest.mark.parametrize("kind", ["file", "loop"])
def test_a_trainer_checkpoint_that_is_a_file_or_a_link_loop_is_refused_in_one_line(tmp_path, kind):
    """"auto" skipped it silently, then the Trainer's save at step 6 died, at every elastic restart."""
    trainer_folder(tmp_path, 3)
    entry = tmp_path / "checkpoint-6"
    if kind == "file":
        entry.write_text("x")
        what = "a file"
    else:
        entry.symlink_to(entry)
        what = "a symbolic link that reaches no folder"
    assert not_a_folder(tmp_path) == (f'"ucp": {{"load": "auto"}}: {entry} is {what}, not a checkpoint folder; the '
                                      f"Trainer saves and rotates its checkpoint-N folders there: move it out of "
                                      f"{tmp_path}")
    trainer = SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path), world_size=1))
    with pytest.raises(ConfigError) as refused:   # what "auto" (ucp.transformers.train) does with it
        auto_checkpoint(trainer)
    assert str(refused.value) == not_a_folder(tmp_path)
    assert entry.is_symlink() if kind == "loop" else entry.read_text() == "x"
    entry.unlink()
    assert not_a_folder(tmp_path) is None   # control
    assert auto_checkpoint(trainer) is None   # checkpoint-3 is incomplete (no latest): a fresh start
