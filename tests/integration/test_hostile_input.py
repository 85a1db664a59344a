"""The red team's hostile inputs (#21): rank files that lie, special files and escapes out of the folder, and
checkpoints the hook must refuse before it touches the engine.

Every case works on a private copy of a real DeepSpeed checkpoint (the tiny runs on 2 ranks) or of its ucp
conversion, and runs what users run on it in-process: `ucp convert`, `inspect`, `verify` and `open_checkpoint`.
Each must give one line naming the file, exit 2, never hang (a FIFO opened for reading waits for a writer
forever: each case runs under an alarm), never print what a link points to, and never carry a file from
outside the folder. The hook cases share one engine on 2 ranks (`ucp_load_errors`), loaded one after another.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import struct
import zipfile
from pathlib import Path

import pytest

import ucp
from support.checkpoints import TinySpec, read_tag, ucp_load_errors
from ucp.cli.main import main
from ucp.converters.deepspeed.slices import load_dict
from ucp.converters.torch_zip import storage_entries
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


def optim_files(save_dir: Path) -> list[Path]:
    return sorted((save_dir / read_tag(save_dir)).glob("*optim_states.pt"))


def lie(save_dir: Path, how: str) -> str:
    """Make rank 1's optimizer file lie: a copy of rank 0's, a link to it, or swapped with it; returns a pattern
    of the files the refusal may name (of a swap, either)."""
    first, second = optim_files(save_dir)
    if how == "copy":
        shutil.copy(first, second)
    elif how == "link":
        second.unlink()
        second.symlink_to(first.name)
    else:
        first.rename(second.with_name("swap"))
        second.rename(first)
        second.with_name("swap").rename(second)
        return f"({first}|{second})"
    return str(second)


@pytest.mark.parametrize("spec", [TinySpec(stage=1), TinySpec(stage=2), TinySpec(stage=1, dtype="bf16", tie="tied"),
                                  TinySpec(stage=3)], ids=lambda s: s.name)
def test_rank_files_that_lie_are_refused(spec, tiny_checkpoint, tmp_path, capsys):
    """A rank file replaced by a copy of (or a link to) another rank's converted with exit 0 into wrong
    tensors; two files swapped converted too, and loaded through the hook. ZeRO-3 rank files record nothing
    that tells two swapped ones apart (docs/RELIABILITY.md), so only its copies and links are tried."""
    expected = {"copy": "holds the same bytes as", "link": "is the same file as",
                "swap": "(records 3 elements of padding|holds a piece of 'l1.weight')"}
    for how in ["copy", "link"] + (["swap"] if spec.stage < 3 else []):
        save_dir = tmp_path / how
        shutil.copytree(tiny_checkpoint(spec), save_dir)
        ucp.open_checkpoint(save_dir)  # negative control: the same copy before the lie
        named = lie(save_dir, how)
        with pytest.raises(CorruptCheckpointError, match=f"{named}: {expected[how]}.*copy every rank's own file"):
            ucp.open_checkpoint(save_dir)
    line = refused(capsys, "convert", "--input", str(save_dir), "--output", str(tmp_path / "out"), "--quiet")
    assert re.search(named, line) and not (tmp_path / "out" / INDEX_NAME).exists()
    for command in ("inspect", "verify"):
        assert re.search(named, refused(capsys, command, str(save_dir)))


def rewrite_entry(path: Path, entry: str, change) -> None:
    """Rewrite the zip file `path` with `change(bytes)` in place of `entry`'s bytes (CRC-32s recomputed), as a
    self-consistent rank file would be."""
    with zipfile.ZipFile(path) as archive:
        items = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w") as archive:
        for info, data in items:
            archive.writestr(info, change(data) if info.filename == entry else data)


@pytest.mark.parametrize("spec", [TinySpec(stage=2), TinySpec(stage=1, dtype="bf16", tie="tied")],
                         ids=lambda s: s.name)
def test_a_rank_file_whose_masters_disagree_with_the_module_weights_is_refused(spec, tiny_checkpoint, tmp_path):
    """A rank file that parses, has every CRC-32 right and lays its partitions out as its rank's (a file of
    another run, or of another rank whose slice mapping reads alike): the module weights beside the fp32
    masters tell it. Rank 1's first element continues a parameter split between the ranks."""
    save_dir = tmp_path / "src"
    shutil.copytree(tiny_checkpoint(spec), save_dir)
    second = optim_files(save_dir)[1]
    flat = load_dict(second)["optimizer_state_dict"]["single_partition_of_fp32_groups"][0]
    entry = storage_entries(second)[flat.storage.key].name
    rewrite_entry(second, entry, lambda data: data)
    ucp.open_checkpoint(save_dir)  # negative control: rewriting alone keeps the file valid
    rewrite_entry(second, entry, lambda data: struct.pack("<f", -2 * struct.unpack_from("<f", data)[0] - 1) + data[4:])
    with pytest.raises(CorruptCheckpointError, match=f"{second}: its fp32 master of 'l1.weight' at element \\d+ does "
                                                     "not match the module weight"):
        ucp.open_checkpoint(save_dir)


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


def edited_index(conversion: Path, folder: Path, edit) -> Path:
    """A copy of `conversion` whose index `edit(index)` changed (the data files, and their CRC-32s, as written)."""
    shutil.copytree(conversion, folder)
    index = json.loads((folder / INDEX_NAME).read_text())
    edit(index)
    (folder / INDEX_NAME).write_text(json.dumps(index))
    return folder


def test_the_hook_refuses_hostile_checkpoints_on_every_rank_untouched(tiny_checkpoint, tiny_conversion, ckpt_root,
                                                                        tmp_path):
    """The hook on 2 ranks, one engine, one load after the other. Before: swapped rank files loaded wrong
    values; a FIFO rank file left both ranks waiting forever; a dtype relabelled in the index (its CRC-32s still
    right) loaded wrong values, which only `verify` caught; steps that disagree were refused after the tensors
    were installed, and an LR scheduler state the engine's scheduler cannot load raised from the scheduler
    after. Each is now refused on both ranks with both engines as they were."""
    swapped = tmp_path / "swapped"
    shutil.copytree(tiny_checkpoint(SPEC), swapped)
    lie(swapped, "swap")
    fifo = tmp_path / "fifo"
    shutil.copytree(tiny_checkpoint(SPEC), fifo)
    rank_file = optim_files(fifo)[1]
    rank_file.unlink()
    os.mkfifo(rank_file)
    conversion = tiny_conversion(SPEC)

    def relabel(index):
        index["params"]["l1.bias"]["states"]["exp_avg"]["dtype"] = "int32"  # same size, same bytes

    def disagree(index):
        index["params"]["emb.weight"]["step"] = index["params"]["emb.weight"]["step"] - 1

    def other_scheduler(index):
        index["lr_scheduler"] = {"step_size": 10}  # not DeepSpeed's WarmupLR's: it has no last_batch_iteration

    def no_optimizer(index):
        index["optimizer"] = None  # no optimizer record (before: an AttributeError from the hook, found by mypy)

    cases = {swapped: "holds a piece of|padding in param group", fifo: "not a regular file",
             edited_index(conversion, tmp_path / "relabelled", relabel): "header entry l1.bias:exp_avg is",
             edited_index(conversion, tmp_path / "steps", disagree): "were saved at different steps",
             edited_index(conversion, tmp_path / "scheduler", other_scheduler): "LR scheduler state does not load",
             edited_index(conversion, tmp_path / "no_optimizer", no_optimizer): "saved no optimizer state, but the "
                                                                                 "engine's AdamW keeps",
             conversion: None}  # negative control: the same conversion, unedited, loads
    results = ucp_load_errors(list(cases), SPEC, ckpt_root)
    wrong = []
    for (path, expected), result in zip(cases.items(), results):
        refused_right = all(e is not None and re.search(expected, e) for e in result["errors"]) if expected else True
        if (expected is None and result["errors"] != [None, None]) or not refused_right or (
                expected and result["untouched_on"] != [True, True]):
            wrong.append((path.name, result["errors"], result["untouched_on"]))
    assert not wrong, wrong
