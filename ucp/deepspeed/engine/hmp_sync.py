"""Heterogeneous model parallelism on DeepSpeed engines: the gradient sync across replicas, run between
`engine.backward` and `engine.step` (the `"hmp"` key of the `"ucp"` config section).

    mpu = RankAloneMpu.for_layout(layout)          # every rank, in the same order: TP groups, groups of one
    model = MyTPModel(layout, rank, mpu.tp_group)  # this rank's slices; `ucp_param_table`: the whole model's
    engine, *_ = ucp.deepspeed.initialize(model=model, model_parameters=model.parameters(), mpu=mpu, config={
        ..., "ucp": {"layout": layout.to_json(),
                     "hmp": {"global_batch": 8, "micro_batch": 5, "shares": [5, 3]}}})
    sampler = ElasticBatchSampler.for_replica(dataset, engine.ucp_hmp.batch, replica)
    for indices in sampler:
        engine.backward(mean_loss(indices) * sampler.loss_weight(len(indices)))
        engine.step()

Each rank runs its own engine over the slices the layout gives it. Its data-parallel group is the rank
alone: the replicas are the data parallelism, and their TP sizes differ, which DeepSpeed's groups cannot
express. The engine's batch keys are those of one replica (`micro_batch` x A, A the micro-batches per step).

Where the sync sits (DeepSpeed 0.19.8). At the accumulation boundary `engine.backward` reduces over the
engine's data-parallel group (`allreduce_gradients`) and leaves the gradient where the optimizer reads it:
ZeRO-0 in `param.grad`; ZeRO-1 (`DeepSpeedZeroOptimizer.reduce_gradients`) in its partitioned
`averaged_gradients`, with `param.grad` cleared; bf16 with fp32 gradient accumulation (`BF16_Optimizer`,
its backward epilogue) in the fp32 buffer `param._hp_grad`. `engine.step` then steps on that. So the sync
wraps `engine.step` and runs first, at each boundary, on that gradient: `param._hp_grad` in place, else
`param.grad` in place, else through DeepSpeed's `safe_get_full_grad` / `safe_set_full_grad` (ZeRO-1: with a
data-parallel group of one, its partition is the whole tensor).

Weights. DeepSpeed divides each micro-batch's loss by A, and `loss_weight(k)` = k R A / B (R replicas,
`ucp.elastic.shares`), so each replica's gradient is R / B times the sum of its samples' gradients, whatever
its share. The sync therefore averages the replicas without further weights (`GradSync` with equal counts),
as DeepSpeed's own all-reduce averages homogeneous replicas: the step's gradient is the mean over the B samples.
Each step counts B samples in `engine.global_samples` (not the replica's share), as a homogeneous run does, so
a checkpoint's sample count is the same whatever layout saved it.

Saving (`ucp.deepspeed.save`, `"save"`) from such engines: `ucp.deepspeed.saving.hmp`.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ucp.elastic.shares import BATCH_KEYS, ElasticBatch
from ucp.errors import ConfigError, UnsupportedLayoutError
from ucp.hmp.grad_sync import GradSync
from ucp.hmp.layout import Layout, LayoutError, ParamSpec

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

SECTION_KEYS = ("global_batch", "micro_batch", "shares")


def hmp_batch(section: object, layout: Layout) -> ElasticBatch:
    """The `"hmp"` section: B samples per step over the layout's replicas, in micro-batches of at most
    `micro_batch`, cut by `shares` (one per replica; default: as even as B allows)."""
    if not isinstance(section, dict) or "global_batch" not in section or "micro_batch" not in section:
        raise ConfigError(f'"ucp": {{"hmp": {section!r}}}: needs "global_batch" and "micro_batch" (and '
                          'optionally "shares", samples per replica), e.g. {"global_batch": 8, "micro_batch": 5, '
                          '"shares": [5, 3]}')
    unknown = sorted(set(section) - set(SECTION_KEYS))
    if unknown:
        raise ConfigError(f'"ucp": {{"hmp": ...}}: unknown key {unknown[0]!r}; known: '
                          + ", ".join(f'"{k}"' for k in SECTION_KEYS))
    shares = section.get("shares")
    if shares is not None and (not isinstance(shares, list) or not all(isinstance(s, int) for s in shares)):
        raise ConfigError(f'"ucp": {{"hmp": {{"shares": {shares!r}}}}}: must be a list of sample counts')
    return ElasticBatch(section["global_batch"], section["micro_batch"], len(layout.replicas),
                        tuple(shares) if shares is not None else None)


def replica_batch_keys(ds_config: dict, batch: ElasticBatch) -> dict:
    """`ds_config` with DeepSpeed's batch keys for one replica's engine (a data-parallel group of one)."""
    a = batch.accumulation
    keys = {"train_batch_size": batch.micro_batch * a, "train_micro_batch_size_per_gpu": batch.micro_batch,
            "gradient_accumulation_steps": a}
    return {**{k: v for k, v in ds_config.items() if k not in BATCH_KEYS}, **keys}


class RankAloneMpu:
    """DeepSpeed's model-parallel unit for one HMP rank: its TP group, and a data-parallel group of itself."""

    def __init__(self, tp_group: Any, tp_ranks: Sequence[int], dp_group: Any):
        self.tp_group, self.tp_ranks, self.dp_group = tp_group, tuple(tp_ranks), dp_group

    @classmethod
    def for_layout(cls, layout: Layout) -> RankAloneMpu:
        """This rank's unit; creates every stage's TP group and every rank's group of one, in the same order on
        every rank (torch.distributed's rule), so every rank must call it."""
        rank = dist.get_rank()
        tp = {s.ranks: dist.new_group(list(s.ranks)) for r in layout.replicas for s in r.stages}
        alone = [dist.new_group([r]) for r in range(layout.world_size)]
        where = layout.placement(rank)
        ranks = layout.replicas[where.replica].stages[where.stage].ranks
        return cls(tp[ranks], ranks, alone[rank])

    def get_model_parallel_rank(self) -> int:
        return self.tp_ranks.index(dist.get_rank())

    def get_model_parallel_world_size(self) -> int:
        return len(self.tp_ranks)

    def get_model_parallel_group(self) -> Any:
        return self.tp_group

    def get_data_parallel_rank(self) -> int:
        return 0

    def get_data_parallel_world_size(self) -> int:
        return 1

    def get_data_parallel_group(self) -> Any:
        return self.dp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group


@dataclass
class EngineHmp:
    """What `ucp.deepspeed.initialize` attaches as `engine.ucp_hmp`: the layout, the batch, the sync and what the
    engine's checkpoint life (`ucp.deepspeed.life`) runs before each step."""

    layout: Layout
    batch: ElasticBatch
    sync: GradSync
    before_step: Callable[[], None]

    @property
    def replica(self) -> int:
        return self.layout.placement(dist.get_rank()).replica


def install_sync(engine: DeepSpeedEngine, layout: Layout, batch: ElasticBatch,
                 table: Sequence[ParamSpec] | None = None) -> EngineHmp:
    """Check the engine fits the layout and attach `engine.ucp_hmp`, whose `before_step` syncs the gradients (module
    docstring); `ucp.deepspeed.initialize` hands it to the engine's checkpoint life, which wraps `engine.step`."""
    table = list(table if table is not None else getattr(engine.module, "ucp_param_table", None) or [])
    if not table:
        raise UnsupportedLayoutError('"ucp": {"hmp": ...} needs the model\'s parameter table: give the module a '
                                     "`ucp_param_table` (a list of ucp.hmp.layout.ParamSpec)")
    if getattr(engine, "pipeline_parallelism", False):
        raise UnsupportedLayoutError('"ucp": {"hmp": ...}: a PipelineModule engine steps inside train_batch, where '
                                     "the sync cannot run; on HMP each stage is an engine of its own "
                                     "(examples/hmp/pipeline.py)")
    if engine.zero_optimization_stage() > 1:
        raise UnsupportedLayoutError(f'"ucp": {{"hmp": ...}}: ZeRO stage {engine.zero_optimization_stage()} is not '
                                     "supported under HMP (each rank is its own data-parallel group); use stage 0 or 1")
    if engine.dp_world_size != 1:
        raise UnsupportedLayoutError(f'"ucp": {{"hmp": ...}}: the engine\'s data-parallel group has '
                                     f"{engine.dp_world_size} ranks; under HMP it is the rank alone (the replicas are "
                                     "the data parallelism): pass mpu=RankAloneMpu.for_layout(layout) "
                                     "(ucp.deepspeed.engine.hmp_sync)")
    rank = dist.get_rank()
    params = dict(engine.module.named_parameters())
    for name, piece in layout.rank_slices(rank, table).items():
        held = params.get(name)
        want = tuple(b - a for a, b in piece.box)
        if held is not None and tuple(held.shape) != want:
            raise LayoutError(f"{name}: rank {rank}'s module holds shape {tuple(held.shape)}, but the layout gives "
                              f"it box {piece.box}; build the module from the same layout")
    # Equal counts: the loss weights already carry the shares (module docstring, "Weights").
    sync = GradSync(layout, table, params, samples=(1,) * len(layout.replicas))

    def sync_before_step() -> None:
        if engine.is_gradient_accumulation_boundary():
            sync_engine_grads(sync, params)

    hmp = EngineHmp(layout, batch, sync, sync_before_step)
    engine.ucp_hmp = hmp
    return hmp


def sync_engine_grads(sync: GradSync, params: Mapping[str, torch.nn.Parameter]) -> None:
    """Run `sync` on the gradients the engine's optimizer will step on (module docstring, "Where")."""
    from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

    grads, copies = {}, []
    for name, p in params.items():
        hp = getattr(p, "_hp_grad", None)  # BF16_Optimizer's fp32 accumulation buffer
        if hp is not None:
            grads[name] = hp.view(p.shape)
        elif p.grad is not None:
            grads[name] = p.grad
        elif hasattr(p, "_hp_mapping"):  # ZeRO-1: the optimizer's own partition
            grads[name] = safe_get_full_grad(p)
            copies.append((p, grads[name]))
        else:  # the loss did not reach it: it joins the sum as zeros
            p.grad = torch.zeros_like(p)
            grads[name] = p.grad
    sync(grads)
    for p, value in copies:
        safe_set_full_grad(p, value)
