"""The engine side of a save's plan (`ucp.deepspeed.saving.plan`): what this rank holds, what the engine declares.

`holdings` describes each tensor of the rank's target (`ucp.deepspeed.engine.targets`, AutoTP boxes from
`ucp.deepspeed.engine.autotp`, a pipeline stage's tensors, experts under global ids) as a `Holding`;
`pattern_inputs` says from which holdings and hints each pattern is recognized, as `ucp convert`
reads the engine's `save_checkpoint` (under AutoTP the TP pattern the engine's own
`universal_checkpoint_info` declares, read with the converter's reader), so a save and a conversion
see one layout. Under a Megatron-style `mpu` (in a `PipelineModule` or not) a holding is the rank's TP shard
(`Shard`), which `placed` cuts into the boxes it fills (`ucp.deepspeed.saving.mpu`), and a tensor the model
declares "to average" is snapshotted as the mean of its TP copies (`average_partials`), the value `ucp
convert` records. `refuse_unsupported` names the families the saver does not serve yet, in one line,
before anything is allocated.
"""
from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ucp.converters.deepspeed.declared import affine_params, declared_layout
from ucp.deepspeed.engine.autotp import UNIVERSAL_CHECKPOINT_INFO, tp_size
from ucp.deepspeed.engine.hmp_sync import RankAloneMpu
from ucp.deepspeed.engine.moe import checkpoint_name, local_expert_tensors
from ucp.deepspeed.engine.placement import engine_hmp
from ucp.deepspeed.engine.targets import Target, TargetTensor
from ucp.deepspeed.saving.hmp import writing_holdings
from ucp.deepspeed.saving.mpu import first_stage_only, place_shards, tp_layout
from ucp.deepspeed.saving.plan import Holding, Shard, full_box
from ucp.errors import UnsupportedLayoutError
from ucp.patterns import Hints, Pattern, PatternSpec
from ucp.plan.plan import BUFFER_STATE, WEIGHT_STATE
from ucp.plan.primitives import union

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

_INSTEAD = "; use engine.save_checkpoint and `ucp convert` instead"


def refuse_unsupported(engine: DeepSpeedEngine) -> None:
    """Raise `UnsupportedLayoutError` naming the parallelism family of `engine` that saves do not serve yet."""
    if engine_hmp(engine) is not None:  # its mpu is the HMP one: `install_sync` refused what it does not serve
        return
    if isinstance(getattr(engine, "mpu", None), RankAloneMpu):
        raise UnsupportedLayoutError("ucp.deepspeed.save: this engine has an HMP rank's mpu (RankAloneMpu) but no "
                                     "gradient sync, so its replicas train apart and hold no one model; add "
                                     "\"layout\" and \"hmp\" to the \"ucp\" config section "
                                     "(ucp.deepspeed.engine.hmp_sync)")
    pipeline = getattr(engine, "pipeline_parallelism", False)
    stage = engine.zero_optimization_stage()
    fp32 = not (engine.bfloat16_enabled() or engine.fp16_enabled())
    if not pipeline and mpu_tp_size(engine) > 1 and stage != 1:
        raise UnsupportedLayoutError("ucp.deepspeed.save saves engines with a Megatron-style mpu (tensor parallelism "
                                     "outside AutoTP) without a PipelineModule under ZeRO stage 1 only; set "
                                     "\"zero_optimization\": {\"stage\": 1}" + _INSTEAD)
    if pipeline and mpu_tp_size(engine) > 1 and not (stage == 1 or (stage == 0 and fp32)):
        raise UnsupportedLayoutError("ucp.deepspeed.save saves PipelineModule engines with tensor parallelism (a "
                                     "Megatron-style mpu) under ZeRO stage 1, or stage 0 in fp32, the checkpoints "
                                     "`ucp convert` reads of them; set \"zero_optimization\": {\"stage\": 1}")
    if not pipeline and tp_size(engine) == 1 and mpu_tp_size(engine) == 1 and getattr(engine, "mp_world_size", 1) > 1:
        raise UnsupportedLayoutError("ucp.deepspeed.save does not save engines whose mpu has model parallelism but "
                                     "no get_tensor_model_parallel_world_size (not Megatron-style tensor "
                                     "parallelism)" + _INSTEAD)


def _mpu(engine: DeepSpeedEngine):
    """A Megatron-style mpu (one with `get_tensor_model_parallel_world_size`, as Megatron's have) the user gave an
    engine outside a pipeline; not AutoTP's, which DeepSpeed sets itself, nor HMP's `RankAloneMpu`, whose model
    parallelism is a replica's own (`ucp.deepspeed.engine.hmp_sync`)."""
    if getattr(engine, "pipeline_parallelism", False) or tp_size(engine) > 1:
        return None
    mpu = getattr(engine, "mpu", None)
    return mpu if is_megatron_mpu(mpu) else None


def is_megatron_mpu(mpu: object) -> bool:
    """Whether `mpu` is a Megatron-style mpu whose TP shards the saver and loader place: one with
    `get_tensor_model_parallel_world_size`, but not HMP's `RankAloneMpu`. That one has the method too (DeepSpeed
    asks it), but its TP group is one replica's: an HMP engine's tensors are placed by its layout, and a save
    records the writing replica's boxes (`ucp.deepspeed.saving.hmp`), not the shards of a Megatron checkpoint."""
    return hasattr(mpu, "get_tensor_model_parallel_world_size") and not isinstance(mpu, RankAloneMpu)


def has_mpu(engine: DeepSpeedEngine) -> bool:
    """Whether `engine` was given a Megatron-style mpu outside a pipeline (at any TP size, 1 included)."""
    return _mpu(engine) is not None


def mpu_tp_size(engine: DeepSpeedEngine) -> int:
    """The TP degree of an engine's Megatron-style mpu (a `PipelineModule` grid's slice, or the `mpu` given to
    `deepspeed.initialize`); 1 without one."""
    if getattr(engine, "pipeline_parallelism", False):
        return int(engine.grid.get_slice_parallel_world_size())
    mpu = _mpu(engine)
    if mpu is None:
        return 1
    return int(mpu.get_tensor_model_parallel_world_size())


def mpu_tp_rank(engine: DeepSpeedEngine) -> int:
    """This rank's place in its Megatron-style TP group; 0 without one."""
    if mpu_tp_size(engine) == 1:
        return 0
    if getattr(engine, "pipeline_parallelism", False):
        return int(engine.grid.get_slice_parallel_rank())
    return int(_mpu(engine).get_tensor_model_parallel_rank())


def mpu_tp_group(engine: DeepSpeedEngine):
    """This rank's Megatron-style TP process group (an engine with `mpu_tp_size` > 1)."""
    if getattr(engine, "pipeline_parallelism", False):
        return engine.grid.get_slice_parallel_group()
    return _mpu(engine).get_tensor_model_parallel_group()


def _stage(engine: DeepSpeedEngine) -> int:
    return int(engine.stage_id) if getattr(engine, "pipeline_parallelism", False) else 0


def holdings(target: Target, rank: int, moments: Sequence[str]) -> list[Holding]:
    """One `Holding` per tensor of `target` on global rank `rank`, whose optimizer holds `moments`: under a
    Megatron-style mpu, of the rank's TP shard, until `placed` cuts it into the boxes it fills."""
    engine = target.engine
    outer = 0
    tp = mpu_tp_size(engine)
    tp_rank = mpu_tp_rank(engine)
    if tp > 1:
        outer = _stage(engine) * tp + tp_rank  # the model-parallel rank, stage-major (DeepSpeed's mp_rank)
    elif tp_size(engine) > 1:
        from deepspeed.utils import groups

        outer = groups.get_tensor_model_parallel_rank()
    elif getattr(engine, "pipeline_parallelism", False):
        outer = engine.stage_id
    experts = local_expert_tensors(engine.module)
    if experts and engine.zero_optimization_stage() == 0:
        from deepspeed.utils import groups

        # Without ZeRO each EP rank's copy is read from its own optimizer file (expp_rank_E): a dense tensor is a
        # Replicate of the EP ranks' copies, as `ucp convert` reads it.
        outer = groups._get_expert_parallel_rank(groups._get_max_expert_size_name())
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
        shard = Shard(tp_rank, _stage(engine), tuple(t.shape), t.start, t.numel) if tp > 1 else None
        out.append(Holding(t.name, rank, t.box if t.box is not None else full_box(t.shape), t.start, t.numel,
                           t.whole, outer, inner, t.kind, tuple(t.shape), states,
                           t.group if t.kind == "param" else None, model_dtypes.get(t.name, "float32"), shard=shard))
    return out


def placed(engine: DeepSpeedEngine, every: Sequence[Holding]) -> list[Holding]:
    """Every rank's holdings, with each Megatron TP shard cut into the boxes of the full tensor it fills; a tensor
    on several stages only as its first stage holds it (`first_stage_only`); under HMP, those of the replica that
    writes (`ucp.deepspeed.saving.hmp`)."""
    hmp = engine_hmp(engine)
    if hmp is not None:
        return writing_holdings(every, hmp.layout)
    if mpu_tp_size(engine) == 1:
        return list(every)
    return place_shards(first_stage_only(every), getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None))


def average_partials(engine: DeepSpeedEngine, target: Target) -> Callable[[], None]:
    """Make each tensor the module declares "to average" (Megatron's `parameter_to_average_patterns`: TP copies
    that drift apart) read, at snapshot time, as the mean of its TP copies, computed as `ucp convert` does;
    returns what the snapshot calls first on every rank (a collective over the TP group). Nothing to do
    without a Megatron-style mpu."""
    tp = mpu_tp_size(engine)
    info = getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None)
    partial = [t for t in target.tensors if t.kind == "param"
               and tp_layout(t.name, [t.shape] * tp, info, True)[1].pattern is Pattern.PARTIAL] if tp > 1 else []
    if not partial:
        return lambda: None
    means: dict[tuple[str, str], torch.Tensor] = {}
    group = mpu_tp_group(engine)

    def mean_view(t: TargetTensor) -> Callable[[str], torch.Tensor]:
        return lambda state: means[(t.name, state)]

    def refresh() -> None:
        states = (WEIGHT_STATE, *target.state_names())
        for t in partial:
            for state in states:
                mine = t.view(state).detach().contiguous()
                copies = [torch.empty_like(mine) for _ in range(tp)]
                dist.all_gather(copies, mine, group=group)
                mean = union(PatternSpec(Pattern.PARTIAL, tuple(mine.shape)), copies)
                means[(t.name, state)] = typing.cast(torch.Tensor, mean)  # torch pieces give a torch mean

    averaged = {t.name: dataclasses.replace(t, view=mean_view(t)) for t in partial}
    target.tensors = [averaged.get(t.name, t) for t in target.tensors]
    return refresh


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
    if mpu_tp_size(engine) > 1:
        return _shard_inputs(engine, held)
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


def _shard_inputs(engine: DeepSpeedEngine, held: dict[str, list[Holding]]
                  ) -> dict[str, tuple[list[Holding], Hints | None]]:
    """As `ucp convert` reads a Megatron-DeepSpeed checkpoint: each tensor from its first stage's TP shards (a
    tied module's later copies are not read), one outer piece per TP rank, each partitioned by ZeRO, under what
    the module's pattern lists declare."""
    info = getattr(engine.module, UNIVERSAL_CHECKPOINT_INFO, None)
    out: dict[str, tuple[list[Holding], Hints | None]] = {}
    for name, hs in held.items():
        first = min(h.shard.stage for h in hs if h.shard is not None)
        shards: dict[int, Holding] = {}
        for h in hs:
            if h.shard is not None and h.shard.stage == first:
                shards.setdefault(h.rank, h)
        pieces = [dataclasses.replace(h, box=full_box(h.shard.shape), start=h.shard.start, numel=h.shard.numel,
                                      outer=h.shard.tp_rank, view_offset=0)
                  for h in shards.values() if h.shard is not None]
        shapes = {p.outer: tuple(p.box[d][1] for d in range(len(p.box))) for p in pieces}
        _, hints = tp_layout(name, [shapes[r] for r in sorted(shapes)], info, hs[0].kind == "param")
        out[name] = (pieces, hints)
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
