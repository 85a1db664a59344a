"""Which tensor x pipeline x data-parallel layout an elastic job takes at each start: `choose_layout`, `layout()`.

    "ucp": {"elastic": {"global_batch": 64, "micro_batch": 2, "tensor_parallel": [4, 2], "pipeline_parallel": [2, 1]}}

`tensor_parallel` and `pipeline_parallel` list the sizes the job may use (an int means exactly that size; 1 when
absent). At a start with W ranks every rank computes the same choice (T, P, D = W // (T*P)) from W and the
config alone, so no rank needs to ask another:

1. a layout whose D cannot share the global batch (`ucp.elastic.shares`), or that does not fit the ranks' memory
   under `ucp.hmp`'s cost model, is never chosen;
2. of the others, the one that uses the most ranks (D*T*P) wins;
3. ties go to the lower step time the cost model estimates (`ucp.hmp.strategy.estimate`), when it knows the
   model's shape (from the module's Hugging Face config, or `"model": path` as `ucp plan` takes);
4. then (and without a model shape) to the smaller T*P: less communication inside a replica; then to the smaller P.

Ranks numbered from 0 take the layout in Megatron's order (TP fastest, then DP, then PP: DeepSpeed's AutoTP
groups and `PipeModelDataParallelTopology` number them so too); ranks from D*T*P on are spares (`ucp.elastic.spares`).
The choice is pure (`choose_layout`); `layout()` applies it to this process's world.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ucp.elastic.shares import ElasticBatch
from ucp.errors import ConfigError

if TYPE_CHECKING:
    from ucp.hmp.model_shapes import ModelConfig

SIZE_KEYS = ("tensor_parallel", "pipeline_parallel")
# A layout's estimated step time in seconds, or None where it does not fit the ranks' memory: (tp, pp, dp) -> s.
StepTime = Callable[[int, int, int], "float | None"]


@dataclass(frozen=True)
class Choice:
    """The job's layout: T x P x D training ranks of `world`, the rest spares."""

    tp: int
    pp: int
    dp: int
    world: int

    @property
    def training(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def spares(self) -> int:
        return self.world - self.training


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

    @classmethod
    def of(cls, choice: Choice, rank: int) -> RankLayout:
        if rank >= choice.training:
            return cls(choice.tp, choice.pp, choice.dp, choice.world, rank, "spare", None, None, None)
        tp, dp = choice.tp, choice.dp
        return cls(tp, choice.pp, dp, choice.world, rank, "train", rank % tp, rank // (tp * dp), rank // tp % dp)

    @property
    def choice(self) -> Choice:
        return Choice(self.tp, self.pp, self.dp, self.world)


def allowed_sizes(section: dict[str, Any], key: str) -> tuple[int, ...]:
    """The sizes `"elastic": {key: ...}` allows (an int: that size alone; absent: 1), largest first."""
    value = section.get(key, 1)
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(values, list) or not values
            or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values)):
        raise ConfigError(f'"ucp": {{"elastic": {{"{key}": {value!r}}}}}: must be a size of at least 1 or a list '
                          'of them, e.g. [4, 2]')
    return tuple(sorted(set(values), reverse=True))


def choose_layout(world: int, tensor_parallel: tuple[int, ...], pipeline_parallel: tuple[int, ...],
                  global_batch: int, micro_batch: int, step_time: StepTime | None = None) -> Choice:
    """The layout for `world` ranks by the rule of the module docstring; ConfigError when none is possible."""
    ranked: list[tuple[tuple[float, ...], Choice]] = []
    refusals: list[str] = []
    for tp in tensor_parallel:
        for pp in pipeline_parallel:
            dp = world // (tp * pp)
            if dp < 1:
                refusals.append(f"T={tp} x P={pp} needs {tp * pp} ranks")
                continue
            try:
                ElasticBatch(global_batch, micro_batch, dp)
            except ConfigError as exc:
                refusals.append(f"T={tp} x P={pp}: {exc}")
                continue
            seconds = step_time(tp, pp, dp) if step_time is not None else 0.0
            if seconds is None:
                refusals.append(f"T={tp} x P={pp} x D={dp} does not fit the ranks' memory (ucp.hmp cost model)")
                continue
            ranked.append(((-dp * tp * pp, seconds, tp * pp, pp), Choice(tp, pp, dp, world)))
    if not ranked:
        raise ConfigError(f'"ucp": {{"elastic": ...}}: no layout of tensor_parallel {list(tensor_parallel)} x '
                          f"pipeline_parallel {list(pipeline_parallel)} can train on {world} ranks ("
                          + "; ".join(refusals) + "); allow smaller sizes, or change the batch or the ranks")
    return min(ranked, key=lambda item: item[0])[1]


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

    def seconds(tp: int, pp: int, dp: int) -> float | None:
        if pp > model.num_layers or model.num_heads % tp or model.num_kv_heads % tp:
            return None
        micro_batches = math.ceil(math.ceil(global_batch / dp) / micro_batch)
        result = estimate(Layout.homogeneous(dp, tp, pp, model.num_layers, zero_stage=min(zero_stage, 1),
                                             micro_batches=micro_batches), model, cost, work)
        return result.step_time_s if result.fits else None

    return seconds
