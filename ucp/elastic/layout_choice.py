"""Which tensor x pipeline x data-parallel layout an elastic job takes at each start: `choose_layout`, `layout()`.

    "ucp": {"elastic": {"global_batch": 64, "micro_batch": 2, "tensor_parallel": [4, 2], "pipeline_parallel": [2, 1]}}

`tensor_parallel` and `pipeline_parallel` list the sizes the job may use (an int means exactly that size; 1 when
absent). At a start with W ranks every rank computes the same choice (T, P, D = W // (T*P)) from W and the
config alone, so no rank needs to ask another:

1. a layout whose D cannot share the global batch (`ucp.elastic.shares`), or that does not fit the ranks' memory
   under `ucp.hmp`'s cost model, is never chosen;
2. of the others, the one that uses the most ranks (D*T*P) wins; with `"expert_parallel": E` (the ep_size of the
   model's MoE layers) D is a multiple of E, as DeepSpeed's expert groups need, so ranks beyond it are spares;
3. ties go to the lower step time the cost model estimates (`ucp.hmp.strategy.estimate`), when it knows the
   model's shape (from the module's Hugging Face config, or `"model": path` as `ucp plan` takes);
4. then (and without a model shape) to the smaller T*P: less communication inside a replica; then to the smaller P.

With `"heterogeneous": true` (Elastor's HMP), a world that rule 2 would leave with spares takes replicas of unequal
tensor-parallel size instead, so every rank trains (`heterogeneous_choice`). Where the cost model knows the model's
shape, the replicas are those of the fastest plan `ucp plan` finds for W (`ucp.hmp.strategy.search`) whose largest TP
size is allowed and whose replicas have an allowed number of pipeline stages (`"pipeline_parallel"`; a replica may be
a pipeline of stages of unequal TP size, `Choice.plan`) (`cost_model_replicas`); otherwise (or when it finds none)
one-stage replicas of the largest allowed size T that fits, as many as fit, and the remainder W mod T as replicas
of its powers of two (3 ranks and T=2: 2 + 1), as that search deals TP_max T with one replica per group. Each
replica takes a share of the global batch in proportion to its speed under the cost model
(`ucp.hmp.strategy.replica_speeds`, `ucp.elastic.shares.speed_shares`). `Choice.hmp_layout()` is that plan as a
`ucp.hmp.layout.Layout`; with the flag on, homogeneous choices are given as such layouts too (equal replicas), so a job
trains on one path at every size (`ucp.deepspeed.engine.hmp_sync`).

Ranks numbered from 0 take the layout in Megatron's order (TP fastest, then DP, then PP: DeepSpeed's AutoTP
groups and `PipeModelDataParallelTopology` number them so too), the search's plans replica by replica, stage by
stage, TP fastest (`ucp.hmp.strategy.Plan.layout`); ranks from D*T*P on are spares (`ucp.elastic.spares`).
The choice is pure (`choose_layout`); `layout()` applies it to this process's world.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from ucp.elastic.shares import ElasticBatch, speed_shares
from ucp.errors import ConfigError
from ucp.hmp.layout import Layout, ParamSpec

if TYPE_CHECKING:
    from ucp.hmp.model_shapes import ModelConfig

# A layout's estimated step time in seconds, or why it cannot train (the model's shape or the ranks' memory):
# (tp, pp, dp) -> s or reason.
StepTime = Callable[[int, int, int], "float | str"]
# Why a tensor-parallel size cannot split the model (the heads it does not divide), or None: tp -> reason.
TpProblem = Callable[[int], "str | None"]
# The model's shape, the GiB per rank, the global batch, the micro-batch, the sequence length and the ZeRO stage.
CostModelInputs = tuple["ModelConfig", float, int, int, int, int]
# The layout of the plan for W ranks that `ucp plan`'s search finds fastest among those the job allows (replicas
# of unequal TP size and stage count), or None: W -> layout.
ReplicaPlan = Callable[[int], "Layout | None"]


@dataclass(frozen=True)
class Choice:
    """The job's layout: T x P x D training ranks of `world`, the rest spares. A heterogeneous one lists its
    replicas' rank counts in `replicas` (their TP sizes where each is one stage; `tp` is the largest TP size, `pp`
    the most stages, `dp` the replica count) and their shares of the global batch in `shares`; `hmp` says the job
    trains through the HMP path (`"heterogeneous": true`); `plan` holds the replicas' stages where the search's plan
    has replicas of more than one stage (its layers are the model's)."""

    tp: int
    pp: int
    dp: int
    world: int
    replicas: tuple[int, ...] = ()
    shares: tuple[int, ...] = ()
    hmp: bool = False
    plan: Layout | None = None

    @classmethod
    def of_plan(cls, plan: Layout, world: int, shares: tuple[int, ...]) -> Choice:
        """The HMP choice of the search's `plan` (replicas with stages) on `world` ranks, with these batch shares."""
        return cls(max(plan.tp_sizes), max(len(r.stages) for r in plan.replicas), len(plan.replicas), world,
                   tuple(len(r.ranks) for r in plan.replicas), shares, True, plan)

    @property
    def training(self) -> int:
        return sum(self.replicas) if self.replicas else self.tp * self.pp * self.dp

    @property
    def spares(self) -> int:
        return self.world - self.training

    @property
    def heterogeneous(self) -> bool:
        return len(set(self.replicas)) > 1 or self.plan is not None

    def describe(self) -> str:
        """The layout in one phrase, for the start's log line and the restart line."""
        if self.plan is not None:
            stages = [" | ".join(f"TP{s.tp}" for s in r.stages) for r in self.plan.replicas]
            return (f"heterogeneous replicas {' + '.join(stages)} (a pipeline's stages joined by |, batch shares "
                    f"{' + '.join(map(str, self.shares))})")
        if self.heterogeneous:
            return (f"heterogeneous tensor_parallel {' + '.join(map(str, self.replicas))} (one replica each, "
                    f"batch shares {' + '.join(map(str, self.shares))})")
        return f"tensor_parallel {self.tp} x pipeline_parallel {self.pp} x data_parallel {self.dp}"

    def hmp_layout(self, layers: int) -> Layout:
        """The training ranks as a `ucp.hmp.layout.Layout` over `layers` layers, each replica's `micro_batches` its
        share of the global batch: the search's plan, or one-stage replicas in rank order (TP fastest), or equal
        pipelines in Megatron's order (TP fastest, then DP, then PP)."""
        if not self.hmp:
            raise ConfigError(f"{self.describe()}: only a layout chosen with \"heterogeneous\": true is an HMP layout")
        if self.plan is not None:
            if self.plan.num_layers != layers:
                raise ConfigError(f"{self.describe()}: the plan splits the {self.plan.num_layers} layers of the "
                                  f"model's config, the module's table has {layers}; give \"model\" the config of "
                                  "the model trained")
            stages = self.plan
        elif self.pp != 1:
            stages = Layout.homogeneous(self.dp, self.tp, self.pp, layers)
        else:
            return Layout.one_stage(self.replicas, self.shares, layers)
        return Layout(layers, tuple(replace(r, micro_batches=n) for r, n in zip(stages.replicas, self.shares)))


@dataclass(frozen=True)
class RankLayout:
    """What `ucp.elastic.layout()` returns: the job's layout and where this rank sits in it.

    `role` is "train" or "spare"; a spare has no coordinates (`tp_rank`, `pp_rank`, `dp_rank` are None)."""

    tp: int
    pp: int
    dp: int
    world: int
    rank: int
    role: str
    tp_rank: int | None
    pp_rank: int | None
    dp_rank: int | None

    replicas: tuple[int, ...] = ()   # a heterogeneous layout: every replica's TP size (`tp` is this rank's)
    shares: tuple[int, ...] = ()     # the replicas' shares of the global batch (HMP path)
    hmp: bool = False                # the job trains through the HMP path (`"heterogeneous": true`)
    plan: Layout | None = None       # the search's plan, where its replicas have stages (`Choice.plan`)
    described: str = field(default="", compare=False)  # the layout in words (`Choice.describe`), as logged

    @classmethod
    def of(cls, choice: Choice, rank: int) -> RankLayout:
        return replace(cls._place(choice, rank), described=choice.describe())

    @classmethod
    def _place(cls, choice: Choice, rank: int) -> RankLayout:
        hmp = (choice.replicas, choice.shares, choice.hmp, choice.plan)
        if rank >= choice.training:
            return cls(choice.tp, choice.pp, choice.dp, choice.world, rank, "spare", None, None, None, *hmp)
        if choice.plan is not None:
            where = choice.plan.placement(rank)
            stages = len(choice.plan.replicas[where.replica].stages)
            return cls(where.tp_size, stages, choice.dp, choice.world, rank, "train", where.tp_rank, where.stage,
                       where.replica, *hmp)
        if choice.replicas:
            starts = [sum(choice.replicas[:i]) for i in range(len(choice.replicas))]
            replica = max(i for i, first in enumerate(starts) if first <= rank)
            return cls(choice.replicas[replica], 1, choice.dp, choice.world, rank, "train", rank - starts[replica], 0,
                       replica, *hmp)
        tp, dp = choice.tp, choice.dp
        return cls(tp, choice.pp, dp, choice.world, rank, "train", rank % tp, rank // (tp * dp), rank // tp % dp,
                   *hmp)

    @property
    def choice(self) -> Choice:
        if self.plan is not None:
            return Choice.of_plan(self.plan, self.world, self.shares)
        tp = max(self.replicas) if self.replicas else self.tp
        return Choice(tp, self.pp, self.dp, self.world, self.replicas, self.shares, self.hmp)

    def hmp_layout(self, layers: int) -> Layout:
        """This start's layout as a `ucp.hmp.layout.Layout` (`Choice.hmp_layout`): build the model for it."""
        return self.choice.hmp_layout(layers)


def choose_layout(world: int, tensor_parallel: tuple[int, ...], pipeline_parallel: tuple[int, ...],
                  global_batch: int, micro_batch: int, step_time: StepTime | None = None,
                  expert_parallel: int = 1) -> Choice:
    """The layout for `world` ranks by the rule of the module docstring; ConfigError when none is possible.
    With `expert_parallel` E > 1 (the ep_size of the model's MoE layers) D is a multiple of E, as DeepSpeed's
    expert groups need: the ranks beyond the largest such D are spares."""
    ranked: list[tuple[tuple[float, ...], Choice]] = []
    refusals: list[str] = []
    for tp in tensor_parallel:
        for pp in pipeline_parallel:
            dp = world // (tp * pp) // expert_parallel * expert_parallel
            if dp < 1:
                experts = f" with expert_parallel {expert_parallel}" if expert_parallel > 1 else ""
                refusals.append(f"T={tp} x P={pp}{experts} needs {tp * pp * expert_parallel} ranks")
                continue
            try:
                ElasticBatch(global_batch, micro_batch, dp)
            except ConfigError as exc:
                refusals.append(f"T={tp} x P={pp}: {exc}")
                continue
            seconds = step_time(tp, pp, dp) if step_time is not None else 0.0
            if isinstance(seconds, str):
                refusals.append(f"T={tp} x P={pp} x D={dp} {seconds}")
                continue
            ranked.append(((-dp * tp * pp, seconds, tp * pp, pp), Choice(tp, pp, dp, world)))
    if not ranked:
        raise ConfigError(f'"ucp": {{"elastic": ...}}: no layout of tensor_parallel {list(tensor_parallel)} x '
                          f"pipeline_parallel {list(pipeline_parallel)} can train on {world} ranks ("
                          + "; ".join(refusals) + "); allow smaller sizes, or change the batch or the ranks")
    return min(ranked, key=lambda item: item[0])[1]


def heterogeneous_choice(world: int, tensor_parallel: tuple[int, ...], pipeline_parallel: tuple[int, ...],
                         global_batch: int, micro_batch: int, step_time: StepTime | None = None,
                         replica_plan: ReplicaPlan | None = None, tp_problem: TpProblem | None = None) -> Choice:
    """With `"heterogeneous": true`: `choose_layout`'s choice as the HMP path takes it (equal replicas), or, where it
    leaves spares or none fits, replicas of unequal size over all `world` ranks: those of `replica_plan` (the cost
    model's search, when it knows the model's shape and finds such a plan; its replicas may be pipelines), else the
    module docstring's one-stage replicas. Where those replicas cannot share the batch (fewer samples than
    micro-batches), the homogeneous choice stands, spares and all; ConfigError when neither is possible.
    `tp_problem` (where the model's shape is known) rules out the TP sizes that do not divide its heads, for
    unequal replicas as for equal ones."""
    if tp_problem is not None:
        refused = {tp: why for tp in tensor_parallel if (why := tp_problem(tp)) is not None}
        if len(refused) == len(tensor_parallel):
            raise ConfigError(f'"ucp": {{"elastic": {{"tensor_parallel": {list(tensor_parallel)}}}}}: no size splits '
                              "the model: " + "; ".join(f"T={t} {why}" for t, why in refused.items())
                              + "; allow a size that divides the heads")
        tensor_parallel = tuple(t for t in tensor_parallel if t not in refused)
    try:
        homogeneous: Choice | None = choose_layout(world, tensor_parallel, pipeline_parallel, global_batch,
                                                   micro_batch, step_time)
    except ConfigError:
        if 1 not in pipeline_parallel:
            raise
        homogeneous = None
    if homogeneous is not None:
        even = (homogeneous.tp,) * homogeneous.dp
        if homogeneous.pp != 1:   # equal pipelines, ranks in Megatron's order
            homogeneous = replace(homogeneous, shares=_shares(global_batch, even), hmp=True)
        else:
            homogeneous = Choice(homogeneous.tp, 1, homogeneous.dp, world, even, _shares(global_batch, even), True)
        if not homogeneous.spares:
            return homogeneous
    plan = replica_plan(world) if replica_plan is not None else None
    if plan is not None:
        replicas = tuple(len(r.ranks) for r in plan.replicas)
        staged = plan if any(len(r.stages) > 1 for r in plan.replicas) else None
    else:
        tp = max((t for t in tensor_parallel if t <= world), default=1)
        rest = world % tp
        replicas = (tp,) * (world // tp) + tuple(1 << b for b in range(rest.bit_length() - 1, -1, -1) if rest >> b & 1)
        staged = None
        if tp_problem is not None and any(tp_problem(t) for t in replicas):  # a remainder's power of two
            if homogeneous is None:
                bad = next(t for t in replicas if tp_problem(t))
                raise ConfigError(f'"ucp": {{"elastic": {{"heterogeneous": true}}}} on {world} ranks: the replica of '
                                  f"T={bad} left over {tp_problem(bad)}; allow sizes that cover {world} ranks")
            return homogeneous
    try:
        shares = _shares(global_batch, staged or replicas)
        ElasticBatch(global_batch, micro_batch, len(replicas), shares)
    except ConfigError:
        if homogeneous is None:
            raise
        return homogeneous
    if staged is not None:
        return Choice.of_plan(staged, world, shares)
    return Choice(max(replicas), 1, len(replicas), world, replicas, shares, True)


def _shares(global_batch: int, replicas: tuple[int, ...] | Layout) -> tuple[int, ...]:
    """The global batch cut by the replicas' speeds under the cost model's TP efficiency: of `replicas`' layout, or
    of one-stage replicas of these TP sizes."""
    from ucp.hmp.strategy import CostModel, replica_speeds

    layout = replicas if isinstance(replicas, Layout) else Layout.one_stage(replicas, (1,) * len(replicas), 1)
    return speed_shares(global_batch, replica_speeds(layout, CostModel(80.0)))


def hmp_layers(table: Iterable[ParamSpec]) -> int:
    """The layers the HMP layouts of a model with this parameter table split: its highest layer index (the final
    norm and head sit one past the last layer, as in Megatron's table, and go with the last stage)."""
    return max([1, *(spec.layer for spec in table)])


def cost_model_step_time(model: ModelConfig, gpu_memory_gib: float, global_batch: int, micro_batch: int, seq_len: int,
                         zero_stage: int) -> StepTime:
    """`ucp.hmp`'s estimate for a homogeneous T x P x D layout of `model` (a `ucp.hmp.model_shapes.ModelConfig`):
    None where a rank would need more than `gpu_memory_gib`, where P exceeds the layers or T does not divide the
    attention heads (AutoTP and Megatron split whole heads)."""
    from ucp.hmp.layout import Layout
    from ucp.hmp.strategy import CostModel, Workload, estimate

    cost = CostModel(gpu_memory_gib=gpu_memory_gib, reserve_gib=min(2.0, gpu_memory_gib / 8),
                     zero_stage=min(zero_stage, 1))
    work = Workload(global_batch=micro_batch * -(-global_batch // micro_batch), seq_len=seq_len,
                    micro_batch_size=micro_batch)

    def seconds(tp: int, pp: int, dp: int) -> float | str:
        if pp > model.num_layers:
            return f"has more stages than the model's {model.num_layers} layers"
        problem = heads_problem(model)(tp)
        if problem is not None:
            return problem
        micro_batches = math.ceil(math.ceil(global_batch / dp) / micro_batch)
        result = estimate(Layout.homogeneous(dp, tp, pp, model.num_layers, zero_stage=min(zero_stage, 1),
                                             micro_batches=micro_batches), model, cost, work)
        return result.step_time_s if result.fits else "does not fit the ranks' memory (ucp.hmp cost model)"

    return seconds


def heads_problem(model: ModelConfig) -> TpProblem:
    """Why TP size `tp` cannot split `model` (AutoTP and Megatron split whole attention and KV heads), or None."""

    def problem(tp: int) -> str | None:
        if model.num_heads % tp or model.num_kv_heads % tp:
            return (f"does not divide the model's {model.num_heads} attention heads and {model.num_kv_heads} KV "
                    "heads")
        return None

    return problem


def cost_model_replicas(model: ModelConfig, gpu_memory_gib: float, global_batch: int, micro_batch: int, seq_len: int,
                        zero_stage: int, tensor_parallel: tuple[int, ...],
                        pipeline_parallel: tuple[int, ...] = (1,)) -> ReplicaPlan:
    """`ucp plan`'s search (`ucp.hmp.strategy.search`) for W ranks and `model`: the layout of the fastest plan whose
    largest TP size is an allowed one and whose replicas have an allowed number of stages (one-stage replicas
    ordered largest first); None when it finds none (the module docstring's rule then decides)."""
    from ucp.hmp.strategy import CostModel, PlanError, Workload, search

    def fastest(world: int) -> Layout | None:
        cost = CostModel(gpu_memory_gib=gpu_memory_gib, reserve_gib=min(2.0, gpu_memory_gib / 8),
                         zero_stage=min(zero_stage, 1), tp_max=min(max(tensor_parallel), world))
        size = max(1, min(micro_batch, global_batch // world))   # micro-batches enough for a replica per rank
        work = Workload(global_batch=size * -(-global_batch // size), seq_len=seq_len, micro_batch_size=size)
        try:
            plans = search(model, world, cost, work, top=50).plans
        except PlanError:
            return None
        for plan in plans:
            layout = plan.layout()
            if any(heads_problem(model)(t) for t in layout.tp_sizes):
                continue
            if (max(layout.tp_sizes) in tensor_parallel
                    and all(len(r.stages) in pipeline_parallel for r in layout.replicas)):
                if all(len(r.stages) == 1 for r in layout.replicas):
                    sizes = sorted((r.stages[0].tp for r in layout.replicas), reverse=True)
                    return Layout.one_stage(sizes, (1,) * len(sizes), layout.num_layers)
                return replace(layout, zero_stage=0)
        return None

    return fastest
