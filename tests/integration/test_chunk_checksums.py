"""Every byte that reaches a model is checked, partial reads included: chunk checksums (docs/FORMAT.md).

A state's bytes are checksummed in chunks (runs between file offsets that are multiples of
`chunk_bytes`); a rank that reads part of a state widens its read to whole chunks and checks each.
Converted here with 32-byte chunks, so the tiny model's tensors span several.
"""
from __future__ import annotations

import zlib

import pytest
import torch

import ucp
from support.checkpoints import TinySpec, ucp_load_errors
from ucp.convert import convert
from ucp.deepspeed import LoadStats
from ucp.deepspeed.engine.targets import TargetTensor
from ucp.deepspeed.loading.source import AtomicSource
from ucp.errors import CorruptCheckpointError
from ucp.format.crc import chunk_bounds

SOURCE = TinySpec(stage=1)
CHUNK = 32
NAME, STATE = "emb.weight", "exp_avg"  # 13 x 7 fp32: 364 bytes, split between ZeRO ranks


@pytest.fixture(scope="module")
def converted(tiny_checkpoint, tmp_path_factory):
    out = tmp_path_factory.mktemp("chunks") / "ucp"
    convert(tiny_checkpoint(SOURCE), out, workers=2, progress=False, chunk_bytes=CHUNK)
    return out


def flipped(converted, tmp_path, offset_in_state: int, name: str = NAME):
    """A copy of the checkpoint with one bit of `name`'s exp_avg flipped, `offset_in_state` bytes in."""
    import shutil

    copy = tmp_path / "flipped"
    shutil.copytree(converted, copy)
    s = ucp.open_checkpoint(copy).index.params[name].states[STATE]
    with open(copy / s.file, "r+b") as f:
        f.seek(s.begin + offset_in_state)
        byte = f.read(1)[0]
        f.seek(s.begin + offset_in_state)
        f.write(bytes([byte ^ 0x10]))
    return copy


def test_every_state_records_the_crc_of_each_chunk(converted):
    ckpt = ucp.open_checkpoint(converted)
    assert ckpt.index.chunk_bytes == CHUNK
    checked = 0
    for entry in ckpt.index.params.values():
        for s in entry.states.values():
            data = (converted / s.file).read_bytes()
            bounds = chunk_bounds(s.begin, s.end, CHUNK)
            assert list(s.chunk_crc32) == [zlib.crc32(data[lo:hi]) for lo, hi in bounds]
            checked += len(bounds) > 1
    assert checked > 0 and ckpt.verify() == []


def read_part(path, start: int, numel: int) -> tuple[torch.Tensor, LoadStats]:
    """Elements [start, start + numel) of emb.weight:exp_avg, as a ZeRO rank's partition reads them."""
    ckpt = ucp.open_checkpoint(path)
    t = TargetTensor(NAME, "param", (13, 7), start, numel, False, lambda s: None)
    stats = LoadStats()
    return AtomicSource(ckpt).read({(NAME, STATE): t}, [(NAME, STATE)], True, stats)[(NAME, STATE)], stats


def test_a_partial_read_is_widened_to_whole_chunks_and_checked(converted, tmp_path):
    full = ucp.open_checkpoint(converted).tensor(NAME, STATE).reshape(-1)
    got, stats = read_part(converted, 46, 45)  # bytes [184, 364) of the state: ends on the state's end
    assert torch.equal(got, full[46:])
    s = ucp.open_checkpoint(converted).index.params[NAME].states[STATE]
    cover_begin = s.begin + 184 - (s.begin + 184) % CHUNK
    assert stats.bytes_read == s.end - cover_begin and stats.bytes_checked_extra == (s.begin + 184) % CHUNK
    # A flipped bit in a chunk of this read is caught; one in a chunk it does not touch is not its business.
    with pytest.raises(CorruptCheckpointError, match="bytes .* fail their checksum"):
        read_part(flipped(converted, tmp_path / "in", 300), 46, 45)
    elsewhere = flipped(converted, tmp_path / "out", 0)
    assert torch.equal(read_part(elsewhere, 46, 45)[0], full[46:])
    with pytest.raises(CorruptCheckpointError):
        read_part(elsewhere, 0, 45)


def test_a_flipped_bit_in_a_partitioned_tensor_is_refused_by_every_rank(converted, tiny_checkpoint, ckpt_root,
                                                                        tmp_path):
    """The hook on 2 ZeRO-1 ranks, each reading its part of the flat partitions: the rank whose part holds
    the flip finds it; every rank raises CorruptCheckpointError naming the file, none hangs, and every
    rank's engine is untouched (check_first: every byte is checked before any is installed)."""
    from ucp.converters.dispatch import plan_deepspeed

    # The parameter whose exp_avg the two ranks' partitions split, and where rank 1's part begins.
    plan = plan_deepspeed(tiny_checkpoint(SOURCE))
    name, second = next((p.name, p.states[STATE].fragments[1].info.offset) for p in plan.params
                        if len(p.states.get(STATE, ()).fragments if STATE in p.states else ()) == 2)
    start = second - plan.param(name).states[STATE].fragments[0].info.offset
    damaged = flipped(converted, tmp_path, 4 * (start + 1), name)  # inside rank 1's part
    [result] = ucp_load_errors([damaged], SOURCE, ckpt_root)
    assert len(result["errors"]) == 2
    for rank, error in enumerate(result["errors"]):
        assert error is not None and f"{name}:{STATE} bytes" in error and "fail their checksum" in error, \
            (rank, error)
    assert result["untouched_on"] == [True, True]
    # Control: installing layer by layer as it reads (check_first=False), the same damage is still refused
    # on every rank, but after the engine was changed.
    [streamed] = ucp_load_errors([damaged], SOURCE, ckpt_root, check_first=False)
    assert all(e is not None and "fail their checksum" in e for e in streamed["errors"])
    assert streamed["untouched_on"] != [True, True]
    # Negative control: the same load of the undamaged copy succeeds.
    [clean] = ucp_load_errors([converted], SOURCE, ckpt_root)
    assert clean["errors"] == [None, None]
