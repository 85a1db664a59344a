"""Place an engine's tensors by an explicit parallel layout (`ucp.hmp.layout`), heterogeneous ones included.

DeepSpeed has no engine for heterogeneous model parallelism (HMP: TP sizes that differ between
data-parallel replicas). Under HMP each rank runs its own engine over the slices its layout gives
it (its data-parallel group is the rank alone; gradients are reduced across replicas by the
training code), and the module's parameters have the shapes of those slices. Given the layout and
the model's parameter table, `place_by_layout` tells the hook's loader which box of each full
tensor every local parameter is, so `ucp.deepspeed.load` reads exactly that box: the layout is
the single source of truth, as for `ucp.hmp.load_slices`.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from ucp.deepspeed.engine.hmp_sync import EngineHmp
from ucp.deepspeed.engine.targets import Target
from ucp.errors import UnsupportedLayoutError
from ucp.hmp.layout import Layout, LayoutError, ParamSpec
from ucp.storage.json_file import read_json_file

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def as_layout(layout: Layout | dict | str | os.PathLike) -> Layout:
    """A `Layout`, from itself, its JSON dict, or a path to its JSON file."""
    if isinstance(layout, Layout):
        return layout
    if isinstance(layout, dict):
        return Layout.from_json(layout)
    path = Path(layout)
    fields = read_json_file(path, LayoutError, "pass a path to the JSON that `Layout.to_json()` or `ucp plan --json` "
                                               "writes")
    try:
        return Layout.from_json(fields)
    except LayoutError as exc:
        raise LayoutError(f"{path}: {exc}") from None


def place_by_layout(target: Target, layout: Layout, table: Iterable[ParamSpec], rank: int) -> set[str]:
    """Give each tensor of `target` its box under `layout`; returns the names of the whole model.

    Refused before anything is loaded: a module tensor the table lacks, and a local tensor whose
    shape is not the box the layout gives this rank. The layout's `zero_stage` does not enter: how
    the optimizer states of a box are partitioned is the engine's ZeRO, over its own data-parallel
    group (under HMP a rank's group is itself, so it keeps all of them).
    """
    table = list(table)
    specs = {s.name: s for s in table}
    owned = layout.rank_slices(rank, table)
    held = {t.name for t in target.tensors}
    placed = []
    for t in target.tensors:
        spec = specs.get(t.name)
        if spec is None:
            raise UnsupportedLayoutError(f"{t.name}: the module has it but the model's parameter table does not; "
                                         "add it to `ucp_param_table` (name, full shape, TP dim, layer)")
        piece = owned.get(t.name)
        if piece is None or tuple(b - a for a, b in piece.box) != t.shape:
            where = f"box {piece.box}" if piece else "no slice of it"
            raise LayoutError(f"{t.name}: rank {rank}'s module holds shape {t.shape}, but the layout gives it "
                              f"{where}; build the module from the same layout")
        placed.append(t.as_box(spec.shape, piece.box))
    missing = sorted(set(owned) - held)
    if missing:
        raise LayoutError(f"{missing[0]}: the layout gives rank {rank} a slice of it ({len(missing)} such tensors), "
                          "but its module lacks it; build the module from the same layout")
    target.tensors = placed
    return set(specs)


def engine_hmp(engine: DeepSpeedEngine) -> EngineHmp | None:
    """What `ucp.deepspeed.initialize` attached for `"ucp": {"hmp": ...}`; None for any other engine."""
    hmp = getattr(engine, "ucp_hmp", None)
    return hmp if isinstance(hmp, EngineHmp) else None
