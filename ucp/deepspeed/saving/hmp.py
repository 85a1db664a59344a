"""Saves from a heterogeneous (HMP) layout: which ranks write, and what the checkpoint records of the layout.

Under HMP (`ucp.deepspeed.engine.hmp_sync`) each rank runs its own engine over the slices its layout gives it,
and every replica holds the whole model (its TP ranks' boxes tile every tensor) with the same values:
the sync gives every replica the same step. So one replica's boxes are the checkpoint: the replica with
the most ranks (the first of those) writes, each of its ranks its own boxes, and a box its TP ranks all
hold whole (a norm) is written by one of them, chosen to balance bytes (`ucp.deepspeed.saving.plan.writers`).
The other replicas write nothing but take part in the save's commit. The patterns recorded are those of
the writing replica's holdings, i.e. what a homogeneous run at its TP size records; the names, shapes
and states are the model's whatever the layout, so the checkpoint loads at any layout.

Each rank's target is placed by the layout (`ucp.deepspeed.engine.placement`), as a load by that layout places it,
so a save snapshots exactly the rank's slices. The index's `"source"` records the layout (`"layout"`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ucp.deepspeed.engine.hmp_sync import EngineHmp
from ucp.deepspeed.engine.placement import place_by_layout
from ucp.deepspeed.engine.targets import Target
from ucp.deepspeed.saving.plan import Holding
from ucp.hmp.layout import Layout


def place_target(target: Target, hmp: EngineHmp, rank: int) -> Target:
    """`target` with each tensor the box of the full tensor the layout gives `rank`."""
    place_by_layout(target, hmp.layout, hmp.sync.table, rank)
    return target


def writing_replica(layout: Layout) -> int:
    """The replica whose ranks write the checkpoint: the one with the most ranks (the first of those)."""
    sizes = [len(r.ranks) for r in layout.replicas]
    return sizes.index(max(sizes))


def writing_holdings(every: Sequence[Holding], layout: Layout) -> list[Holding]:
    """Of every rank's holdings, those of the writing replica's ranks, each a box its rank holds whole, its outer
    piece the rank's place in the replica (stage-major, as a homogeneous run numbers its model-parallel ranks)."""
    ranks = layout.replicas[writing_replica(layout)].ranks
    return [dataclasses.replace(h, outer=ranks.index(h.rank), inner=0, whole=True)
            for h in every if h.rank in ranks]


def source_record(hmp: EngineHmp) -> dict[str, Any]:
    """What the index's `"source"` says of an HMP run: its layout, the replicas and the writing replica's TP."""
    layout = hmp.layout
    writer = layout.replicas[writing_replica(layout)]
    return {"dp": len(layout.replicas), "tp": max(s.tp for s in writer.stages), "pp": len(writer.stages),
            "layout": layout.to_json()}
