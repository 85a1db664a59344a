"""The pure plan of a save from a 3D engine: runs of a box in the full tensor, who writes what, patterns."""
from __future__ import annotations

import itertools

import pytest
import torch

from ucp.deepspeed.saving.plan import Holding, box_runs, full_box, pattern_of, writers
from ucp.patterns import Hints, Pattern


def _elements(shape, box, start, numel) -> list[int]:
    """The flat indices in the full tensor of elements [start, start + numel) of `box`, flattened: by indexing."""
    index = torch.arange(torch.Size(shape).numel()).reshape(shape)
    return index[tuple(slice(lo, hi) for lo, hi in box)].reshape(-1)[start:start + numel].tolist()


def _from_runs(runs) -> list[int]:
    return [first + i for first, _, n in runs for i in range(n)]


@pytest.mark.parametrize("shape,box", [
    ((7, 5), ((0, 4), (0, 5))),           # column-parallel: whole rows, one run
    ((7, 5), ((4, 7), (0, 5))),
    ((7, 5), ((0, 7), (2, 5))),           # row-parallel: a run per row
    ((3, 4, 5), ((1, 3), (1, 3), (0, 5))),
    ((3, 4, 5), ((0, 3), (0, 4), (1, 4))),
    ((6,), ((2, 5),)),
    ((6,), ((0, 6),)),
])
def test_box_runs_are_the_elements_indexing_picks(shape, box):
    size = torch.Size([hi - lo for lo, hi in box]).numel()
    for start, numel in itertools.chain([(0, size)], [(s, n) for s in range(size) for n in (1, 3, size - s)]):
        numel = min(numel, size - start)
        runs = box_runs(shape, box, start, numel)
        assert _from_runs(runs) == _elements(shape, box, start, numel), (start, numel)
        assert [offset for _, offset, _ in runs] == [sum(n for *_, n in runs[:i]) for i in range(len(runs))]



def test_a_row_parallel_box_is_not_one_run():
    """Negative control: the box of a row-parallel shard read as one run from its first element picks others."""
    shape, box = (7, 5), ((0, 7), (2, 5))
    assert _from_runs([(2, 0, 21)]) != _elements(shape, box, 0, 21)
    assert len(box_runs(shape, box, 0, 21)) == 7


def _tp_dp(shape, boxes, dp, whole=False) -> list[Holding]:
    """Holdings of a tensor: TP rank t holds boxes[t], partitioned over dp ranks (rank = t * dp + d), or whole."""
    out = []
    for t, box in enumerate(boxes):
        size = torch.Size([hi - lo for lo, hi in box]).numel()
        for d in range(dp):
            lo, hi = (0, size) if whole else (d * size // dp, (d + 1) * size // dp)
            out.append(Holding("w", t * dp + d, box, lo, hi - lo, whole, t, d))
    return out


def _written(holdings, plan, shape) -> list[int]:
    elements = []
    for h in holdings:
        if ("w", h.rank) in plan:
            elements += _from_runs(box_runs(shape, h.box, h.start, h.numel))
    return sorted(elements)


@pytest.mark.parametrize("whole", [False, True])
@pytest.mark.parametrize("split", [None, 0, 1])
def test_every_element_is_written_once(split, whole):
    shape = (5, 6)
    if split is None:
        boxes = [full_box(shape)] * 2      # replicated over 2 TP ranks
    elif split == 0:
        boxes = [((0, 3), (0, 6)), ((3, 5), (0, 6))]
    else:
        boxes = [((0, 5), (0, 3)), ((0, 5), (3, 6))]
    held = _tp_dp(shape, boxes, 2, whole)
    plan = writers(held, {"w": 12})
    assert _written(held, plan, shape) == list(range(30))
    if split is None and not whole:
        assert {r for _, r in plan} == {0, 1}  # the copy of TP rank 0 writes, each DP rank its run
    if split is None or whole:  # several copies of a box
        # Negative control: every holder writing would write the copies twice.
        everyone = {("w", h.rank) for h in held}
        assert _written(held, everyone, shape) != list(range(30))


def test_whole_boxes_spread_over_their_holders():
    held = [Holding(f"t{i}", r, full_box((8,)), 0, 8, True, 0, r) for i in range(4) for r in range(4)]
    plan = writers(held, {f"t{i}": 4 for i in range(4)})
    assert sorted(r for _, r in plan) == [0, 1, 2, 3]


def test_the_boxes_of_a_fused_shard_held_whole_are_written_by_one_of_its_holders():
    """A fused TP shard (a block of rows of each of 3 sub-parameters: 3 boxes) held whole by 2 DP ranks, under
    ZeRO-0: a writer writes every box of the tensor it holds, so one rank takes all 3 boxes and each element is
    written once. Negative control: both holders writers (what choosing per box, 2 rows to one rank and 1 + 1 to
    the other, made of it) write every element twice."""
    shape = (8, 4)
    boxes = [((0, 2), (0, 4)), ((4, 5), (0, 4)), ((6, 7), (0, 4))]
    held = [Holding("w", r, box, 0, (box[0][1] - box[0][0]) * 4, True, 0, r, shape=shape)
            for box in boxes for r in (0, 2)]
    plan = writers(held, {"w": 12})
    once = sorted(e for box in boxes for e in range(box[0][0] * 4, box[0][1] * 4))
    assert len(plan) == 1 and _written(held, plan, shape) == once
    assert _written(held, {("w", 0), ("w", 2)}, shape) == sorted(once * 2)


def test_the_pattern_is_the_converters_nesting():
    shape = (5, 6)
    row = _tp_dp(shape, [((0, 5), (0, 3)), ((0, 5), (3, 6))], 2)
    spec = pattern_of("w", shape, row, Hints(pattern=Pattern.SHARD_H))
    assert spec.pattern is Pattern.SHARD_HY and spec.dim == 1 and spec.inner.pattern is Pattern.SHARD_V
    replicated = pattern_of("w", shape, _tp_dp(shape, [full_box(shape)] * 2, 2), Hints(pattern=Pattern.REPLICATE))
    assert replicated.pattern is Pattern.REPLICATE and replicated.inner is not None
    whole = pattern_of("w", shape, _tp_dp(shape, [((0, 3), (0, 6)), ((3, 5), (0, 6))], 2, whole=True),
                       Hints(pattern=Pattern.SHARD_V))
    assert whole.pattern is Pattern.SHARD_V and whole.inner is None
    plain = pattern_of("w", shape, _tp_dp(shape, [full_box(shape)], 2), None)
    assert plain.pattern is Pattern.SHARD_V and plain.flat
