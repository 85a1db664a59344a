"""Boxes of a tensor and its cutting rule: the shared vocabulary of layouts, splits and reads.

Rank `r` of a group of `t` owns elements `[r*D//t, (r+1)*D//t)` of a dim of size `D`; split `i` of
`k` covers `[i*D//k, (i+1)*D//k)`. When `t` divides `k`, rank `r`'s elements are exactly splits
`[r*k/t, (r+1)*k/t)`, whatever `D`.
"""
from __future__ import annotations

Box = tuple[tuple[int, int], ...]  # per dimension, [start, stop)


def part_bounds(size: int, parts: int, index: int) -> tuple[int, int]:
    """Part `index` of `size` elements cut into `parts` near-equal contiguous parts."""
    return index * size // parts, (index + 1) * size // parts


def split_bounds(size: int, count: int) -> list[int]:
    """The `count + 1` boundaries of `size` elements cut into `count` splits."""
    return [i * size // count for i in range(count + 1)]
