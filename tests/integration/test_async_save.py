"""Asynchronous saves straight into the atomic format (ucp.deepspeed.save / "ucp": {"save": ...}).

Pure parts first (CRC combining, the shared file arranged, disjoint writes by several "ranks", one
save in flight at a time), then real DeepSpeed runs on CPU: train while saving every few steps,
compare the result tensor for tensor with `ucp convert` of DeepSpeed's own synchronous checkpoint of
the same step, resume it at another DP degree and ZeRO stage, and kill or fail a writer mid-save.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import signal
import threading
import time
import zlib

import pytest
import torch
from safetensors import safe_open

import ucp
from support.atomic import assert_same_checkpoint
from support.checkpoints import (
    TinySpec,
    read_tag,
    start_ucp_save_run,
    trained_losses,
    ucp_resume,
    ucp_save_run,
    uninterrupted_losses,
)
from ucp.cli.main import main as cli_main
from ucp.convert import convert
from ucp.deepspeed.saving import files as save_files
from ucp.deepspeed.saving import writer as save_writer
from ucp.deepspeed.saving.files import arrange_files, whole_crcs
from ucp.deepspeed.saving.writer import BackgroundSave, SavePiece, SnapshotBuffer, write_pieces
from ucp.errors import IncompleteCheckpointError, SaveError
from ucp.format.crc import chunk_bounds, crc32_combine
from ucp.format.index import FORMAT_NAME
from ucp.format.safetensors_stream import TORCH_DTYPES, StreamingWriter, TensorSlot
from ucp.storage.fileio import tensor_bytes

META = {"format": FORMAT_NAME}


# -- crc32_combine -----------------------------------------------------------------------------------------

def test_crc32_combine_equals_the_crc_of_the_concatenation():
    rng = random.Random(7)
    for _ in range(300):
        a, b = rng.randbytes(rng.randint(0, 3000)), rng.randbytes(rng.randint(0, 3000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    data = rng.randbytes(3 << 20)
    cuts = sorted(rng.sample(range(1, len(data)), 40)) + [len(data)]
    crc, begin = 0, 0
    for end in cuts:
        crc = crc32_combine(crc, zlib.crc32(data[begin:end]), end - begin)
        begin = end
    assert crc == zlib.crc32(data)
    # Negative control: the length matters, so a wrong one must give another CRC.
    a, b = b"abc", b"defgh"
    assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b) + 1) != zlib.crc32(a + b)


# -- the arrangement of files every rank computes alike ----------------------------------------------------------------

SLOTS = [TensorSlot("l1.weight:fp32", "float32", (9, 7)), TensorSlot("l1.bias:fp32", "float32", (9,)),
         TensorSlot("l1.weight:exp_avg", "float32", (9, 7)), TensorSlot("l1.bias:exp_avg", "float32", (9,)),
         TensorSlot("proj.weight:fp32", "float32", (5, 5)), TensorSlot("pos_scale:value", "bfloat16", (4,)),
         TensorSlot("empty:fp32", "float32", (0,))]


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {s.key: torch.randn(s.shape, generator=g).to(TORCH_DTYPES[s.dtype]) for s in SLOTS}


def _reference_file(tmp_path, tensors) -> bytes:
    path = tmp_path / "reference.safetensors"
    writer = StreamingWriter(str(path), SLOTS, META)
    for s in SLOTS:
        writer.write(s.key, tensors[s.key])
    writer.close()
    return path.read_bytes()


def test_the_arranged_files_place_every_byte_where_the_streaming_writer_does(tmp_path):
    tensors = _tensors()
    arranged = arrange_files(SLOTS, 1 << 30, META)
    assert [f.name for f in arranged.files] == ["data-00000-of-00001.safetensors"]
    image = bytearray(arranged.files[0].size)
    image[:len(arranged.files[0].header)] = arranged.files[0].header
    for key, span in arranged.spans.items():
        image[span.begin:span.end] = tensor_bytes(tensors[key])
    assert bytes(image) == _reference_file(tmp_path, tensors)
    piece = arranged.piece("l1.weight:exp_avg", 10, 20, 4)
    assert (piece.begin, piece.end) == (arranged.spans["l1.weight:exp_avg"].begin + 40,
                                        arranged.spans["l1.weight:exp_avg"].begin + 120)
    with pytest.raises(ValueError, match="outside the tensor"):
        arranged.piece("l1.bias:fp32", 5, 5, 4)


def test_the_arrangement_splits_into_files_of_bounded_size_in_order():
    arranged = arrange_files(SLOTS, 300, META)
    names = [f.name for f in arranged.files]
    assert names == [f"data-{i:05d}-of-{len(names):05d}.safetensors" for i in range(len(names))] and len(names) > 2
    order = [(names.index(arranged.spans[s.key].file), arranged.spans[s.key].begin) for s in SLOTS]
    assert order == sorted(order)  # the slots' order is kept across and within files
    for f in arranged.files:
        held = [s for s in SLOTS if arranged.spans[s.key].file == f.name]
        assert f.size == len(f.header) + sum(s.nbytes for s in held)
        assert sum(s.nbytes for s in held) <= 300 or len(held) == 1


def _rank_pieces(arranged, tensors, rank: int, ranks: int):
    """Rank r of `ranks` holds the r-th contiguous run of every tensor's flattened elements (ZeRO-3 style)."""
    pieces, sources = [], {}
    for s in SLOTS:
        numel = tensors[s.key].numel()
        per = -(-numel // ranks)
        start, stop = min(numel, rank * per), min(numel, (rank + 1) * per)
        if stop > start:
            span = arranged.piece(s.key, start, stop - start, TORCH_DTYPES[s.dtype].itemsize)
            pieces.append(SavePiece(s.key, span.file, span.begin, span.end, s.dtype, start))
            sources[s.key] = tensors[s.key].reshape(-1)[start:stop]
    return pieces, sources


@pytest.mark.parametrize("chunk", [7, 4 << 20])  # 7 bytes: pieces span chunks and chunks span pieces
def test_ranks_writing_disjoint_pieces_make_the_file_and_its_checksums(chunk, tmp_path, monkeypatch):
    monkeypatch.setattr(save_writer, "_CHUNK", chunk)
    # Checksum chunks of 16 bytes, so that the ranks' pieces start and end inside chunks.
    monkeypatch.setattr(save_writer, "CHUNK_BYTES", 16)
    monkeypatch.setattr(save_files, "CHUNK_BYTES", 16)
    tensors = _tensors()
    arranged = arrange_files(SLOTS, 1 << 30, META)
    reports = []
    for rank in (2, 1, 0):  # the header writer (rank 0) comes last: its ftruncate must keep the others' bytes
        pieces, sources = _rank_pieces(arranged, tensors, rank, 3)
        buffer = SnapshotBuffer(pieces)
        buffer.fill([sources[p.key] for p in buffer.pieces])
        reports += write_pieces(tmp_path, arranged.files, buffer, headers=rank == 0)
    written = (tmp_path / "data-00000-of-00001.safetensors.partial").read_bytes()
    assert written == _reference_file(tmp_path, tensors)
    crcs = whole_crcs(arranged, reports)
    spans = arranged.spans
    assert crcs == {key: (zlib.crc32(tensor_bytes(t)),
                          [zlib.crc32(written[lo:hi]) for lo, hi in chunk_bounds(spans[key].begin, spans[key].end, 16)])
                    for key, t in tensors.items()}
    os.replace(tmp_path / "data-00000-of-00001.safetensors.partial", tmp_path / "data.safetensors")
    with safe_open(str(tmp_path / "data.safetensors"), framework="pt") as f:
        assert all(torch.equal(f.get_tensor(k), t) for k, t in tensors.items())
    # Negative control: a missing piece is found, not papered over.
    with pytest.raises(SaveError, match="no rank wrote bytes"):
        whole_crcs(arranged, [r for r in reports
                              if r.key != "l1.weight:fp32" or r.begin != arranged.spans[r.key].begin])


def test_pieces_adjacent_in_the_file_leave_in_one_write():
    arranged = arrange_files(SLOTS, 1 << 30, META)
    # A ZeRO-1/2 rank holds the tail of one tensor and the head of the next: adjacent in the state-major file.
    tail = arranged.piece("l1.weight:fp32", 40, 23, 4)
    head = arranged.piece("l1.bias:fp32", 0, 4, 4)
    apart = arranged.piece("l1.weight:exp_avg", 40, 23, 4)
    buffer = SnapshotBuffer([SavePiece("l1.bias:fp32", head.file, head.begin, head.end, "float32", 0),
                             SavePiece("l1.weight:fp32", tail.file, tail.begin, tail.end, "float32", 40),
                             SavePiece("l1.weight:exp_avg", apart.file, apart.begin, apart.end, "float32", 40)])
    assert [(r.begin, r.end) for r in buffer.runs] == [(tail.begin, head.end), (apart.begin, apart.end)]
    assert buffer.nbytes == (23 + 4 + 23) * 4


def test_a_save_waits_for_the_one_in_flight_and_its_failure_is_raised_once(caplog):
    job = BackgroundSave()
    release, order = threading.Event(), []
    job.start("first", lambda: (release.wait(10), order.append("first")))
    threading.Timer(0.3, release.set).start()
    with caplog.at_level(logging.WARNING, logger="ucp.save"):
        job.start("second", lambda: order.append("second"))
    assert "save second waits for save first" in caplog.text
    job.wait()
    assert order == ["first", "second"]

    def disk_full():
        raise OSError(28, "No space left on device")
    job.start("third", disk_full)
    with pytest.raises(SaveError, match="save third failed: OSError.*No space left"):
        job.wait()
    job.wait()  # reported once


# -- real DeepSpeed runs ---------------------------------------------------------------------------------

SAVE_EVERY, STEPS, RESUME_STEPS = 3, 6, 2
CASES = [  # (trained and saved at, resumed at)
    (TinySpec(stage=1), TinySpec(stage=3, world_size=3)),   # ZeRO-1 DP 2 -> ZeRO-3 DP 3
    (TinySpec(stage=3), TinySpec(stage=1, world_size=1)),   # ZeRO-3 DP 2 -> ZeRO-1 DP 1
    (TinySpec(stage=0), TinySpec(stage=2, world_size=1)),   # ZeRO-0 DP 2 -> ZeRO-2 DP 1
]


@pytest.mark.parametrize("source,target", CASES, ids=lambda s: s.name)
def test_async_saves_equal_converted_deepspeed_checkpoints_and_resume_elsewhere(
        source, target, tiny_checkpoint, ckpt_root, tmp_path):
    run = ucp_save_run(dataclasses.replace(source, steps=0), STEPS, SAVE_EVERY, ckpt_root)
    # Saving while training does not disturb it: the first steps are those of DeepSpeed's own run, to the bit.
    assert run.losses[:source.steps] == trained_losses(source, ckpt_root)
    assert read_tag(run.save_dir) == f"global_step{STEPS}"
    saved = ucp.open_checkpoint(run.save_dir / f"global_step{source.steps}")
    assert saved.verify() == [] and ucp.open_checkpoint(run.save_dir).verify() == []

    converted = ucp.open_checkpoint(convert(tiny_checkpoint(source), tmp_path / "converted", workers=1,
                                            progress=False).output)
    assert_same_checkpoint(saved, converted)
    # Negative control: the checkpoint of a later step must fail the same comparison.
    with pytest.raises(AssertionError):
        assert_same_checkpoint(ucp.open_checkpoint(run.save_dir), converted)

    # The run that saved is itself the uninterrupted run the resumed one must continue.
    resumed = ucp_resume(saved.path, target, RESUME_STEPS, source.steps, ckpt_root)
    assert resumed.losses == pytest.approx(run.losses[source.steps:source.steps + RESUME_STEPS], rel=1e-6)


def _wait_for(condition, what: str, proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended (exit {proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _stop(proc) -> None:
    """SIGTERM torchrun, which ends its ranks (they run in sessions of their own, out of reach of killpg)."""
    if proc.poll() is None:
        proc.terminate()
        proc.wait(timeout=60)


def _finish(proc, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        _stop(proc)


def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_latest_and_loadable(ckpt_root, tmp_path, capsys):
    spec = TinySpec(stage=1, steps=0)
    (tmp_path / "global_step4.hold").touch()
    proc, run_dir = start_ucp_save_run(spec, 6, 2, ckpt_root, tmp_path)
    log = run_dir / "train.log"
    try:
        # Both writers of the step-4 save stall mid-file; training goes on to step 6, whose save must wait.
        _wait_for(lambda: all((tmp_path / f"global_step4.rank{r}.pid").is_file() for r in range(2))
                  and "save global_step6 waits for save global_step4" in log.read_text(), "the stalled save", proc)
        os.kill(int((tmp_path / "global_step4.rank1.pid").read_text()), signal.SIGKILL)
    except BaseException:
        _stop(proc)
        raise
    assert _finish(proc) != 0
    save_dir = run_dir / "ucp"
    assert read_tag(save_dir) == "global_step2"
    with pytest.raises(IncompleteCheckpointError, match="incomplete checkpoint at"):
        ucp.open_checkpoint(save_dir / "global_step4")
    previous = ucp.open_checkpoint(save_dir)
    assert previous.path.name == "global_step2" and previous.verify() == []
    assert cli_main(["verify", str(save_dir)]) == 0  # the save folder: its `latest`
    assert f"{save_dir / 'global_step2'}: OK" in capsys.readouterr().out
    # It loads through the hook (given the save folder, it follows `latest`) and training continues.
    resumed = ucp_resume(save_dir, TinySpec(stage=2, world_size=1), RESUME_STEPS, 2, ckpt_root)
    straight = uninterrupted_losses(spec, TinySpec(stage=1).steps + RESUME_STEPS, ckpt_root)
    assert resumed.losses == pytest.approx(straight[2:2 + RESUME_STEPS], rel=1e-6)


def test_a_full_disk_on_one_rank_commits_nothing(ckpt_root, tmp_path):
    spec = TinySpec(stage=3, steps=0)
    (tmp_path / "global_step4.rank1.fail").touch()
    proc, run_dir = start_ucp_save_run(spec, 4, 2, ckpt_root, tmp_path)
    assert _finish(proc) != 0  # the run's final ucp.deepspeed.wait raises the failure on every rank
    log = (run_dir / "train.log").read_text()
    assert "not committed, rank 1: OSError" in log and "No space left on device" in log
    save_dir = run_dir / "ucp"
    assert read_tag(save_dir) == "global_step2"
    assert ucp.open_checkpoint(save_dir).verify() == []
    with pytest.raises(IncompleteCheckpointError, match="incomplete checkpoint at"):
        ucp.open_checkpoint(save_dir / "global_step4")
