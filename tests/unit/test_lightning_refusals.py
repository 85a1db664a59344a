"""`ucp.lightning`'s one-line refusals and its choice of folder under `ckpt_path="auto"`, without processes."""
from __future__ import annotations

import os
import time

import pytest

from ucp.errors import CheckpointNotFoundError, ConfigError

pytest.importorskip("lightning")


def test_a_stage_lightning_cannot_build_is_refused_in_one_line():
    from ucp.lightning import DeepSpeedStrategy

    with pytest.raises(ConfigError) as caught:
        DeepSpeedStrategy(stage=4)
    assert str(caught.value) == ("DeepSpeedStrategy(stage=4): DeepSpeed's ZeRO stages are 0, 1, 2 and 3; pass one of "
                                 "them (the checkpoint may have been saved at any of them)")
    assert DeepSpeedStrategy(stage=3, offload_optimizer=True).config["zero_optimization"]["stage"] == 3  # Lightning's


def test_a_lightning_checkpoint_file_is_refused_in_one_line(tmp_path):
    from ucp.lightning.folders import deepspeed_folder

    (tmp_path / "epoch=0-step=4.ckpt").write_bytes(b"a torch.save of a dict")
    with pytest.raises(CheckpointNotFoundError) as caught:
        deepspeed_folder(tmp_path / "epoch=0-step=4.ckpt")
    assert str(caught.value) == (
        f"{tmp_path / 'epoch=0-step=4.ckpt'}: a Lightning checkpoint file, not a DeepSpeed checkpoint folder "
        "(<name>.ckpt/ holding checkpoint/ and latest), so it holds no optimizer partitions to reshard; resume from "
        "the folder DeepSpeedStrategy saved, or load its weights only with DeepSpeedStrategy(load_full_weights=True, "
        "stage=3)")
    with pytest.raises(CheckpointNotFoundError, match="no such checkpoint folder$"):
        deepspeed_folder(tmp_path / "missing.ckpt")
    (tmp_path / "cut.ckpt.ucp-partial").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="; it is a save cut short; pass a <name>.ckpt folder"):
        deepspeed_folder(tmp_path / "cut.ckpt.ucp-partial")


def test_candidates_are_newest_first_by_their_latest_file(tmp_path):
    from ucp.lightning.folders import candidates, cut_short

    for i, name in enumerate(["last.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"]):
        (tmp_path / name).mkdir()
        (tmp_path / name / "latest").write_text("checkpoint")
        stamp = time.time() - 100 + [30, 10, 20][i]
        os.utime(tmp_path / name / "latest", (stamp, stamp))
    (tmp_path / "no-latest.ckpt").mkdir()
    (tmp_path / "epoch=2-step=12.ckpt.ucp-partial").mkdir()
    (tmp_path / "notes.txt").write_text("")
    assert [p.name for p in candidates([tmp_path, tmp_path])] == [
        "last.ckpt", "epoch=1-step=8.ckpt", "epoch=0-step=4.ckpt", "no-latest.ckpt"]
    assert [p.name for p in cut_short([tmp_path])] == ["epoch=2-step=12.ckpt.ucp-partial"]


def test_commit_replaces_the_previous_checkpoint_only_once_written(tmp_path):
    from ucp.lightning.folders import commit, partial_path

    target = tmp_path / "last.ckpt"
    target.mkdir()
    (target / "latest").write_text("old")
    written = partial_path(target)
    written.mkdir()
    (written / "latest").write_text("new")
    commit(target)
    assert (target / "latest").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_per_process_batch_keeps_the_global_batch_or_says_why_not():
    from ucp.lightning import per_process_batch

    assert [per_process_batch(6, w) for w in (1, 2, 3, 6)] == [6, 3, 2, 1]
    with pytest.raises(ConfigError) as caught:
        per_process_batch(6, 4)
    assert str(caught.value) == ("global_batch 6 cannot be shared by 4 processes (Lightning's DistributedSampler gives "
                                 "each the same batch size): choose a global batch that every world size of the job "
                                 "divides, e.g. 24")
