"""Split-major storage and split-driven loading (ucp.format.splits, ucp.format.slice_read, ucp.hmp).

Checkpoints are written through ucp's own writer (`ucp.convert.driver.write_atomic`, see
tests/support/atomic.py). Properties: split-major order round-trips; readers return the logical
tensor; under random layouts (HMP, uneven PP) every rank gets exactly its box, reading exactly its
share of bytes, in at most one read per tensor it touches, when its TP size divides the split
count; with other counts it still gets the right values. A negative control reads split-major
bytes as if row-major and must get them wrong.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from support.atomic import ADAM_STATES, write_checkpoint
from test_layout import layouts
from ucp.checkpoint import AtomicCheckpoint
from ucp.convert.split_policy import HF_DECODER_RULES, SplitPolicy, SplitRuleError
from ucp.errors import CheckpointMismatchError
from ucp.format.slice_read import plan_slice_read
from ucp.format.splits import from_split_major, join_splits, to_split_major
from ucp.hmp.layout import Layout, ParamSpec, Replica, Stage, split_bounds
from ucp.hmp.slice_load import load_slices

FAST = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=25, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

shapes = st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple)


def _rules(table: list[ParamSpec]) -> tuple:
    return tuple((re.escape(s.name) + "$", s.dim) for s in table)


def _box(t: torch.Tensor, box) -> torch.Tensor:
    return t[tuple(slice(a, b) for a, b in box)]


@FAST
@given(shapes, st.data(), st.integers(1, 9))
def test_split_major_round_trips_and_runs_of_splits_join(shape, data, count):
    t = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    dim = data.draw(st.integers(0, len(shape) - 1))
    stored = to_split_major(t, dim, count)
    assert torch.equal(from_split_major(stored, shape, dim, count), t)
    bounds = split_bounds(shape[dim], count)
    a = data.draw(st.integers(0, count - 1))
    b = data.draw(st.integers(a + 1, count))
    row = math.prod(shape) // shape[dim]
    run = stored.reshape(-1)[bounds[a] * row:bounds[b] * row]      # consecutive splits: one contiguous run
    assert torch.equal(join_splits(run, shape, dim, bounds[a:b + 1]), t.narrow(dim, bounds[a], bounds[b] - bounds[a]))


@st.composite
def models(draw, num_layers: int):
    table, tensors = [], {}
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    for i in range(draw(st.integers(1, 5))):
        shape = tuple(draw(st.lists(st.integers(1, 12), min_size=1, max_size=3)))
        dim = draw(st.one_of(st.none(), st.integers(0, len(shape) - 1)))
        table.append(ParamSpec(f"layers.{i}.w", shape, dim, draw(st.integers(-1, num_layers))))
        tensors[f"layers.{i}.w"] = {s: torch.randn(shape, generator=g) for s in ADAM_STATES}
    return table, tensors


@st.composite
def split_cases(draw):
    layout = draw(layouts(max_layers=4))
    table, tensors = draw(models(layout.num_layers))
    return layout, table, tensors


@SLOW
@given(split_cases())
def test_every_rank_reads_exactly_its_share(tmp_path_factory, case):
    layout, table, tensors = case
    ckpt = write_checkpoint(tmp_path_factory.mktemp("s") / "ckpt", tensors,
                            SplitPolicy(layout.split_count(), _rules(table)))
    reader = AtomicCheckpoint(ckpt)
    for name, states in tensors.items():
        for state, t in states.items():
            assert torch.equal(reader.tensor(name, state), t)
    specs = {s.name: s for s in table}
    for rank in range(layout.world_size):
        loaded = load_slices(layout, rank, ckpt, table, ADAM_STATES)
        over_read = False  # a ZeRO shard of a box that is not contiguous in storage: the box is read, then cut
        for name, piece in loaded.slices.items():
            for state in ADAM_STATES:
                expected = _box(tensors[name][state], piece.box)
                if layout.zero_stage and state != "fp32":
                    a, b = layout.zero_shard(rank, specs[name])
                    expected = expected.reshape(-1)[a:b]
                    # contiguous in storage only when cut (and stored split-major) along dim 0 at most
                    over_read |= b > a and specs[name].dim not in (None, 0)
                assert torch.equal(loaded.tensors[name][state], expected)
        if over_read:
            assert loaded.share_bytes <= loaded.bytes_read - loaded.bytes_checked_extra <= sum(
                _box(tensors[n]["fp32"], p.box).numel() * 4 * len(ADAM_STATES) for n, p in loaded.slices.items())
        else:
            assert loaded.bytes_read - loaded.bytes_checked_extra == loaded.share_bytes
        assert loaded.read_calls <= loaded.tensors_touched


@SLOW
@given(split_cases(), st.integers(1, 5))
def test_any_split_count_gives_the_right_values(tmp_path_factory, case, count):
    layout, table, tensors = case
    ckpt = write_checkpoint(tmp_path_factory.mktemp("s") / "ckpt", tensors, SplitPolicy(count, _rules(table)))
    for rank in range(layout.world_size):
        loaded = load_slices(layout, rank, ckpt, table, ("fp32",))
        for name, piece in loaded.slices.items():
            assert torch.equal(loaded.tensors[name]["fp32"], _box(tensors[name]["fp32"], piece.box))
        assert loaded.bytes_read >= loaded.share_bytes
        assert loaded.read_calls <= loaded.tensors_touched


def _hmp_case(tmp_path, splits: int):
    g = torch.Generator().manual_seed(0)
    table = [ParamSpec("embed.weight", (16, 6), 0, -1), ParamSpec("layers.0.fc1.weight", (8, 6), 0, 0),
             ParamSpec("layers.0.fc2.weight", (6, 8), 1, 0), ParamSpec("layers.0.norm.weight", (6,), None, 0),
             ParamSpec("layers.1.fc2.weight", (6, 8), 1, 1), ParamSpec("head.weight", (16, 6), 0, 2)]
    tensors = {s.name: {"fp32": torch.randn(s.shape, generator=g)} for s in table}
    policy = SplitPolicy(splits, _rules(table)) if splits > 1 else None
    return table, tensors, write_checkpoint(tmp_path / "ckpt", tensors, policy)


# replica 0: TP4 for layer 0, TP2 for layer 1; replica 1: TP1 for both
HMP = Layout(2, (Replica((Stage((0, 1), (0, 1, 2, 3)), Stage((1, 2), (4, 5))), 3), Replica((Stage((0, 2), (6,)),), 5)))


def test_split_loading_by_hand(tmp_path):
    table, tensors, ckpt = _hmp_case(tmp_path, 4)
    index = json.loads((ckpt / "ucp_index.json").read_text())
    assert index["splits"] == {"global_split": 4}
    assert index["params"]["layers.0.fc2.weight"]["states"]["fp32"]["splits"] == {"dim": 1, "count": 4}
    assert "splits" not in index["params"]["layers.0.norm.weight"]["states"]["fp32"]
    # Rank 1 (TP4, position 1) reads split 1 of each of its three partitioned tensors and the whole norm.
    loaded = load_slices(HMP, 1, ckpt, table)
    assert loaded.slices["layers.0.fc2.weight"].box == ((0, 6), (2, 4))
    assert loaded.slices["layers.0.fc2.weight"].splits == (1, 2)
    assert loaded.bytes_read - loaded.bytes_checked_extra == loaded.share_bytes == 4 * (4 * 6 + 2 * 6 + 6 * 2 + 6)
    assert loaded.read_calls == 4
    # The TP1 replica holds everything; all six tensors sit back to back in one file: one read.
    whole = load_slices(HMP, 6, ckpt, table)
    assert whole.read_calls == 1 and whole.bytes_read == sum(4 * s.numel for s in table)


def test_row_parallel_slices_from_a_row_major_checkpoint_are_still_right(tmp_path):
    """Without splits, a dim-1 slice is not one byte range: the tensor is read whole and cut."""
    table, tensors, ckpt = _hmp_case(tmp_path, 1)
    loaded = load_slices(HMP, 5, ckpt, table)
    assert torch.equal(loaded.tensors["layers.1.fc2.weight"]["fp32"], tensors["layers.1.fc2.weight"]["fp32"][:, 4:])
    assert loaded.bytes_read - loaded.bytes_checked_extra == 4 * (6 * 8 + 8 * 6)  # fc2 whole, half the head's rows
    assert loaded.share_bytes == 4 * (6 * 4 + 8 * 6)


def test_negative_control_row_major_reading_of_split_major_bytes_is_wrong(tmp_path):
    table, tensors, ckpt = _hmp_case(tmp_path, 4)
    entry = json.loads((ckpt / "ucp_index.json").read_text())["params"]["layers.0.fc2.weight"]["states"]["fp32"]
    stored = AtomicCheckpoint(ckpt).index.params["layers.0.fc2.weight"].states["fp32"]
    blind = dataclasses.replace(stored, splits=None)
    box = ((0, 6), (2, 4))
    good, bad = (plan_slice_read(("w", "fp32"), s, box) for s in (stored, blind))
    assert good.range != bad.range or good.narrow != bad.narrow
    reader = AtomicCheckpoint(ckpt)
    raw = torch.empty(entry["offsets"][1] - entry["offsets"][0], dtype=torch.uint8)
    with open(ckpt / entry["file"], "rb") as f:
        f.seek(entry["offsets"][0])
        f.readinto(raw.numpy())
    as_row_major = raw.view(torch.float32).reshape(6, 8)[:, 2:4]
    assert torch.equal(reader.tensor("layers.0.fc2.weight")[:, 2:4], tensors["layers.0.fc2.weight"]["fp32"][:, 2:4])
    assert not torch.equal(as_row_major, tensors["layers.0.fc2.weight"]["fp32"][:, 2:4])


def test_split_files_open_with_stock_safetensors_and_verify(tmp_path):
    table, tensors, ckpt = _hmp_case(tmp_path, 4)
    reader = AtomicCheckpoint(ckpt)
    assert reader.verify() == []
    entry = reader.index.params["layers.0.fc2.weight"].states["fp32"]
    with safe_open(str(ckpt / entry.file), "pt") as f:
        stored = f.get_tensor(entry.key)
    assert stored.shape == (48,)   # flat: split-major bytes are never taken for the logical [6, 8]
    assert torch.equal(from_split_major(stored, (6, 8), 1, 4), tensors["layers.0.fc2.weight"]["fp32"])
    with safe_open(str(ckpt / entry.file), "pt") as f:
        assert f.get_tensor("layers.0.fc1.weight:fp32").shape == (8, 6)   # dim-0 splits are plain row-major


def test_whole_reads_are_checksummed(tmp_path):
    table, tensors, ckpt = _hmp_case(tmp_path, 4)
    entry = AtomicCheckpoint(ckpt).index.params["layers.0.norm.weight"].states["fp32"]
    with open(ckpt / entry.file, "r+b") as f:
        f.seek(entry.begin)
        f.write(b"\xff\xff\xff\xff")
    from ucp.errors import CorruptCheckpointError
    with pytest.raises(CorruptCheckpointError, match="layers.0.norm.weight:fp32 fails its checksum"):
        load_slices(HMP, 6, ckpt, table)


def test_model_mismatch_is_a_named_error(tmp_path):
    table, tensors, ckpt = _hmp_case(tmp_path, 2)
    with pytest.raises(CheckpointMismatchError, match="has no parameter 'extra'"):
        load_slices(HMP, 0, ckpt, table + [ParamSpec("extra", (2,), None, 0)])
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint holds shape \(16, 6\), the model \(16, 7\) "
                       rf"\({re.escape(str(ckpt))}\); was it saved from another model"):
        load_slices(HMP, 0, ckpt, [ParamSpec("embed.weight", (16, 7), 0, -1)])
    with pytest.raises(CheckpointMismatchError, match="no state 'exp_avg'"):
        load_slices(HMP, 0, ckpt, table, ("fp32", "exp_avg"))


def test_split_policy_rules():
    policy = SplitPolicy(8)
    assert policy.rules == HF_DECODER_RULES
    assert policy.dim_for("model.layers.3.self_attn.k_proj.weight", (1024, 4096)) == 0
    assert policy.dim_for("model.layers.3.self_attn.q_proj.bias", (4096,)) == 0
    assert policy.dim_for("model.layers.3.mlp.down_proj.weight", (4096, 11008)) == 1
    assert policy.dim_for("lm_head.weight", (32000, 4096)) == 0
    assert policy.dim_for("model.layers.3.input_layernorm.weight", (4096,)) is None
    with pytest.raises(SplitRuleError, match="names dim 1, the tensor has shape"):
        SplitPolicy(2, (("w", 1),)).dim_for("w", (3,))
    with pytest.raises(SplitRuleError, match="at least 1"):
        SplitPolicy(0)
    with pytest.raises(SplitRuleError, match="not a regular expression"):
        SplitPolicy(2, (("(", 0),))
