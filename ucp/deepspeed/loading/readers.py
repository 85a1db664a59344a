"""Which rank reads what when a data-parallel group loads a checkpoint: pure planning, no I/O.

A rank *wants* a contiguous run of elements of a stored tensor: its ZeRO partition of a
parameter (a slice no other rank of its group wants), or the whole tensor (replicated state:
ZeRO-0 models, frozen parameters, buffers). With redundancy bypassing, each slice is read by the
rank that wants it, and each replicated tensor is read by one rank of the group, chosen to
balance bytes, then broadcast. Without it, every rank reads whole every tensor it touches, as
DeepSpeed's own `load_universal` does.
"""
from __future__ import annotations

import heapq
from collections.abc import Sequence


def assign_readers(sizes: dict, ranks: Sequence[int], preload: dict[int, int] | None = None) -> dict:
    """Each key of `sizes` (bytes) to one of `ranks`, largest first onto the least loaded rank.

    `preload` gives bytes a rank already reads for itself (its own slices), so replicated reads go
    to the ranks with the least to do overall. Ties break by rank order, so every rank of the group
    computes the same assignment without talking.
    """
    heap = [((preload or {}).get(r, 0), i, r) for i, r in enumerate(ranks)]
    heapq.heapify(heap)
    owner = {}
    for key in sorted(sizes, key=lambda k: (-sizes[k], k)):
        load, i, r = heapq.heappop(heap)
        owner[key] = r
        heapq.heappush(heap, (load + sizes[key], i, r))
    return owner
