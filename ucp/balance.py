"""Numel-balanced bins: longest-processing-time first."""
from __future__ import annotations

import heapq
from collections.abc import Sequence


def lpt_bins(weights: Sequence[int], bins: int) -> list[list[int]]:
    """Indices of `weights` split into `bins` lists whose weight sums are balanced (LPT heuristic).

    Each list keeps its indices in ascending order, so a bin visits its items in source order and
    reads each rank file front to back. Empty bins are dropped.
    """
    if bins < 1:
        raise ValueError("bins must be at least 1")
    heap = [(0, b) for b in range(bins)]
    members: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        load, b = heapq.heappop(heap)
        members[b].append(i)
        heapq.heappush(heap, (load + weights[i], b))
    return [sorted(m) for m in members if m]
