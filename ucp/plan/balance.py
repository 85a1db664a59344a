"""Numel-balanced bins, longest-processing-time first: the map step's split of a plan into data files."""
from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from ucp.plan.plan import ConversionPlan, ParamPlan

# A data file grows to about this size before conversion opens another, so output stays a few
# large files whatever the worker count.
TARGET_FILE_BYTES = 4 << 30


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


def plan_bins(plan: ConversionPlan, workers: int) -> list[list[ParamPlan]]:
    total = sum(p.nbytes for p in plan.params)
    n_files = max(1, workers) * max(1, math.ceil(total / (TARGET_FILE_BYTES * max(1, workers))))
    bins = lpt_bins([p.nbytes for p in plan.params], min(n_files, len(plan.params)))
    return [[plan.params[i] for i in members] for members in bins]
