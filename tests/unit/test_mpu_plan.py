"""The boxes a Megatron-style TP shard fills in the full tensor (`ucp.deepspeed.saving.mpu`), against shards cut from a
full tensor the way tests/support/train_megatron.py cuts them."""
from __future__ import annotations

import math

import pytest
import torch

from ucp.deepspeed.engine.targets import TargetTensor
from ucp.deepspeed.loading.source import piece_runs
from ucp.deepspeed.saving.mpu import first_stage_only, pieces, place_shards, tp_layout
from ucp.deepspeed.saving.plan import Holding, Shard, box_runs
from ucp.errors import UnsupportedLayoutError
from ucp.patterns import Hints, Pattern

FUSED = {"parameter_with_2_sub_params_cat_dim_0": [r"\d+.mlp.dense_h_to_4h.weight"],
         "parameter_with_row_parallelism_patterns": [r"\d+.mlp.dense_4h_to_h.weight"],
         "vocabulary_parameter_patterns": [r"embed.weight"], "original_vocab_size": 7,
         "parameter_to_average_patterns": [r"\d+.mlp.input_scale"]}


def _cut(full: torch.Tensor, name: str, tp: int) -> list[torch.Tensor]:
    """Each TP rank's shard of `full`, as the model cuts it."""
    if name.endswith("dense_h_to_4h.weight"):  # gate | up, each split over TP, a rank's halves one after the other
        gate, up = full.chunk(2, dim=0)
        return [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
    if name.endswith("dense_4h_to_h.weight"):
        return list(full.chunk(tp, dim=1))
    if name == "embed.weight":  # padded to a multiple of tp rows, split by rows
        padded = torch.cat([full, torch.full((-(-full.shape[0] // tp) * tp - full.shape[0], full.shape[1]), -1.0)])
        return list(padded.chunk(tp))
    return [full.clone() for _ in range(tp)]


def _holdings(name: str, shards: list[torch.Tensor], dp: int) -> list[Holding]:
    """Each TP rank's shard, partitioned over `dp` ranks as ZeRO-1 partitions a flat shard."""
    out = []
    for t, shard in enumerate(shards):
        n = shard.numel()
        for d in range(dp):
            lo, hi = d * n // dp, (d + 1) * n // dp
            out.append(Holding(name, t * dp + d, tuple((0, s) for s in shard.shape), lo, hi - lo, False, t, d,
                               shape=tuple(shard.shape), shard=Shard(t, 0, tuple(shard.shape), lo, hi - lo)))
    return out


@pytest.mark.parametrize("dp", [1, 3])
@pytest.mark.parametrize("name,shape", [("1.mlp.dense_h_to_4h.weight", (12, 3)), ("1.mlp.dense_4h_to_h.weight", (3, 6)),
                                        ("embed.weight", (7, 2)), ("1.mlp.input_scale", (3,))])
def test_every_piece_holds_the_elements_of_its_box(name, shape, dp):
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    shards = _cut(full, name, 2)
    placed = place_shards(_holdings(name, shards, dp), FUSED)
    written = torch.full((full.numel(),), float("nan"))
    for h in placed:
        assert h.shape == shape
        live = shards[h.shard.tp_rank].reshape(-1)[h.shard.start:h.shard.start + h.shard.numel]
        for first, offset, numel in box_runs(h.shape, h.box, h.start, h.numel):
            elements = live[h.view_offset + offset:h.view_offset + offset + numel]
            if h.shard.tp_rank == 0 or not name.endswith("input_scale"):
                written[first:first + numel] = elements
            assert torch.equal(elements, full.reshape(-1)[first:first + numel])
    assert torch.equal(written, full.reshape(-1))  # every element, the padding in none


def test_a_fused_shard_is_not_one_block_of_rows():
    """Negative control: the gate/up shard read as one block of rows (plain Shard-V) puts up rows in gate's place."""
    name, shape = "1.mlp.dense_h_to_4h.weight", (12, 3)
    full = torch.arange(36, dtype=torch.float32).reshape(shape)
    shards = _cut(full, name, 2)
    assert tp_layout(name, [s.shape for s in shards], FUSED, True)[1].pattern is Pattern.SHARD_NC
    assert not torch.equal(shards[0], full[:6])
    assert len(place_shards(_holdings(name, shards, 1), FUSED)) == 4  # 2 ranks x (gate, up)
    assert len(place_shards(_holdings(name, shards, 1), {})) == 2     # undeclared: one block each
    assert tp_layout(name, [s.shape for s in shards], {}, True)[1] == Hints(pattern=Pattern.REPLICATE)


def _box_values(full: torch.Tensor, t: TargetTensor) -> torch.Tensor:
    """What a load reads for `t` from the checkpoint's `full` tensor: its run of its box, or of its pieces one after
    another (`loading.source.piece_runs`)."""
    if t.pieces is None:
        box = t.box or tuple((0, n) for n in full.shape)
        flat = full[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1)
        return flat[t.start:t.start + t.numel]
    return torch.cat([full[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1)[a:b]
                      for _, box, (a, b) in piece_runs(t, (t.start, t.start + t.numel))])


@pytest.mark.parametrize("dp", [1, 3])
@pytest.mark.parametrize("name,shape", [("1.mlp.dense_h_to_4h.weight", (12, 3)), ("1.mlp.dense_4h_to_h.weight", (3, 6)),
                                        ("embed.weight", (7, 2)), ("1.mlp.input_scale", (3,))])
def test_a_load_gives_each_rank_its_shards_elements(name, shape, dp):
    """The inverse of the save's plan (`ucp.deepspeed.loading.mpu`): each TP rank's ZeRO run of its shard, placed by
    `pieces`, reads exactly the shard's elements from the full tensor (padding rows: none; "to average": the whole
    tensor, the saved mean)."""
    full = torch.arange(math.prod(shape), dtype=torch.float32).reshape(shape)
    shards = _cut(full, name, 2)
    shapes = [tuple(s.shape) for s in shards]
    logical, hints = tp_layout(name, shapes, FUSED, True)
    assert logical == shape
    for rank, shard in enumerate(shards):
        live = shard.reshape(-1)
        for d in range(dp):
            lo, hi = d * live.numel() // dp, (d + 1) * live.numel() // dp
            held = TargetTensor(name, "param", shapes[rank], lo, hi - lo, False, lambda state: torch.empty(0))
            placed = held.as_pieces(logical, pieces(name, logical, hints, shapes, rank))
            assert torch.equal(_box_values(full, placed), live[lo:lo + placed.numel])
            assert placed.numel == hi - lo or name == "embed.weight"  # padding rows are in no box
            other = held.as_pieces(logical, pieces(name, logical, hints, shapes, 1 - rank))
            if hints.pattern is not Pattern.PARTIAL and placed.numel and other.numel:  # negative control
                assert not torch.equal(_box_values(full, other), live[lo:lo + other.numel])


def test_pieces_that_do_not_tile_the_shard_are_refused():
    held = TargetTensor("w", "param", (4, 2), 0, 8, False, lambda state: torch.empty(0))
    with pytest.raises(UnsupportedLayoutError, match="not its pieces"):
        held.as_pieces((8, 2), [(0, ((0, 2), (0, 2))), (6, ((4, 6), (0, 2)))])


def test_a_tensor_on_several_stages_is_held_as_its_first_stage_holds_it():
    """A tied module's copies on stages 0 and 1 (TP 2, ZeRO-0: each rank holds its shard whole): only stage 0's
    ranks keep their holdings, as `ucp convert` reads the tensor from the first stage that holds it; a tensor on
    one stage keeps every holding. Negative control: without the filter, stage 1's copies would be written."""
    def held(name: str, rank: int, stage: int, tp_rank: int) -> Holding:
        return Holding(name, rank, ((0, 4), (0, 2)), 0, 8, True, stage * 2 + tp_rank, 0,
                       shape=(4, 2), shard=Shard(tp_rank, stage, (4, 2), 0, 8))

    tied = [held("tied.weight", r, r // 2, r % 2) for r in range(4)]
    later = [held("2.weight", r, 1, r % 2) for r in (2, 3)]
    kept = first_stage_only([*tied, *later])
    assert kept == [*tied[:2], *later]
    assert {h.rank for h in place_shards(tied, None)} == {0, 1, 2, 3}  # control: every stage's copy otherwise
