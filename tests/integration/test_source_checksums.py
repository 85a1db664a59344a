"""A damaged rank file is refused while it is converted: every zip entry a conversion reads is checked against
the CRC-32 `torch.save` recorded for it (ucp.convert.source_check), before anything is committed."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from support.checkpoints import TinySpec, ucp_load_errors
from ucp.cli.main import main
from ucp.convert.manifest import MANIFEST_SUFFIX
from ucp.convert.source_check import SMALL_ENTRY_BYTES
from ucp.converters.dispatch import plan_deepspeed
from ucp.converters.torch_zip import ZipEntry, storage_entries
from ucp.format.folder import INDEX_NAME
from ucp.format.safetensors_stream import TORCH_DTYPES


@pytest.fixture
def source(tiny_checkpoint, tmp_path):
    """Factory: a private copy of a real checkpoint of `spec`, safe to damage."""
    def make(spec: TinySpec) -> Path:
        copy = tmp_path / "src"
        shutil.copytree(tiny_checkpoint(spec), copy)
        return copy

    return make


def flip_bit(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def unloaded_bytes(save_dir: Path) -> dict[tuple[str, ZipEntry], list[int]]:
    """The bytes of each checked zip entry of `save_dir`'s rank files that no state of its plan takes: the
    padding of ZeRO partitions (ZeRO-1/2's after a group's last parameter, ZeRO-3's after each parameter's last
    element), and small entries (steps, scalars) no state reads. An entry is checked when a state's bytes lie
    in it, or when it is small (`SMALL_ENTRY_BYTES`) in a file some state reads from."""
    used: dict[str, set[int]] = {}
    for p in plan_deepspeed(save_dir).params:
        for src in p.states.values():
            for f in src.fragments:
                numel = f.piece.numel  # a run of the flattened tensor holds its elements up to the padding
                if f.info.offset is not None:
                    numel = max(0, min(numel, math.prod(p.shape) - f.info.offset))
                begin = f.piece.byte_offset
                used.setdefault(f.piece.path, set()).update(
                    range(begin, begin + numel * TORCH_DTYPES[f.piece.dtype].itemsize))
    gaps = {}
    for path, taken in used.items():
        for e in storage_entries(path).values():
            mine = taken.intersection(range(e.start, e.end))
            if e.crc32 != 0 and (mine or e.end - e.start <= SMALL_ENTRY_BYTES) and len(mine) < e.end - e.start:
                gaps[(path, e)] = [o for o in range(e.start, e.end) if o not in mine]
    return gaps


def padding_byte(save_dir: Path) -> tuple[str, int]:
    """A byte of ZeRO's partition padding: in an entry that states read, read by none of them."""
    found = [(path, offsets[-1]) for (path, e), offsets in unloaded_bytes(save_dir).items()
             if len(offsets) < e.end - e.start]
    assert found, "the checkpoint has no partition padding to damage"
    return found[0]


def piece_of(save_dir: Path, name: str, state: str, file_part: str):
    """The last fragment's piece of `name`'s `state` that lies in a rank file whose name holds `file_part`."""
    plan = plan_deepspeed(save_dir)
    return [f.piece for f in plan.param(name).states[state].fragments if file_part in f.piece.path][-1]


def convert(capsys, save_dir: Path, out: Path) -> tuple[int, str]:
    code = main(["convert", "--input", str(save_dir), "--output", str(out), "--workers", "2", "--quiet"])
    return code, capsys.readouterr().err


def assert_refused(code: int, err: str, path: str, out: Path) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert path in lines[0] and "fails its CRC-32" in lines[0] and "the file is damaged" in lines[0], lines[0]
    assert not (out / INDEX_NAME).exists()
    assert not [p for p in out.iterdir() if p.name.endswith(MANIFEST_SUFFIX)]  # no --resume keeps these files


@pytest.mark.parametrize("spec", [TinySpec(stage=1), TinySpec(stage=2), TinySpec(stage=3)], ids=lambda s: s.name)
def test_a_flipped_bit_in_a_zero_partition_is_refused(spec, source, tmp_path, capsys):
    save_dir = source(spec)
    out = tmp_path / "out"
    piece = piece_of(save_dir, "emb.weight", "exp_avg", "optim_states")
    assert convert(capsys, save_dir, tmp_path / "control")[0] == 0  # negative control: the same copy, undamaged
    flip_bit(piece.path, piece.byte_offset + 4 * (piece.numel // 2) + 1)
    assert_refused(*convert(capsys, save_dir, out), piece.path, out)


@pytest.mark.parametrize("spec", [TinySpec(stage=1), TinySpec(stage=1, dtype="bf16", tie="tied")],
                         ids=lambda s: s.name)
def test_a_flipped_bit_in_a_model_states_tensor_is_refused(spec, source, tmp_path, capsys):
    """The frozen `proj.weight` lives in the model-states file (bf16 there under bf16 training: an upcast state)."""
    save_dir = source(spec)
    out = tmp_path / "out"
    piece = piece_of(save_dir, "proj.weight", "fp32", "model_states")
    flip_bit(piece.path, piece.byte_offset + 1)
    assert_refused(*convert(capsys, save_dir, out), piece.path, out)


def test_a_flipped_bit_in_bytes_no_state_reads_is_refused(source, tmp_path, capsys):
    """Bytes of a read entry that no state uses (here the tail of a rank's partition past the last parameter:
    ZeRO's alignment padding) are read and checked too, so the whole entry is covered."""
    save_dir = source(TinySpec(stage=2))
    path, offset = padding_byte(save_dir)
    flip_bit(path, offset)
    out = tmp_path / "out"
    assert_refused(*convert(capsys, save_dir, out), path, out)


def test_a_flipped_bit_in_a_rank_file_stops_a_zero_conversion_load_on_every_rank(source, ckpt_root):
    """The hook reading a DeepSpeed ZeRO-2 checkpoint directly on 2 ranks (no conversion): the ranks split the
    rank files' entries and check each against its zip CRC-32 before installing anything, so both raise and
    neither engine is touched."""
    spec = TinySpec(stage=2)
    save_dir = source(spec)
    piece = piece_of(save_dir, "emb.weight", "exp_avg", "optim_states")
    [clean] = ucp_load_errors([save_dir], spec, ckpt_root)  # negative control: the undamaged copy loads
    assert clean["errors"] == [None, None]
    flip_bit(piece.path, piece.byte_offset + 4 * (piece.numel // 2) + 1)
    [result] = ucp_load_errors([save_dir], spec, ckpt_root)
    for error in result["errors"]:
        assert error is not None and "fails its CRC-32" in error and Path(piece.path).name in error, error
    assert result["untouched_on"] == [True, True]


def test_a_flipped_bit_loaded_or_not_stops_a_zero3_load_from_zero2_files_on_every_rank(tiny_checkpoint, tmp_path,
                                                                                       ckpt_root):
    """ZeRO-2 files loaded into ZeRO-3 on 3 ranks (each rank reads parts of every partition entry; each entry is
    checked by its owner rank from the CRC-32s of the parts): a flipped bit in bytes a rank loads, or in the
    padding no rank loads, is refused on every rank, every engine untouched: keeping nothing for the install
    (check_keep_bytes=0), the check filled the fresh engine's masters and new optimizer states, and took both back;
    the undamaged copy, loaded last, loads (control)."""
    raw = tiny_checkpoint(TinySpec(stage=2))
    loaded, gap = (shutil.copytree(raw, tmp_path / name) for name in ("loaded", "gap"))
    piece = piece_of(loaded, "emb.weight", "exp_avg", "rank_0_mp_rank_00_optim")
    flip_bit(piece.path, piece.byte_offset + 4 * (piece.numel // 2) + 1)
    path, offset = padding_byte(gap)
    flip_bit(path, offset)
    results = ucp_load_errors([loaded, gap, raw], TinySpec(stage=3, world_size=3), ckpt_root, check_keep_bytes=0)
    for result, damaged in zip(results, (piece.path, path)):
        for error in result["errors"]:
            assert error is not None and "fails its CRC-32" in error and Path(damaged).name in error, error
        assert result["untouched_on"] == [True] * 3
    assert results[2]["errors"] == [None] * 3 and results[2]["untouched_on"] == [False] * 3


def test_a_flipped_bit_is_refused_when_a_deepspeed_checkpoint_is_read_directly(source):
    """`open_checkpoint` on a DeepSpeed folder (what inspect and export read through) checks every zip entry a
    tensor comes from against its CRC-32, the first time; tensors of undamaged entries still read."""
    import ucp
    from ucp.errors import CorruptCheckpointError

    save_dir = source(TinySpec(stage=2))
    piece = piece_of(save_dir, "emb.weight", "exp_avg", "optim_states")
    clean = ucp.open_checkpoint(save_dir).tensor("emb.weight", "exp_avg")  # negative control
    flip_bit(piece.path, piece.byte_offset + 4 * (piece.numel // 2) + 1)
    ckpt = ucp.open_checkpoint(save_dir)
    with pytest.raises(CorruptCheckpointError, match=f"{piece.path}: tensor data .* fails its CRC-32"):
        ckpt.tensor("emb.weight", "exp_avg")
    assert not torch.equal(ckpt.tensor("emb.weight", "exp_avg", verify=False), clean)  # the damage is real
    assert ckpt.tensor("proj.weight").shape == ckpt.shape("proj.weight")  # a model-states entry: intact
