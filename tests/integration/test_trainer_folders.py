"""The Hugging Face Trainer's output folders (issue #13, part 5), built from real DeepSpeed checkpoints.

The Trainer saves `output_dir/checkpoint-N/` holding DeepSpeed's save directory (`latest`,
`global_stepN/`) and its own files. These tests lay that structure out by hand from checkpoints the
suite trains, so they need no Trainer: the last `checkpoint-N` is picked as transformers'
`get_last_checkpoint` picks it, small JSON/text/tokenizer files travel into the ucp checkpoint and
its index, and pickles stay behind unread.
"""
from __future__ import annotations

import json
import pickle
import shutil
import zlib
from pathlib import Path

import pytest

import ucp
from support.checkpoints import TinySpec, tag_dir
from support.payload import Payload
from ucp.cli.main import main
from ucp.converters.trainer_folders import last_checkpoint
from ucp.errors import CorruptCheckpointError
from ucp.format.folder import INDEX_NAME

SIDE_FILES = {
    "config.json": json.dumps({"model_type": "tiny", "hidden_size": 7}).encode(),
    "generation_config.json": b'{"max_length": 20}',
    "trainer_state.json": json.dumps({"global_step": 10, "epoch": 1.5, "log_history": []}).encode(),
    "tokenizer.json": b'{"version": "1.0", "model": {"type": "BPE"}}',
    "tokenizer_config.json": b'{"model_max_length": 64}',
    "special_tokens_map.json": b'{"eos_token": "</s>"}',
    "vocab.json": b'{"a": 0, "b": 1}',
    "merges.txt": b"#version: 0.2\na b\n",
    "tokenizer.model": bytes(range(256)),  # SentencePiece models are binary protobufs
}
PICKLES = ("rng_state_0.pth", "rng_state_1.pth", "scheduler.pt", "training_args.bin")


def trainer_checkpoint(output_dir: Path, step: int, save_dir: Path) -> Path:
    """`output_dir/checkpoint-<step>/` as the Trainer writes it, around a copy of `save_dir`'s tag folder."""
    folder = output_dir / f"checkpoint-{step}"
    shutil.copytree(tag_dir(save_dir), folder / f"global_step{step}")
    (folder / "latest").write_text(f"global_step{step}")
    return folder


@pytest.fixture
def output_dir(tiny_checkpoint, tmp_path) -> Path:
    """A Trainer output_dir: checkpoint-2 (a ZeRO-2 run) and checkpoint-10 (ZeRO-1, with every side file).

    checkpoint-10 sorts before checkpoint-2 as text: only a numeric pick takes it.
    """
    out = tmp_path / "trainer_out"
    trainer_checkpoint(out, 2, tiny_checkpoint(TinySpec(stage=2)))
    last = trainer_checkpoint(out, 10, tiny_checkpoint(TinySpec(stage=1)))
    for name, data in SIDE_FILES.items():
        (last / name).write_bytes(data)
    for name in PICKLES:
        (last / name).write_bytes(_pickled_payload(tmp_path / f"{name}-ran"))
    (last / "model.safetensors").write_bytes(b"\0" * 64)
    (last / "zero_to_fp32.py").write_text("# DeepSpeed's script\n")
    (out / "checkpoint-12").write_text("a file, not a folder")
    (out / "checkpoint-11-old").mkdir()
    (out / "runs").mkdir()
    return out


def _pickled_payload(marker: Path) -> bytes:
    return pickle.dumps({"python": Payload(marker)})


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("names", [
    ["checkpoint-2", "checkpoint-10", "checkpoint-9"],
    ["checkpoint-0"],
    ["checkpoint-10-tmp", "checkpoint-", "tmp-checkpoint-3", "checkpoint-3"],
    ["runs", "checkpoint-x"],
    [],
])
def test_last_checkpoint_is_transformers_pick(names, tmp_path):
    trainer_utils = pytest.importorskip("transformers.trainer_utils")
    for name in names:
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-99").write_text("a file")
    ours = last_checkpoint(tmp_path)
    theirs = trainer_utils.get_last_checkpoint(str(tmp_path))
    assert (str(ours) if ours else None) == theirs


def test_convert_picks_the_last_checkpoint_and_says_so(output_dir, tmp_path, capsys):
    out = tmp_path / "ucp"
    code, _, err = run_cli(capsys, "convert", "--input", str(output_dir), "--output", str(out), "--quiet",
                           "--workers", "1")
    assert code == 0, err
    assert "using checkpoint-10, the last of checkpoint-2, checkpoint-10" in err
    picked = output_dir / "checkpoint-10" / "global_step10"
    assert ucp.open_checkpoint(out).source["path"] == str(picked.resolve())
    # The API and inspect resolve the output_dir the same way.
    assert ucp.open_checkpoint(output_dir).source["path"] == str(picked.resolve())
    code, stdout, _ = run_cli(capsys, "inspect", str(output_dir))
    assert code == 0 and "ZeRO-1" in stdout and "tag global_step10" in stdout
    assert f"extra files: {', '.join(sorted(SIDE_FILES))}" in stdout
    code, stdout, _ = run_cli(capsys, "verify", str(output_dir))
    assert code == 0 and str(picked.resolve()) in stdout


def test_tag_and_folder_name_one_checkpoint(output_dir, tmp_path, capsys):
    indexes = {}
    for label, argv in {"last": ["--input", str(output_dir)],
                        "tag": ["--input", str(output_dir), "--tag", "checkpoint-10"],
                        "folder": ["--input", str(output_dir / "checkpoint-10")]}.items():
        out = tmp_path / label
        code, _, err = run_cli(capsys, "convert", *argv, "--output", str(out), "--quiet", "--workers", "1")
        assert code == 0, err
        indexes[label] = (out / INDEX_NAME).read_text()
    assert indexes["last"] == indexes["tag"] == indexes["folder"]
    earlier = ucp.open_checkpoint(output_dir, "checkpoint-2")
    assert earlier.source["zero_stage"] == 2 and earlier.source["tag"] == "global_step2"


def test_errors_list_the_checkpoint_folders(output_dir, tmp_path, capsys):
    code, _, err = run_cli(capsys, "convert", "--input", str(output_dir), "--tag", "checkpoint-7",
                           "--output", str(tmp_path / "out"))
    line = one_line(err)
    assert code == 2 and str(output_dir / "checkpoint-7") in line and "checkpoint-2, checkpoint-10" in line
    code, _, err = run_cli(capsys, "convert", "--input", str(output_dir), "--tag", "global_step10",
                           "--output", str(tmp_path / "out"))
    line = one_line(err)
    assert code == 2 and "global_step10" in line and "checkpoint-2, checkpoint-10" in line
    (output_dir / "checkpoint-10" / "latest").unlink()  # a save that did not finish
    code, _, err = run_cli(capsys, "convert", "--input", str(output_dir), "--output", str(tmp_path / "out"))
    note, line = err.splitlines()
    assert note.endswith("using checkpoint-10, the last of checkpoint-2, checkpoint-10") and "Traceback" not in err
    assert code == 2 and str(output_dir / "checkpoint-10") in line and "latest" in line
    assert "--tag" in line and "checkpoint-2" in line
    assert not (tmp_path / "out").exists()


def test_side_files_travel_and_pickles_stay(output_dir, tmp_path, capsys):
    out = tmp_path / "ucp"
    code, _, err = run_cli(capsys, "convert", "--input", str(output_dir), "--output", str(out), "--quiet",
                           "--workers", "1")
    assert code == 0, err
    skipped = [line for line in err.splitlines() if "left out" in line]
    assert len(skipped) == 1 and all(name in skipped[0] for name in PICKLES) and "run code" in skipped[0]
    # Only the scheduler's file is said to be in the index, as the engine's LR scheduler state (the run has one).
    assert "rng_state_0.pth, rng_state_1.pth, training_args.bin (pickles, which run code when loaded); " in skipped[0]
    assert "scheduler.pt (pickles, which run code when loaded; the engine's LR scheduler state is in the index)" \
        in skipped[0]
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("data-")) == sorted([*SIDE_FILES, INDEX_NAME])
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["extra_files"] == {name: {"bytes": len(data), "crc32": zlib.crc32(data)}
                                    for name, data in SIDE_FILES.items()}
    ckpt = ucp.open_checkpoint(out)
    planned = ucp.open_checkpoint(output_dir)
    for name, data in SIDE_FILES.items():
        assert ckpt.extra_file(name) == data == planned.extra_file(name)
    assert ckpt.extra_file_path("config.json") == out / "config.json"
    with pytest.raises(KeyError, match="rng_state_0.pth"):
        ckpt.extra_file("rng_state_0.pth")
    assert not list(tmp_path.glob("*-ran"))  # no pickle was ever loaded

    assert run_cli(capsys, "verify", str(out))[0] == 0  # negative control for the checks below
    (out / "trainer_state.json").write_bytes(SIDE_FILES["trainer_state.json"].replace(b"10", b"11"))
    (out / "merges.txt").unlink()
    code, _, err = run_cli(capsys, "verify", str(out))
    assert code == 1
    assert str(out / "trainer_state.json") in err and str(out / "merges.txt") in err
    with pytest.raises(CorruptCheckpointError, match="trainer_state.json"):
        ucp.open_checkpoint(out).extra_file("trainer_state.json")


def test_a_lone_tag_folder_carries_nothing(output_dir, tmp_path, capsys):
    # A tag folder given on its own may sit anywhere: the files beside it are not the checkpoint's.
    home = tmp_path / "home"
    shutil.copytree(output_dir / "checkpoint-10", home)
    (home / "latest").unlink()
    out = tmp_path / "ucp"
    code, _, err = run_cli(capsys, "convert", "--input", str(home / "global_step10"), "--output", str(out),
                           "--quiet")
    assert code == 0, err
    assert ucp.open_checkpoint(out).extra_files == [] and "left out" not in err
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("data-")) == [INDEX_NAME]


def test_interrupted_copy_is_redone(output_dir, tmp_path, capsys):
    out = tmp_path / "ucp"
    assert run_cli(capsys, "convert", "--input", str(output_dir), "--output", str(out), "--quiet")[0] == 0
    (out / INDEX_NAME).unlink()  # as if the driver died after copying the side files, before the commit
    (out / "config.json").write_bytes(b"{")
    (out / "vocab.json.partial").write_bytes(b"{")
    code, _, err = run_cli(capsys, "convert", "--input", str(output_dir), "--output", str(out), "--quiet")
    assert code == 0, err
    assert ucp.open_checkpoint(out).verify() == []
    assert not (out / "vocab.json.partial").exists()


def test_inspect_into_a_pipe_its_reader_closed_ends_quietly(output_dir):
    """`ucp inspect ... | head`: the reader goes away before the table is written; no error line, and the exit
    status of a tool that SIGPIPE ended (141), as the shell reports for `cat` or `ls`."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-m", "ucp.cli.main", "inspect", str(output_dir)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # before ucp has started (its imports alone take longer): its writes meet a closed pipe
    err = child.stderr.read().decode()
    assert child.wait(timeout=120) == 141 and "Broken pipe" not in err and "Error" not in err, err
