"""The engine side of a save's plan (`ucp.deepspeed.save_plan`): what this rank holds, what the engine declares.

`holdings` describes each tensor of the rank's target (`ucp.deepspeed.targets`, AutoTP boxes from
`ucp.deepspeed.autotp`) as a `Holding`; `declared_hints` gives the TP pattern the engine's own
`universal_checkpoint_info` declares, read with the converter's reader, so a save and `ucp convert` of the
engine's `save_checkpoint` see one layout. `refuse_unsupported` names the families the saver does not
serve yet, in one line, before anything is allocated.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch.distributed as dist

from ucp.converters.deepspeed_declared import affine_params, declared_layout
from ucp.deepspeed.autotp import UNIVERSAL_CHECKPOINT_INFO, tp_size
from ucp.deepspeed.save_plan import Holding, full_box
from ucp.deepspeed.targets import Target
from ucp.errors import UnsupportedLayoutError
from ucp.patterns import Hints, Pattern

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

_INSTEAD = "; use engine.save_checkpoint and `ucp convert` instead"


def refuse_unsupported(engine: DeepSpeedEngine) -> None:
    """Raise `UnsupportedLayoutError` naming the parallelism family of `engine` that saves do not serve yet."""
    if getattr(engine, "pipeline_parallelism", False):
        raise UnsupportedLayoutError("ucp.deepspeed.save does not save PipelineModule (pipeline-parallel) engines "
                                     "yet" + _INSTEAD)
    if getattr(engine, "has_moe_layers", False):
        raise UnsupportedLayoutError("ucp.deepspeed.save does not save MoE (expert-parallel) engines yet" + _INSTEAD)
    if tp_size(engine) == 1 and getattr(engine, "mp_world_size", 1) > 1:
        raise UnsupportedLayoutError("ucp.deepspeed.save does not save engines with a Megatron-style mpu (tensor "
                                     "parallelism outside AutoTP) yet" + _INSTEAD)


def holdings(target: Target, rank: int) -> list[Holding]:
    """One `Holding` per tensor of `target` on global rank `rank`."""
    outer = 0
    if tp_size(target.engine) > 1:
        from deepspeed.utils import groups

        outer = groups.get_tensor_model_parallel_rank()
    out = []
    for t in target.tensors:
        group = t.dp_group if t.dp_group is not None else target.dp_group
        inner = dist.get_rank(group=group) if dist.is_initialized() else 0
        out.append(Holding(t.name, rank, t.box if t.box is not None else full_box(t.shape), t.start, t.numel,
                           t.whole, outer, inner))
    return out


def declared_hints(engine: DeepSpeedEngine, names: Iterable[str]) -> dict[str, Hints | None]:
    """What an AutoTP engine declares of each name's TP layout (a tensor its map leaves out, e.g. a buffer, is
    replicated on every TP rank, as the converter finds it); None for every name without tensor parallelism."""
    if tp_size(engine) == 1:
        return dict.fromkeys(names)
    entries = affine_params(getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None),
                            "the engine's AutoTP universal_checkpoint_info")
    out: dict[str, Hints | None] = {}
    for name in names:
        declared = declared_layout(name, entries)
        out[name] = declared[1] if declared is not None else Hints(pattern=Pattern.REPLICATE)
    return out
