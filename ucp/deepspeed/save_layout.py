"""The engine side of a save's plan (`ucp.deepspeed.save_plan`): what this rank holds, what the engine declares.

`holdings` describes each tensor of the rank's target (`ucp.deepspeed.targets`, AutoTP boxes from
`ucp.deepspeed.autotp`, a pipeline stage's tensors, experts under global ids) as a `Holding`;
`pattern_inputs` says from which holdings and hints each pattern is recognized, as `ucp convert`
reads the engine's `save_checkpoint` (under AutoTP the TP pattern the engine's own
`universal_checkpoint_info` declares, read with the converter's reader), so a save and a conversion
see one layout. `refuse_unsupported` names the families the saver does not serve yet, in one line,
before anything is allocated.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ucp.converters.deepspeed_declared import affine_params, declared_layout
from ucp.deepspeed.autotp import UNIVERSAL_CHECKPOINT_INFO, tp_size
from ucp.deepspeed.moe_target import checkpoint_name, local_expert_tensors
from ucp.deepspeed.save_plan import Holding, full_box
from ucp.deepspeed.targets import Target
from ucp.errors import UnsupportedLayoutError
from ucp.patterns import Hints, Pattern
from ucp.plan.plan import BUFFER_STATE, WEIGHT_STATE

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

_INSTEAD = "; use engine.save_checkpoint and `ucp convert` instead"


def refuse_unsupported(engine: DeepSpeedEngine) -> None:
    """Raise `UnsupportedLayoutError` naming the parallelism family of `engine` that saves do not serve yet."""
    pipeline = getattr(engine, "pipeline_parallelism", False)
    if pipeline and engine.grid.get_slice_parallel_world_size() > 1:
        raise UnsupportedLayoutError("ucp.deepspeed.save does not save PipelineModule engines with tensor "
                                     "parallelism (a Megatron-style mpu) yet" + _INSTEAD)
    if getattr(engine, "has_moe_layers", False) and engine.zero_optimization_stage() == 0:
        raise UnsupportedLayoutError("ucp.deepspeed.save does not save MoE engines (expert parallelism) without ZeRO "
                                     "(ZeRO-0) yet" + _INSTEAD)
    if not pipeline and tp_size(engine) == 1 and getattr(engine, "mp_world_size", 1) > 1:
        raise UnsupportedLayoutError("ucp.deepspeed.save does not save engines with a Megatron-style mpu (tensor "
                                     "parallelism outside AutoTP) yet" + _INSTEAD)


def holdings(target: Target, rank: int, moments: Sequence[str]) -> list[Holding]:
    """One `Holding` per tensor of `target` on global rank `rank`, whose optimizer holds `moments`."""
    engine = target.engine
    outer = 0
    if tp_size(engine) > 1:
        from deepspeed.utils import groups

        outer = groups.get_tensor_model_parallel_rank()
    elif getattr(engine, "pipeline_parallelism", False):
        outer = engine.stage_id
    experts = local_expert_tensors(engine.module)
    # `ucp convert` numbers an expert's ZeRO fragments by the rank's data-parallel rank (its optimizer file),
    # not by its place in the expert-data-parallel group that partitions it.
    by_dp_rank = bool(experts)
    model_dtypes = {checkpoint_name(experts, n): _dtype(p) for n, p in engine.module.named_parameters()}
    model_dtypes.update({checkpoint_name(experts, n): _dtype(b) for n, b in engine.module.named_buffers()})
    out = []
    for t in target.tensors:
        group = t.dp_group if t.dp_group is not None and not by_dp_rank else target.dp_group
        inner = dist.get_rank(group=group) if dist.is_initialized() else 0
        if t.kind == "param":
            states = tuple((s, "float32") for s in (WEIGHT_STATE, *moments))
        elif t.kind == "frozen":
            states = ((WEIGHT_STATE, "float32"),)
        else:
            states = ((BUFFER_STATE, _dtype(t.view(BUFFER_STATE))),)
        out.append(Holding(t.name, rank, t.box if t.box is not None else full_box(t.shape), t.start, t.numel,
                           t.whole, outer, inner, t.kind, tuple(t.shape), states,
                           t.group if t.kind == "param" else None, model_dtypes.get(t.name, "float32")))
    return out


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def pattern_inputs(engine: DeepSpeedEngine, every: Iterable[Holding]) -> dict[str, tuple[list[Holding], Hints | None]]:
    """For each tensor, the holdings its pattern comes from and the hints that settle it, as `ucp convert`
    reads the engine's checkpoint: under AutoTP what the engine's affine map declares; in a pipeline, a
    trainable tensor on several stages (a tied module) is a Replicate of the stages' copies, and a frozen
    tensor or buffer is read from one layer file (the first stage's copy)."""
    held: dict[str, list[Holding]] = {}
    for h in every:
        held.setdefault(h.name, []).append(h)
    hints = declared_hints(engine, held)
    out = {}
    for name, hs in held.items():
        stages = sorted({h.outer for h in hs})
        if getattr(engine, "pipeline_parallelism", False) and hs[0].kind != "param":
            hs = [h for h in hs if h.outer == stages[0]]
        elif getattr(engine, "pipeline_parallelism", False) and len(stages) > 1:
            hints[name] = Hints(pattern=Pattern.REPLICATE)
        out[name] = (hs, hints[name])
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
