"""The red team's hostile inputs (#21): special files and escapes out of the checkpoint folder.

Every case works on a private copy of a real DeepSpeed checkpoint (the tiny ZeRO-2 run on 2 ranks) and
runs what users run on it in-process: `ucp convert`, `inspect`, `verify` and `open_checkpoint`. Each must give
one line naming the file, exit 2, never hang (a FIFO opened for reading waits for a writer forever: each
case runs under an alarm), never print what a link points to, and never carry a file from outside the folder.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
from pathlib import Path

import pytest

import ucp
from support.checkpoints import TinySpec, read_tag
from ucp.cli.main import main
from ucp.errors import CorruptCheckpointError, UcpError
from ucp.format.folder import INDEX_NAME

SPEC = TinySpec(stage=2)
SECONDS = 30  # a case that takes longer hangs
SECRET = b"root:x:0:0:SECRET-LINE:/root:/bin/bash\n"


@pytest.fixture
def source(tiny_checkpoint, tmp_path) -> Path:
    """A private copy of the ZeRO-2 checkpoint's save folder, safe to damage."""
    copy = tmp_path / "src"
    shutil.copytree(tiny_checkpoint(SPEC), copy)
    return copy


@contextlib.contextmanager
def no_hang(what: str):
    def hang(signum, frame):
        raise TimeoutError(f"{what}: no answer in {SECONDS} s")

    previous = signal.signal(signal.SIGALRM, hang)
    signal.alarm(SECONDS)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def refused(capsys, *argv: str) -> str:
    """Run `ucp *argv`: it must exit 2 with one line, no traceback; returns the line."""
    with no_hang(" ".join(argv)):
        code = main(list(argv))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    return lines[0]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_a_rank_file_that_is_a_special_file_is_refused_everywhere(source, tmp_path, capsys, kind):
    """A FIFO hung convert, inspect, verify and the API; /dev/zero was read until memory ran out."""
    rank_file = source / read_tag(source) / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank_file.unlink()
    if kind == "fifo":
        os.mkfifo(rank_file)
    else:
        rank_file.symlink_to("/dev/zero")
    for argv in (["convert", "--input", str(source), "--output", str(tmp_path / "out"), "--quiet"],
                 ["inspect", str(source)], ["verify", str(source)]):
        line = refused(capsys, *argv)
        assert f"{rank_file}: not a regular file" in line, line
    assert not (tmp_path / "out" / INDEX_NAME).exists()
    with no_hang("open_checkpoint"), pytest.raises(CorruptCheckpointError, match="not a regular file"):
        ucp.open_checkpoint(source)


def test_latest_that_escapes_the_folder_or_holds_junk_is_refused(source, tiny_checkpoint, tmp_path, capsys):
    """`latest` naming another run's tag (absolute, or climbing out with ../) converted that run with exit 0;
    binary junk was a UnicodeDecodeError traceback; a symlink to a system file printed the file."""
    other = tiny_checkpoint(TinySpec(stage=1))
    outside = tmp_path / "passwd"
    outside.write_bytes(SECRET)
    latest = source / "latest"
    cases = {"absolute": str(other / read_tag(other)).encode(),
             "climbs out": os.path.relpath(other / read_tag(other), source).encode(),
             "binary": b"\xff\xfe\x00\x81global_step3\x00",
             "a link to a system file": outside, "a FIFO": None}
    assert cases["climbs out"].startswith(b"..")
    for what, content in cases.items():
        latest.unlink()
        if isinstance(content, bytes):
            latest.write_bytes(content)
        elif content is None:
            os.mkfifo(latest)
        else:
            latest.symlink_to(content)
        out = tmp_path / what.replace(" ", "-")
        for argv in (["convert", "--input", str(source), "--output", str(out), "--quiet"], ["inspect", str(source)]):
            line = refused(capsys, *argv)
            assert str(latest) in line and "SECRET" not in line and "root:" not in line, (what, line)
        assert not (out / INDEX_NAME).exists(), what


def test_symlinked_side_files_are_never_carried_and_verify_reports_them(source, tmp_path, capsys):
    """A Trainer's side files that are links to files outside were copied into conversions and exports,
    and `ucp verify` said OK; so was an extra file of a conversion replaced by a link."""
    (source / "config.json").write_text('{"model_type": "tiny"}')
    outside = tmp_path / "outside.json"
    outside.write_bytes(SECRET)
    (source / "tokenizer.json").symlink_to(outside)
    out = tmp_path / "ucp"
    assert main(["convert", "--input", str(source), "--output", str(out), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "tokenizer.json (symbolic links" in err, err
    assert not (out / "tokenizer.json").exists() and ucp.open_checkpoint(out).extra_files == ["config.json"]
    assert main(["verify", str(source)]) == 1
    assert f"{source / 'tokenizer.json'}: left out" in capsys.readouterr().err

    assert main(["verify", str(out)]) == 0  # negative control for what follows
    capsys.readouterr()
    kept = tmp_path / "config-copy.json"
    shutil.copy(out / "config.json", kept)  # the same bytes, so only the link itself is wrong
    (out / "config.json").unlink()
    (out / "config.json").symlink_to(kept)
    assert main(["verify", str(out)]) == 1
    assert f"{out / 'config.json'}: a symbolic link" in capsys.readouterr().err
    with pytest.raises(UcpError, match="symbolic link"):
        ucp.open_checkpoint(out).extra_file("config.json")
    line = refused(capsys, "export", "--input", str(out), "--output", str(tmp_path / "dcp"), "--to", "dcp", "--quiet")
    assert f"{out / 'config.json'}: a symbolic link" in line
