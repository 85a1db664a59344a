"""Bad input: one clear line naming the file and the fix; never an index for a broken conversion."""
from __future__ import annotations

import os
import shutil

import pytest

from support.checkpoints import TinySpec, read_tag
from ucp.cli.main import main
from ucp.format.folder import INDEX_NAME

SPEC = TinySpec(stage=1)


@pytest.fixture
def source(tiny_checkpoint, tmp_path):
    """A private copy of a real checkpoint, safe to damage."""
    save_dir = tiny_checkpoint(SPEC)
    copy = tmp_path / "src"
    shutil.copytree(save_dir, copy)
    return copy


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(err: str, *needles: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def optim_file(save_dir, rank):
    return save_dir / read_tag(save_dir) / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def test_truncated_shard(source, tmp_path, capsys):
    shard = optim_file(source, 1)
    os.truncate(shard, shard.stat().st_size // 2)
    code, _, err = run_cli(capsys, "convert", "--input", str(source), "--output", str(tmp_path / "out"), "--quiet")
    assert code == 2
    assert_one_line_error(err, str(shard), "copy")
    assert not (tmp_path / "out" / INDEX_NAME).exists()


def test_missing_rank_file(source, tmp_path, capsys):
    shard = optim_file(source, 1)
    shard.unlink()
    code, _, err = run_cli(capsys, "convert", "--input", str(source), "--output", str(tmp_path / "out"), "--quiet")
    assert code == 2
    assert_one_line_error(err, str(shard), "missing")
    assert not (tmp_path / "out" / INDEX_NAME).exists()


def test_wrong_tag(source, tmp_path, capsys):
    code, _, err = run_cli(capsys, "convert", "--input", str(source), "--tag", "global_step999",
                           "--output", str(tmp_path / "out"))
    assert code == 2
    assert_one_line_error(err, "global_step999", read_tag(source))
    assert not (tmp_path / "out").exists()


def test_tag_from_latest_explicit_tag_and_tag_folder_agree(source, tmp_path, capsys):
    tag = read_tag(source)
    inputs = {"latest": ["--input", str(source)], "tag": ["--input", str(source), "--tag", tag],
              "folder": ["--input", str(source / tag)]}
    indexes = {}
    for label, argv in inputs.items():
        out = tmp_path / label
        assert run_cli(capsys, "convert", *argv, "--output", str(out), "--quiet")[0] == 0
        index = (out / INDEX_NAME).read_text()
        indexes[label] = index.replace(str(out), "")
    assert indexes["latest"] == indexes["tag"] == indexes["folder"]


def test_output_holding_a_different_checkpoint(source, tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "out"
    assert run_cli(capsys, "convert", "--input", str(source), "--output", str(out), "--quiet")[0] == 0
    index_before = (out / INDEX_NAME).read_bytes()
    other = tiny_checkpoint(TinySpec(stage=2))
    code, _, err = run_cli(capsys, "convert", "--input", str(other), "--output", str(out), "--quiet")
    assert code == 2
    assert_one_line_error(err, str(out), "different checkpoint")
    assert (out / INDEX_NAME).read_bytes() == index_before
    # The same source again is recognised and left alone.
    code, stdout, _ = run_cli(capsys, "convert", "--input", str(source), "--output", str(out), "--quiet")
    assert code == 0 and "already holds this conversion" in stdout


def test_output_with_foreign_files_is_refused(source, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "convert", "--input", str(source), "--output", str(out), "--quiet")
    assert code == 2
    assert_one_line_error(err, "notes.txt")
    assert (out / "notes.txt").read_text() == "mine"


def test_damaged_output_fails_verify_and_reads(source, tmp_path, capsys):
    import ucp
    from ucp.errors import CorruptCheckpointError

    out = tmp_path / "out"
    assert run_cli(capsys, "convert", "--input", str(source), "--output", str(out), "--quiet")[0] == 0
    assert run_cli(capsys, "verify", str(out))[0] == 0
    ckpt = ucp.open_checkpoint(out)
    name = "emb.weight"
    entry = ckpt.index.params[name].states["exp_avg"]
    with open(out / entry.file, "r+b") as f:
        f.seek(entry.begin)
        byte = f.read(1)
        f.seek(entry.begin)
        f.write(bytes([byte[0] ^ 0xFF]))
    code, _, err = run_cli(capsys, "verify", str(out))
    assert code == 1 and f"{name}:exp_avg" in err
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        ucp.open_checkpoint(out).tensor(name, "exp_avg")


@pytest.mark.parametrize("resume", [True, False], ids=["resume", "again"])
def test_converting_again_into_a_damaged_committed_folder_does_not_say_success(source, tmp_path, capsys, resume):
    """`convert --resume` (or a plain convert) of the same source into its committed output said it already holds
    this conversion, though the data was damaged after the commit (#21)."""
    import ucp

    out = tmp_path / "out"
    argv = ["convert", "--input", str(source), "--output", str(out), "--quiet"] + (["--resume"] if resume else [])
    assert run_cli(capsys, *argv)[0] == 0
    code, stdout, _ = run_cli(capsys, *argv)
    assert code == 0 and "already holds this conversion" in stdout  # negative control: undamaged
    entry = ucp.open_checkpoint(out).index.params["l1.weight"].states["exp_avg"]
    with open(out / entry.file, "r+b") as f:
        f.seek(entry.end - 1)
        byte = f.read(1)
        f.seek(entry.end - 1)
        f.write(bytes([byte[0] ^ 0x01]))
    code, stdout, err = run_cli(capsys, *argv)
    assert code == 2 and "already holds" not in stdout
    assert_one_line_error(err, str(out), "l1.weight:exp_avg fails its CRC-32", "convert again")


def test_interrupted_conversion_is_not_a_checkpoint(source, tmp_path, capsys):
    import ucp
    from ucp.errors import IncompleteCheckpointError

    out = tmp_path / "out"
    assert run_cli(capsys, "convert", "--input", str(source), "--output", str(out), "--quiet")[0] == 0
    (out / INDEX_NAME).unlink()  # as if the driver died before the commit point
    with pytest.raises(IncompleteCheckpointError, match="incomplete checkpoint at"):
        ucp.open_checkpoint(out)
    code, _, err = run_cli(capsys, "verify", str(out))
    assert code == 2
    assert_one_line_error(err, "incomplete checkpoint")
    # Converting again into the leftovers completes it.
    assert run_cli(capsys, "convert", "--input", str(source), "--output", str(out), "--quiet")[0] == 0
    assert ucp.open_checkpoint(out).verify() == []


def test_compressed_pickle_bomb_is_refused_unread(source, tmp_path, capsys):
    """A 1.5 MB rank file whose data.pkl would inflate to 1.5 GiB: refused without inflating it."""
    import resource
    import zipfile

    shard = optim_file(source, 1)
    shard.unlink()
    with zipfile.ZipFile(shard, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        with archive.open("archive/data.pkl", "w", force_zip64=True) as f:
            for _ in range(24):
                f.write(bytes(64 << 20))
    assert shard.stat().st_size < 4 << 20
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code, _, err = run_cli(capsys, "convert", "--input", str(source), "--output", str(tmp_path / "out"), "--quiet",
                           "--workers", "1")
    assert code == 2
    assert_one_line_error(err, str(shard), "compressed")
    # ru_maxrss is in KiB on Linux: the conversion grew this process by far less than the 1.5 GiB bomb.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before < 256 << 10


def _optimizer_state_holder(sd: dict, stage: int) -> dict:
    """The torch optimizer state dict inside a rank file of `stage`: the dict whose 'state' DeepSpeed fills."""
    if stage == 0:
        return sd["optimizer"].get("optimizer_state_dict", sd["optimizer"])
    return sd["optimizer_state_dict"]["base_optimizer_state" if stage in (1, 2) else "optimizer_state_dict"]


@pytest.mark.parametrize("stage,fmt", [(0, "ucp"), (1, "ucp"), (3, "deepspeed")])
def test_optimizer_state_that_is_no_dict(stage, fmt, tiny_checkpoint, tmp_path, capsys):
    """A rank file whose optimizer `state` is a list (damaged, or written by something else) is one error line
    naming that file and exit 2, for every reader of DeepSpeed's optimizer state (ZeRO-0 reads it from the model
    file; ZeRO-1/2, pipeline and MoE share the ZeRO-1/2 reader; ZeRO-3 has its own), whatever the output format
    (issue #32 found it under --format deepspeed)."""
    import torch

    source = tmp_path / "src"
    shutil.copytree(tiny_checkpoint(TinySpec(stage=stage)), source)
    damaged = (source / read_tag(source) / "mp_rank_00_model_states.pt" if stage == 0 else optim_file(source, 1))
    sd = torch.load(damaged, weights_only=False)
    holder = _optimizer_state_holder(sd, stage)
    holder["state"] = list(holder["state"].values())
    torch.save(sd, damaged)
    code, _, err = run_cli(capsys, "convert", "--input", str(source), "--output", str(tmp_path / "out"), "--quiet",
                           "--format", fmt)
    assert code == 2
    assert_one_line_error(err, str(damaged), "'state' is a list where DeepSpeed writes a dict", "copy it again")
