"""How a fixed global batch of B samples is shared by W data-parallel ranks, whatever W is.

Every optimizer step must see the same B samples at any world size, so that a job that loses ranks
continues the run it was. B rarely divides by W after a loss (B = 256 on 7 GPUs), so ranks take
uneven shares, as Elastor balances micro-batches: the first `B % W` ranks take one sample more.
DeepSpeed needs every rank to run the same number of micro-batches per step (its gradient
accumulation), so each rank cuts its share into A = ceil(ceil(B / W) / m) micro-batches of at most m
samples, sizes as even as possible.

The gradient stays the mean over the B samples: DeepSpeed divides each micro-batch's loss by A and
averages gradients over the W ranks, so a micro-batch of k samples whose loss is their mean is
weighted by k * W * A / B (`loss_weight`). With equal shares (B = W * A * m) every weight is 1.0.

Under heterogeneous model parallelism the ranks here are replicas, and faster replicas take more:
`speed_shares(B, speeds)` cuts B in proportion to each replica's speed, and `ElasticBatch(..., shares=...)`
serves those shares in the same global order (the sync of `ucp.hmp.grad_sync` weights each replica by
its share, so the step's gradient stays the mean over the B samples).

The `"elastic"` section itself is read here once, into one typed value (`ElasticSection`): the batch, the sizes the
layouts may take and the cost model's inputs, each refusal one line.

Pure: no torch, no DeepSpeed.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from ucp.errors import ConfigError
from ucp.storage.json_file import shown

BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# The "elastic" section: the batch, then the layouts the job may take, the cost model's inputs and whether
# unequal replicas may use ranks the layouts leave spare (ucp.elastic.layout_choice); how long a rank may be
# silent under ucp.elastic.run (ucp.elastic.inprocess).
SECTION_KEYS = ("global_batch", "micro_batch", "tensor_parallel", "pipeline_parallel", "expert_parallel", "model",
                "gpu_memory", "seq_len", "heterogeneous", "detect_s")
SIZE_KEYS = ("tensor_parallel", "pipeline_parallel")
# The default "detect_s": torchelastic's own rendezvous declares a node dead after 3 missed keep-alives of 5 s;
# a rank's beat comes from a thread of its own, so only a process that is stopped, stuck outside Python with the
# GIL held, or starved of CPU for that long misses it.
DEFAULT_DETECT_S = 15.0
MAX_GPU_MEMORY_GIB = 1 << 20   # a PiB per rank
MAX_SEQ_LEN = 1 << 24          # tokens per sample


@dataclass(frozen=True)
class ElasticBatch:
    """`global_batch` samples per optimizer step, in micro-batches of at most `micro_batch`, over `world` ranks;
    `shares` (one per rank, summing to `global_batch`) replaces the equal cut when given."""

    global_batch: int
    micro_batch: int
    world: int
    shares: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        for key in ("global_batch", "micro_batch", "world"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f'"ucp": {{"elastic": {{"{key}": {value!r}}}}}: must be a positive number of '
                                  + ("ranks" if key == "world" else "samples"))
        if self.global_batch < self.world:
            raise ConfigError(f'"ucp": {{"elastic": {{"global_batch": {self.global_batch}}}}} is smaller than the '
                              f"{self.world} ranks of this run: every rank needs at least one sample per step; "
                              "raise global_batch or run on fewer ranks")
        if self.shares is not None and (len(self.shares) != self.world or sum(self.shares) != self.global_batch
                                        or min(self.shares) < 1):
            raise ConfigError(f"shares {list(self.shares)}: need one positive share per rank ({self.world}) summing "
                              f"to the global batch {self.global_batch}")
        smallest = self.global_batch // self.world if self.shares is None else min(self.shares)
        if smallest < self.accumulation:
            largest = -(-self.global_batch // self.world) if self.shares is None else max(self.shares)
            takes = f"{smallest} or {smallest + 1}" if self.shares is None else f"from {smallest} to {largest}"
            raise ConfigError(
                f'"ucp": {{"elastic": {{"global_batch": {self.global_batch}, "micro_batch": {self.micro_batch}}}}} on '
                f"{self.world} ranks: ranks take {takes} samples, but every rank must run "
                f"{self.accumulation} micro-batches of at least one sample; use micro_batch "
                f"{-(-largest // smallest)} or more")

    @property
    def accumulation(self) -> int:
        """A: micro-batches per optimizer step, the same on every rank."""
        largest = -(-self.global_batch // self.world) if self.shares is None else max(self.shares)
        return -(-largest // self.micro_batch)

    @property
    def even(self) -> bool:
        """Every micro-batch of every rank holds the same number of samples, so every loss weight is 1.0."""
        return self.shares is None and self.global_batch % (self.world * self.accumulation) == 0

    def pipeline_problem(self) -> str | None:
        """Why a pipeline engine cannot take this batch (None when it can): DeepSpeed's `PipelineEngine` runs
        fixed-size micro-batches through its `loss_fn`, where `loss_weight` cannot reach."""
        if self.even:
            return None
        return (f'"ucp": {{"elastic": {{"global_batch": {self.global_batch}, "micro_batch": {self.micro_batch}}}}} '
                f"on {self.world} data-parallel ranks gives micro-batches of unequal size, which a PipelineModule "
                "engine cannot weigh (its loss_fn takes no loss_weight); choose a global_batch that each layout's "
                "data-parallel size cuts into equal micro-batches, e.g. a multiple of micro_batch x each such size")

    def share(self, rank: int) -> int:
        """Samples rank `rank` takes of each global batch."""
        if self.shares is not None:
            return self.shares[rank]
        return self.global_batch // self.world + (rank < self.global_batch % self.world)

    def offset(self, rank: int) -> int:
        """Where rank `rank`'s share starts within the global batch."""
        if self.shares is not None:
            return sum(self.shares[:rank])
        return rank * (self.global_batch // self.world) + min(rank, self.global_batch % self.world)

    def micro_sizes(self, rank: int) -> list[int]:
        """The sizes of rank `rank`'s A micro-batches of one step, each at least 1 and at most micro_batch."""
        share, a = self.share(rank), self.accumulation
        return [share // a + (j < share % a) for j in range(a)]

    def loss_weight(self, samples: int) -> float:
        """The factor for the mean loss of a micro-batch of `samples` samples (module docstring)."""
        return samples * self.world * self.accumulation / self.global_batch

    def deepspeed_keys(self) -> dict[str, int]:
        """DeepSpeed's batch keys for this world size (its train_batch_size is nominal: micro x A x W)."""
        a = self.accumulation
        return {"train_batch_size": self.micro_batch * a * self.world,
                "train_micro_batch_size_per_gpu": self.micro_batch, "gradient_accumulation_steps": a}

    @classmethod
    def from_config(cls, section: object, world: int, keys: tuple[str, ...] = SECTION_KEYS,
                    user: str = "") -> ElasticBatch:
        """The `"elastic"` section of the `"ucp"` config, for a run on `world` data-parallel ranks. `keys` are those
        the caller honours (`user` names it in the refusal of any other: the Trainer takes the batch keys only)."""
        if not isinstance(section, dict) or "global_batch" not in section or "micro_batch" not in section:
            raise ConfigError(f'"ucp": {{"elastic": {section!r}}}: needs "global_batch" (samples per optimizer step, '
                              'the same at every world size) and "micro_batch" (the most samples per forward pass), '
                              'e.g. {"global_batch": 256, "micro_batch": 4}')
        unknown = sorted(set(section) - set(SECTION_KEYS))
        if unknown:
            raise ConfigError(f'"ucp": {{"elastic": ...}}: unknown key {unknown[0]!r}; known: '
                              + ", ".join(f'"{k}"' for k in SECTION_KEYS))
        ignored = [k for k in SECTION_KEYS if k in section and k not in keys]
        if ignored:
            raise ConfigError(f'"ucp": {{"elastic": {{"{ignored[0]}": ...}}}}: {user} trains data-parallel only and '
                              "takes " + " and ".join(f'"{k}"' for k in keys) + f'; leave out "{ignored[0]}"')
        return cls(section["global_batch"], section["micro_batch"], world)


def allowed_sizes(section: dict[str, Any], key: str) -> tuple[int, ...]:
    """The sizes `"elastic": {key: ...}` allows (an int: that size alone; absent: 1), largest first."""
    value = section.get(key, 1)
    values = [value] if isinstance(value, int) and not isinstance(value, bool) else value
    if (not isinstance(values, list) or not values
            or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values)):
        raise ConfigError(f'"ucp": {{"elastic": {{"{key}": {value!r}}}}}: must be a size of at least 1 or a list '
                          'of them, e.g. [4, 2]')
    return tuple(sorted(set(values), reverse=True))


@dataclass(frozen=True)
class ElasticSection:
    """The `"elastic"` section of the `"ucp"` config, read and checked once (`from_config`): the batch, the sizes
    the job may use (`allowed_sizes`, largest first; `sizes_given` when the section lists any), the MoE layers'
    `expert_parallel`, whether unequal replicas may take the ranks a homogeneous layout leaves spare
    (`heterogeneous`), and the cost model's inputs (`model`, `gpu_memory`, `seq_len`). `ucp.elastic.ranks` chooses
    this start's layout from it and `batch` shares its global batch; nothing reads the raw section again."""

    global_batch: int
    micro_batch: int
    tensor_parallel: tuple[int, ...]
    pipeline_parallel: tuple[int, ...]
    sizes_given: bool
    expert_parallel: int
    heterogeneous: bool
    model: str | os.PathLike[str] | None
    gpu_memory: float | None
    seq_len: int
    detect_s: float = DEFAULT_DETECT_S

    @classmethod
    def from_config(cls, section: object) -> ElasticSection:
        """The section, each refusal one line naming its key."""
        ElasticBatch.from_config(section, 1)   # the batch keys are there, and no unknown key: a dict
        section = cast("dict[str, Any]", section)
        for key, kinds, most, fix in (("gpu_memory", (int, float), MAX_GPU_MEMORY_GIB, "GiB per rank, e.g. 80"),
                                      ("seq_len", (int,), MAX_SEQ_LEN, "tokens per sample, e.g. 4096")):
            value = section.get(key, 1)
            if isinstance(value, bool) or not isinstance(value, kinds) or not 0 < value <= most:
                what = "a number" if float in kinds else "an integer"
                raise ConfigError(f'"ucp": {{"elastic": {{"{key}": {shown(value)}}}}}: must be {what} above 0 and at '
                                  f"most {most}: {fix}")
        model = section.get("model")
        if "model" in section and not isinstance(model, (str, os.PathLike)):
            raise ConfigError(f'"ucp": {{"elastic": {{"model": {model!r}}}}}: must be the path of the model\'s '
                              'Hugging Face config.json, as `ucp plan --model` takes')
        sizes = allowed_sizes(section, "tensor_parallel"), allowed_sizes(section, "pipeline_parallel")
        experts = section.get("expert_parallel", 1)
        if not isinstance(experts, int) or isinstance(experts, bool) or experts < 1:
            raise ConfigError(f'"ucp": {{"elastic": {{"expert_parallel": {experts!r}}}}}: must be the ep_size of the '
                              "model's MoE layers, an int of at least 1")
        heterogeneous = section.get("heterogeneous", False)
        if not isinstance(heterogeneous, bool):
            raise ConfigError(f'"ucp": {{"elastic": {{"heterogeneous": {heterogeneous!r}}}}}: must be true or false')
        detect_s = section.get("detect_s", DEFAULT_DETECT_S)
        if isinstance(detect_s, bool) or not isinstance(detect_s, (int, float)) or not 0 < detect_s < 86400:
            raise ConfigError(f'"ucp": {{"elastic": {{"detect_s": {detect_s!r}}}}}: must be a number of seconds > 0 '
                              '(how long a rank may send no heartbeat before it is taken for hung; default '
                              f'{DEFAULT_DETECT_S:g})')
        return cls(section["global_batch"], section["micro_batch"], *sizes, any(k in section for k in SIZE_KEYS),
                   experts, heterogeneous, model, section.get("gpu_memory"), int(section.get("seq_len", 4096)),
                   float(detect_s))

    def batch(self, world: int) -> ElasticBatch:
        """The global batch shared by `world` data-parallel ranks."""
        return ElasticBatch(self.global_batch, self.micro_batch, world)


def speed_shares(global_batch: int, speeds: Sequence[float]) -> tuple[int, ...]:
    """`global_batch` samples cut by `speeds` (one per replica): one sample each, the rest in proportion.

    Largest remainder: each replica takes the floor of its exact part of the rest, then the replicas
    with the largest remainders (first ones on ties) take one more.
    """
    if not speeds or any(not (0 < s < math.inf) for s in speeds):
        raise ConfigError(f"speeds {list(speeds)}: need one positive, finite speed per replica")
    if global_batch < len(speeds):
        raise ConfigError(f"global batch {global_batch} is smaller than the {len(speeds)} replicas: every replica "
                          "needs at least one sample per step; raise the global batch")
    spare = global_batch - len(speeds)  # one sample each first, the rest by speed
    exact = [spare * s / sum(speeds) for s in speeds]
    shares = [1 + math.floor(e) for e in exact]
    by_remainder = sorted(range(len(speeds)), key=lambda i: (-(exact[i] - math.floor(exact[i])), i))
    for i in by_remainder[:global_batch - sum(shares)]:
        shares[i] += 1
    return tuple(shares)


def zero_stage(config: object) -> int:
    """DeepSpeed's ZeRO stage in a config dict (0 where it sets none), checked: one line for anything else."""
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    stage = zero.get("stage", 0) if isinstance(zero, dict) else 0
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f'"zero_optimization": {{"stage": {shown(stage)}}}: must be 0, 1, 2 or 3 (the ZeRO stage '
                          "DeepSpeed partitions by, which ucp's layouts and cost model plan for)")
    return int(stage)
