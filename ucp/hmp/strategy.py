"""Strategy search for heterogeneous model parallelism (Elastor-style): pure, no torch.

`search(model, gpus, cost, workload)` returns the best plans for exactly `gpus` GPUs, counts that
divide nothing included. For every TP_max (a power of two dividing the head counts, at most
`cost.tp_max`), the GPUs are cut into TP groups of TP_max plus the remainder in powers of two
(31 = 8+8+8+4+2+1); for every DP degree d the groups are dealt to d replicas, largest first onto
the replica with the fewest GPUs; each replica runs its groups as pipeline stages, with layers
given to stages to balance stage time within each GPU's memory; micro-batches go to replicas to
balance replica time. The cost model (docs/PLAN.md) is `CostModel`; `estimate(layout, ...)`
scores any layout with the same formulas, so plans and hand-made layouts compare directly.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ucp.errors import UcpError
from ucp.hmp.layout import Layout, Replica, Stage
from ucp.hmp.model_shapes import ModelConfig

GIB = 1 << 30
WEIGHT_GRAD_BYTES = 2 + 4   # bf16 weight + fp32 gradient, per parameter, on every GPU holding it
OPTIMIZER_BYTES = 4 + 4 + 4  # fp32 master weight + Adam's two moments, per parameter, shardable by ZeRO
GRAD_SYNC_BYTES = 4          # fp32 gradients all-reduced across replicas


class PlanError(UcpError):
    """No plan fits, or the planner was asked something impossible."""


# What the search accepts. Beyond these it would run out of time or memory (#21: 10**9 GPUs exhausted memory,
# a NaN GPU memory printed plans); each is far beyond any machine of today.
MAX_GPUS = 1 << 20
MAX_GPU_MEMORY_GIB = 1 << 20
MAX_TFLOPS = 1e6
MAX_BATCH = 1 << 24
MAX_CANDIDATES = 50_000  # (TP_max, DP) pairs searched: ~0.3 ms each on one core


@dataclass(frozen=True)
class CostModel:
    """The hardware and the knobs of the cost model (see docs/PLAN.md)."""

    gpu_memory_gib: float
    peak_tflops: float = 312.0       # dense bf16 per GPU (A100: 312, H100 SXM: 989)
    mfu: float = 0.5                 # fraction of peak a TP=1 stage sustains
    tp_overhead: float = 0.05        # TP efficiency is 1 / (1 + tp_overhead * (t - 1))
    tp_max: int = 8                  # largest TP group (GPUs that share a fast link, usually one node)
    dp_bandwidth_gbs: float = 25.0   # per-GPU bandwidth of the gradient all-reduce across replicas
    zero_stage: int = 1              # 1: optimizer states sharded across replicas of the same shape; 0: not
    reserve_gib: float = 2.0         # per GPU: CUDA context, communication buffers, fragmentation

    def check(self) -> None:
        # Written so that NaN fails every test (`nan <= 0` is false): bounds a GPU of today is far inside.
        if not (0 < self.gpu_memory_gib <= MAX_GPU_MEMORY_GIB and 0 < self.peak_tflops <= MAX_TFLOPS
                and 0 < self.mfu <= 1):
            raise PlanError(f"GPU memory ({self.gpu_memory_gib:g} GiB) must be in (0, {MAX_GPU_MEMORY_GIB}], peak "
                            f"TFLOP/s ({self.peak_tflops:g}) in (0, {MAX_TFLOPS:g}] and mfu ({self.mfu:g}) in (0, 1]")
        if not (0 <= self.tp_overhead < math.inf and 1 <= self.tp_max <= MAX_GPUS
                and 0 < self.dp_bandwidth_gbs < math.inf and 0 <= self.reserve_gib < self.gpu_memory_gib):
            raise PlanError("tp_overhead must be >= 0, tp_max >= 1, dp_bandwidth_gbs > 0 and reserve_gib below the "
                            "GPU memory, each a finite number")
        if self.zero_stage not in (0, 1):
            raise PlanError(f"zero_stage={self.zero_stage}: the cost model knows ZeRO stage 0 and 1")


@dataclass(frozen=True)
class Workload:
    global_batch: int = 256          # sequences per optimizer step
    seq_len: int = 4096
    micro_batch_size: int = 1        # sequences per micro-batch

    @property
    def micro_batches(self) -> int:
        return self.global_batch // self.micro_batch_size

    def check(self) -> None:
        if min(self.global_batch, self.seq_len, self.micro_batch_size) < 1:
            raise PlanError("global batch, sequence length and micro-batch size must be at least 1")
        if max(self.global_batch, self.seq_len, self.micro_batch_size) > MAX_BATCH:
            raise PlanError(f"global batch, sequence length and micro-batch size must be at most {MAX_BATCH}")
        if self.global_batch % self.micro_batch_size:
            raise PlanError(f"global batch {self.global_batch} is not a multiple of the micro-batch size "
                            f"{self.micro_batch_size}")


@dataclass(frozen=True)
class StagePlan:
    tp: int
    layers: int


@dataclass(frozen=True)
class ReplicaPlan:
    """`count` identical replicas: their stages (TP group size and layer count, in pipeline order)."""

    stages: tuple[StagePlan, ...]
    micro_batches: int   # each
    count: int
    time_s: float        # each replica's compute time for the step, pipeline bubble included
    memory_gib: float    # the most any of their GPUs holds

    @property
    def gpus(self) -> int:
        return sum(s.tp for s in self.stages)


@dataclass(frozen=True)
class Plan:
    gpus: int
    tp_max: int
    zero_stage: int
    replicas: tuple[ReplicaPlan, ...]   # kinds of replicas, each with its count
    step_time_s: float
    sync_time_s: float   # the gradient all-reduce part of step_time_s
    memory_gib: float    # the most any GPU holds
    tokens_per_s: float

    @property
    def dp(self) -> int:
        return sum(r.count for r in self.replicas)

    def layout(self) -> Layout:
        """The plan as a layout: ranks numbered replica by replica, stage by stage, TP fastest."""
        replicas, rank = [], 0
        for r in self.replicas:
            for _ in range(r.count):
                stages, first = [], 0
                for s in r.stages:
                    stages.append(Stage((first, first + s.layers), tuple(range(rank, rank + s.tp))))
                    first += s.layers
                    rank += s.tp
                replicas.append(Replica(tuple(stages), r.micro_batches))
        return Layout(sum(s.layers for s in self.replicas[0].stages), tuple(replicas), self.zero_stage)

    def to_json(self) -> dict:
        return {"gpus": self.gpus, "dp": self.dp, "tp_max": self.tp_max, "zero_stage": self.zero_stage,
                "step_time_s": self.step_time_s,
                "sync_time_s": self.sync_time_s, "memory_gib": self.memory_gib, "tokens_per_s": self.tokens_per_s,
                "replicas": [{"stages": [{"tp": s.tp, "layers": s.layers} for s in r.stages],
                              "micro_batches": r.micro_batches, "count": r.count, "time_s": r.time_s,
                              "memory_gib": r.memory_gib}
                             for r in self.replicas]}


@dataclass(frozen=True)
class SearchResult:
    plans: tuple[Plan, ...]
    candidates: int      # (TP_max, DP) combinations scored


# -- the per-stage formulas, shared by the search and by estimate() -------------------------------------

@dataclass(frozen=True)
class _Coeffs:
    """A stage as linear functions of its layer count k: time = a*k + b seconds, memory = c*k + e bytes."""

    a: float
    b: float
    c: float
    e: float


def _stage_coeffs(model: ModelConfig, cost: CostModel, work: Workload, tp: int, first: bool, last: bool,
                  in_flight: int, zero_peers: int) -> _Coeffs:
    h, s, mbs, v = model.hidden_size, work.seq_len, work.micro_batch_size, model.vocab_size
    tokens = s * mbs
    speed = tp * cost.peak_tflops * 1e12 * cost.mfu / (1 + cost.tp_overhead * (tp - 1))
    layer_flops = 3 * tokens * (2 * model.layer_matmul_params + 4 * s * h)   # forward + backward
    head_flops = 3 * tokens * 2 * h * v if last else 0
    per_param = WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES / zero_peers
    part, repl = model.layer_params
    layer_mem = (part / tp + repl) * per_param + in_flight * tokens * _activation_bytes_per_token(model) / tp
    fixed_params = (model.embedding_params / tp if first else 0) + \
        ((0 if model.tie_embeddings else model.embedding_params / tp) + h if last else 0)
    logits = 4 * tokens * v / tp if last else 0
    fixed_mem = fixed_params * per_param + logits + cost.reserve_gib * GIB
    return _Coeffs(layer_flops / speed, head_flops / speed, layer_mem, fixed_mem)


def _activation_bytes_per_token(model: ModelConfig) -> int:
    """16-bit tensors one layer keeps for backward, per token, with flash attention and no recomputation.

    Norm inputs and the attention projection input (4h), q/k/v (h + 2 kv), attention output (h),
    and the three MLP tensors of width i (gate, up, their product); all cut by TP with sequence
    parallelism.
    """
    h, i, kv = model.hidden_size, model.intermediate_size, model.kv_dim
    return 2 * (6 * h + 2 * kv + 3 * i)


def _sync_time(cost: CostModel, params_per_gpu: float, dp: int) -> float:
    if dp == 1:
        return 0.0
    return 2 * (dp - 1) / dp * params_per_gpu * GRAD_SYNC_BYTES / (cost.dp_bandwidth_gbs * 1e9)


def _params_on_gpu(model: ModelConfig, tp: int, layers: int, first: bool, last: bool) -> float:
    part, repl = model.layer_params
    head = (0 if model.tie_embeddings else model.embedding_params) / tp + model.hidden_size
    return layers * (part / tp + repl) + (model.embedding_params / tp if first else 0) + (head if last else 0)


# -- scoring any layout ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Estimate:
    step_time_s: float
    sync_time_s: float
    replica_time_s: tuple[float, ...]
    memory_gib: dict[int, float]     # per rank
    fits: bool                       # every rank within cost.gpu_memory_gib


def estimate(layout: Layout, model: ModelConfig, cost: CostModel, work: Workload = Workload()) -> Estimate:
    """Step time and per-GPU memory of `layout` under the cost model (the search uses the same formulas)."""
    if layout.num_layers != model.num_layers:
        raise PlanError(f"the layout has {layout.num_layers} layers, {model.name} has {model.num_layers}")
    shapes = Counter(_shape(r) for r in layout.replicas)
    times, memory, sync_params = [], {}, 0.0
    for r in layout.replicas:
        p = len(r.stages)
        z = shapes[_shape(r)] if cost.zero_stage else 1
        worst = 0.0
        for i, stage in enumerate(r.stages):
            k = stage.layers[1] - stage.layers[0]
            co = _stage_coeffs(model, cost, work, stage.tp, i == 0, i == p - 1, p - i, z)
            worst = max(worst, co.a * k + co.b)
            for rank in stage.ranks:
                memory[rank] = (co.c * k + co.e) / GIB
            sync_params = max(sync_params, _params_on_gpu(model, stage.tp, k, i == 0, i == p - 1))
        times.append((r.micro_batches + p - 1) * worst)
    sync = _sync_time(cost, sync_params, len(layout.replicas))
    fits = max(memory.values()) <= cost.gpu_memory_gib
    return Estimate(max(times) + sync, sync, tuple(times), memory, fits)


def _shape(r: Replica) -> tuple:
    return tuple((s.tp, s.layers) for s in r.stages)


# -- the search --------------------------------------------------------------------------------------------

def search(model: ModelConfig, gpus: int, cost: CostModel, work: Workload = Workload(), top: int = 5) -> SearchResult:
    """The `top` fastest plans that use exactly `gpus` GPUs and fit in memory, fastest first."""
    cost.check()
    work.check()
    if gpus < 1:
        raise PlanError(f"--gpus {gpus}: need at least one GPU")
    if gpus > MAX_GPUS:
        raise PlanError(f"--gpus {gpus}: plans are searched for at most {MAX_GPUS} GPUs")
    if top < 1:
        raise PlanError(f"--top {top}: must be at least 1")
    sizes = tp_sizes(model, min(cost.tp_max, gpus))
    count = sum(min(gpus // t + len(_powers_of_two(gpus % t)), work.micro_batches) for t in sizes)
    if count > MAX_CANDIDATES:
        raise PlanError(f"{gpus} GPUs and a global batch of {work.global_batch} make {count} (TP_max, DP) candidates, "
                        f"more than the {MAX_CANDIDATES} searched in bounded time (~15 s); lower --global-batch, "
                        "or --gpus")
    search_ = _Search(model, cost, work)
    found: dict[tuple, Plan] = {}
    candidates = 0
    for tp_max in sizes:
        full, rest = gpus // tp_max, _powers_of_two(gpus % tp_max)
        for dp in range(1, min(full + len(rest), work.micro_batches) + 1):
            candidates += 1
            plan = search_.plan(tp_max, full, rest, dp)
            if plan is not None:
                key = tuple(sorted((tuple((s.tp, s.layers) for s in r.stages), r.micro_batches, r.count)
                                   for r in plan.replicas))
                if key not in found or plan.step_time_s < found[key].step_time_s:
                    found[key] = plan
    if not found:
        raise PlanError(_nothing_fits(model, gpus, cost, work))
    plans = sorted(found.values(), key=lambda p: (p.step_time_s, p.memory_gib, p.dp))
    return SearchResult(tuple(plans[:top]), candidates)


def tp_sizes(model: ModelConfig, tp_max: int) -> list[int]:
    """TP degrees the search uses: powers of two up to `tp_max` that divide the attention and KV head counts."""
    out, t = [], 1
    while t <= tp_max:
        if model.num_heads % t == 0 and model.num_kv_heads % t == 0:
            out.append(t)
        t *= 2
    return out


def _powers_of_two(n: int) -> list[int]:
    """n as a sum of distinct powers of two, largest first (7 -> [4, 2, 1])."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


def deal(big: int, full: int, rest: list[int], dp: int) -> Counter:
    """`full` TP groups of size `big` and the smaller groups `rest` dealt to `dp` replicas, each onto the
    replica with the fewest GPUs so far (largest groups first).

    Returns how many replicas get each tuple of group sizes (largest first; () for a replica left
    empty). The full groups are dealt in closed form: replica j gets q + 1 of them for j < r, q
    otherwise. The smaller ones (fewer than log2 TP_max + 1, together smaller than one full group)
    then land on replicas r, r + 1, ... in turn, so only those few are looked at, whatever `dp`.
    """
    q, r = divmod(full, dp)
    watched = {j: [big] * q for j in range(r, min(dp, r + len(rest)))}
    for g in rest:
        j = min(watched, key=lambda i: (sum(watched[i]), i))
        watched[j].append(g)
    shapes = Counter({(big,) * (q + 1): r, (big,) * q: dp - r})
    for groups in watched.values():
        shapes[(big,) * q] -= 1
        shapes[tuple(sorted(groups, reverse=True))] += 1
    return +shapes


class _Search:
    def __init__(self, model: ModelConfig, cost: CostModel, work: Workload):
        self.model, self.cost, self.work = model, cost, work
        self.budget = cost.gpu_memory_gib * GIB
        self._replicas: dict[tuple, tuple | None] = {}
        self._unbounded: dict[tuple, list[int] | None] = {}
        self._coeffs: dict[tuple, _Coeffs] = {}

    def plan(self, tp_max: int, full: int, rest: list[int], dp: int) -> Plan | None:
        shapes = deal(tp_max, full, rest, dp)
        if () in shapes:
            return None
        best: dict[tuple[int, ...], tuple[Any, ...]] = {}
        for shape, count in shapes.items():
            option = self.replica(shape, count if self.cost.zero_stage else 1)
            if option is None:
                return None
            best[shape] = option
        kinds = [(best[shape][0], len(shape), count) for shape, count in shapes.items()]  # (tau, p, count)
        split = _assign_micro_batches(kinds, self.work.micro_batches)
        replicas, slowest, most_params = [], 0.0, 0.0
        for shape, (tau, p, _), parts in zip(shapes, kinds, split):
            _, stages, mem, params = best[shape]
            most_params = max(most_params, params)
            for m, count in parts:
                if count:
                    replicas.append(ReplicaPlan(stages, m, count, (m + p - 1) * tau, mem / GIB))
                    slowest = max(slowest, (m + p - 1) * tau)
        sync = _sync_time(self.cost, most_params, dp)
        step = slowest + sync
        replicas.sort(key=lambda r: (-sum(s.tp for s in r.stages), -r.micro_batches))
        return Plan(tp_max * full + sum(rest), tp_max, self.cost.zero_stage, tuple(replicas), step, sync,
                    max(r.memory_gib for r in replicas), self.work.global_batch * self.work.seq_len / step)

    def replica(self, shape: tuple[int, ...], zero_peers: int) -> tuple | None:
        """(time per micro-batch, stages, peak bytes, most parameters on a GPU) of the best stage order, or None."""
        key = (shape, zero_peers)
        if key not in self._replicas:
            options = [o for o in (self._fill(order, zero_peers) for order in stage_orders(shape)) if o is not None]
            self._replicas[key] = min(options, key=lambda o: (o[0], o[2])) if options else None
        return self._replicas[key]

    def coeffs(self, order: tuple[int, ...], zero_peers: int) -> list[_Coeffs]:
        p = len(order)
        out = []
        for i, t in enumerate(order):
            key = (t, i == 0, i == p - 1, p - i, zero_peers)
            if key not in self._coeffs:
                self._coeffs[key] = _stage_coeffs(self.model, self.cost, self.work, *key)
            out.append(self._coeffs[key])
        return out

    def _fill(self, order: tuple[int, ...], zero_peers: int) -> tuple | None:
        """Layers to stages in this order, balancing stage time within each GPU's memory.

        The assignment that ignores memory depends on the order alone and is shared by every ZeRO
        peer count; only when it does not fit is the memory-capped one computed.
        """
        n_layers, p = self.model.num_layers, len(order)
        if p > n_layers:
            return None
        coeffs = self.coeffs(order, zero_peers)
        if order not in self._unbounded:
            self._unbounded[order] = _balance_layers(coeffs, [n_layers] * p, n_layers)
        layers = self._unbounded[order]
        if layers is None or any(co.c * k + co.e > self.budget for co, k in zip(coeffs, layers)):
            caps = [int((self.budget - co.e) // co.c) if co.c > 0 else n_layers for co in coeffs]
            layers = _balance_layers(coeffs, caps, n_layers) if min(caps) >= 1 else None
            if layers is None:
                return None
        tau = max(co.a * k + co.b for co, k in zip(coeffs, layers))
        mem = max(co.c * k + co.e for co, k in zip(coeffs, layers))
        params = max(_params_on_gpu(self.model, t, k, i == 0, i == p - 1)
                     for i, (t, k) in enumerate(zip(order, layers)))
        return tau, tuple(StagePlan(t, k) for t, k in zip(order, layers)), mem, params


def stage_orders(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Pipeline orders worth trying for a replica's TP groups: every distinct one for up to 4 stages;
    beyond, largest first, largest last, and largest at both ends (the first stage keeps the most
    micro-batches in flight, the last one holds the LM head and logits)."""
    if len(shape) <= 4:
        return sorted(set(itertools.permutations(shape)))
    front: list[int] = []
    back: list[int] = []
    for i, t in enumerate(sorted(shape, reverse=True)):
        (front if i % 2 == 0 else back).append(t)
    return list(dict.fromkeys((shape, shape[::-1], tuple(front + back[::-1]))))


def _balance_layers(coeffs: list[_Coeffs], caps: list[int], n_layers: int) -> list[int] | None:
    """At least one layer per stage, then each next layer to the stage whose time a*k + b grows least.

    Greedy is optimal here: stage times are increasing in k and independent, so the minimum of the
    largest time is reached by always extending the stage that stays fastest. None if `caps` (the
    most layers each stage's memory holds) leave layers over.
    """
    layers = [1] * len(coeffs)
    heap = [(co.a * 2 + co.b, i) for i, co in enumerate(coeffs) if caps[i] >= 2]
    heapq.heapify(heap)
    for _ in range(n_layers - len(coeffs)):
        if not heap:
            return None
        _, i = heapq.heappop(heap)
        layers[i] += 1
        if layers[i] < caps[i]:
            heapq.heappush(heap, (coeffs[i].a * (layers[i] + 1) + coeffs[i].b, i))
    return layers


def _assign_micro_batches(kinds: list[tuple[float, int, int]], total: int) -> list[list[tuple[int, int]]]:
    """Micro-batches to replicas, at least one each, minimising the slowest (m + p - 1) * tau: exact.

    `kinds` are (tau, p, count) per replica shape; returns per kind [(micro-batches, replicas)].
    The optimum T is some (m + p - 1) * tau. It is at least the continuous optimum T0 (and every
    p * tau), and at most T0 + max tau, where every kind already has room for its continuous share;
    the few candidates in between are searched by bisection.
    """
    def room(t: float, tau: float, p: int) -> int:
        return math.floor(t / tau * (1 + 1e-12)) - p + 1

    def capacity(t: float) -> int:
        return sum(n * room(t, tau, p) for tau, p, n in kinds)

    t0 = (total + sum(n * (p - 1) for _, p, n in kinds)) / sum(n / tau for tau, _, n in kinds)
    lo = max(t0, max(p * tau for tau, p, _ in kinds))
    hi = lo + max(tau for tau, _, _ in kinds)
    candidates = sorted({(m + p - 1) * tau for tau, p, _ in kinds
                         for m in range(max(1, room(lo, tau, p)), room(hi, tau, p) + 2)})
    first, last = 0, len(candidates) - 1
    while first < last:
        mid = (first + last) // 2
        if capacity(candidates[mid]) >= total:
            last = mid
        else:
            first = mid + 1
    best = candidates[first]
    caps = [room(best, tau, p) for tau, p, _ in kinds]
    excess = sum(c * n for c, (_, _, n) in zip(caps, kinds)) - total
    # Below `best` there is room for fewer than `total`: taking one micro-batch off each slowest
    # replica (those at `best`) in turn removes the excess.
    lowered = [0] * len(kinds)
    for j in sorted(range(len(kinds)), key=lambda j: -(caps[j] + kinds[j][1] - 1) * kinds[j][0]):
        if excess > 0 and caps[j] > 1:
            lowered[j] = min(kinds[j][2], excess)
            excess -= lowered[j]
    return [[(c, n - low), (c - 1, low)] if low else [(c, n)]
            for c, low, (_, _, n) in zip(caps, lowered, kinds)]


def _nothing_fits(model: ModelConfig, gpus: int, cost: CostModel, work: Workload) -> str:
    total = model.num_params * (WEIGHT_GRAD_BYTES + OPTIMIZER_BYTES) / GIB
    return (f"no plan fits {model.name} ({model.num_params / 1e9:.2f} B parameters, ~{total:.0f} GiB of weights, "
            f"gradients and optimizer states before sharding) on {gpus} GPUs of {cost.gpu_memory_gib:g} GiB with "
            f"micro-batches of {work.micro_batch_size} x {work.seq_len} tokens; add GPUs, use GPUs with more memory, "
            "or shorten --seq-len")


def replica_speeds(layout: Layout, cost: CostModel) -> tuple[float, ...]:
    """Each replica's relative throughput under the cost model's TP efficiency, for cutting a global batch.

    A TP group of t GPUs runs a layer t / (1 + tp_overhead * (t - 1)) times as fast as one GPU; a
    replica runs at the speed of its slowest stage per layer. Embedding and head costs are left
    out: `estimate` scores a full model.
    """
    def speed(tp: int, layers: int) -> float:
        return tp / (1 + cost.tp_overhead * (tp - 1)) / layers

    return tuple(min(speed(s.tp, s.layers[1] - s.layers[0]) for s in r.stages) for r in layout.replicas)
