"""This process's place in an elastic 3D job: `layout(config)` once per start, then `spare_loop()`.

    ucp.elastic.init_distributed()
    place = ucp.elastic.layout(config)     # the same T x P x D on every rank (ucp.elastic.layout_choice)
    ucp.elastic.spare_loop()               # a spare waits here until the next restart; training ranks go on
    model = build_model(tp=place.tp, pp=place.pp)
    engine, *_ = ucp.deepspeed.initialize(model=model, config=config, ...)

With spares, the training ranks (0 .. D*T*P - 1) take a process group of their own as the default one, so that
DeepSpeed, which builds its groups from the default group, sees only them; a spare joins no group. A spare waits
until training rank 0 says the run ended cleanly (`release_spares`, called by `ucp.deepspeed.finish` and at exit)
and then exits 0; at any restart before that (a node lost or joining) torchrun's agent ends it with the others, and
the next start counts it as a rank like any other. A spare that loses the job's store (hosted by training rank 0)
before the release exits 1: its agent then restarts with the nodes left instead of leaving the job as finished.

When the config has a memory tier (`"save": {"memory": ...}`), every rank, spares included, also joins a gloo group
of the whole world (`spare_copies`) before the split: over it the training ranks send the spares each memory
checkpoint, so that a spare's node holds a copy that can serve the next restart (`ucp.deepspeed.memory.spare`, which
registers that duty here with `on_spare`: this layer cannot import the DeepSpeed one).
"""
from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ucp.elastic.layout_choice import (
    Choice,
    CostModelInputs,
    RankLayout,
    choose_layout,
    cost_model_replicas,
    cost_model_step_time,
    heads_problem,
    heterogeneous_choice,
)
from ucp.elastic.shares import ElasticSection, zero_stage
from ucp.errors import ConfigError

logger = logging.getLogger("ucp.elastic")
GIB = 1 << 30
_RELEASED = "ucp/elastic/spares_released"   # in the job's store: set by training rank 0 when the run ends cleanly
_POLL_S = 0.5
_ACK_TIMEOUT = timedelta(seconds=30)
_COPY_TIMEOUT = timedelta(minutes=30)   # a memory checkpoint's transfer to a spare

_chosen: RankLayout | None = None
_chosen_for: tuple[ElasticSection, object] | None = None   # the section it was chosen for, and the group then
_store: dist.Store | None = None
_copies: SpareCopies | None = None


@dataclass(frozen=True)
class SpareCopies:
    """The channel of the memory tier's copies to the spares: a gloo group of the whole world (ranks as in the
    world: training ranks first, then the spares) and a store both sides see."""

    group: Any   # a ProcessGroupGloo outside torch.distributed's registry: use its own send/recv
    store: dist.Store
    training: int
    world: int

    @property
    def spares(self) -> range:
        return range(self.training, self.world)


# What a spare does while it waits, besides waiting: each duty is called once with the layout, the config the start
# was chosen for (the DeepSpeed config given to `layout`, or what `ucp.deepspeed.initialize` read of it) and the
# channel, and returns what to call at every poll (None: nothing to do).
SpareDuty = Callable[[RankLayout, Any, SpareCopies], Callable[[], None] | None]
_duties: list[SpareDuty] = []
_config: object = None


def layout(config: dict[str, Any] | None = None, module: Any = None) -> RankLayout:
    """This start's layout and this rank's place in it.

    With a DeepSpeed `config` (its `"ucp": {"elastic": ...}` section), chosen on the first call of the start and
    applied to the process groups (module docstring); `module` gives the model's shape to the cost model when it
    has a Hugging Face config. Without arguments, the layout chosen before (by `layout(config)` or by
    `ucp.deepspeed.initialize`, which reads the section once and calls `start_layout`)."""
    if config is None:
        if _chosen is not None:
            return _chosen
        raise ConfigError('ucp.elastic.layout(): no layout chosen yet; pass the DeepSpeed config with its '
                          '"ucp": {"elastic": ...} section, or call it after ucp.deepspeed.initialize')
    if not isinstance(config, dict):
        raise ConfigError(f"ucp.elastic.layout(config): config is a {type(config).__name__}, not the DeepSpeed "
                          'config dict with its "ucp": {"elastic": ...} section')
    options = config.get("ucp")
    section = options.get("elastic") if isinstance(options, dict) else None
    if not isinstance(options, dict) or not isinstance(section, dict):
        raise ConfigError('ucp.elastic.layout(config): the config has no "ucp": {"elastic": {...}} section')
    save = options.get("save")
    return start_layout(ElasticSection.from_config(section), module, zero_stage(config),
                        isinstance(save, dict) and "memory" in save, config)


def start_layout(section: ElasticSection, module: Any, zero_stage: int, memory_tier: bool,
                 config: object) -> RankLayout:
    """`layout` for a checked `"elastic"` section: chosen on the first call of the start (a later call for the same
    section returns it), with DeepSpeed's `zero_stage` for the cost model; with `memory_tier`, the spares keep the
    memory tier's copies, and `config` is what their duties are given (`on_spare`)."""
    global _chosen, _chosen_for, _copies, _config
    if _chosen is not None and _chosen_for == (section, _group()):
        return _chosen
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    inputs = _cost_model_inputs(section, zero_stage, module)
    step_time = cost_model_step_time(*inputs) if inputs is not None else None
    sizes = section.tensor_parallel, section.pipeline_parallel
    if section.heterogeneous:
        if section.expert_parallel > 1:
            raise ConfigError('"ucp": {"elastic": {"heterogeneous": true, "expert_parallel": ...}}: unequal replicas '
                              "do not train MoE expert parallelism yet; leave out one of the two")
        plan = cost_model_replicas(*inputs, *sizes) if inputs is not None else None
        choice = heterogeneous_choice(world, *sizes, section.global_batch, section.micro_batch, step_time, plan,
                                      heads_problem(inputs[0]) if inputs is not None else None)
    else:
        choice = choose_layout(world, *sizes, section.global_batch, section.micro_batch, step_time,
                               section.expert_parallel)
    _chosen = RankLayout.of(choice, rank)
    if rank == 0:
        logger.warning("ucp: %d ranks: %s%s", world, _chosen.described,
                       f", {choice.spares} spare(s)" if choice.spares else "")
    _copies, _config = None, config
    if choice.spares and dist.is_initialized():
        _leave_spares_out(choice, rank, memory_tier)
    _chosen_for = (section, _group())
    return _chosen


def spare_loop() -> None:
    """On a spare: log one line and wait until the run ends (then exit 0) or torchrun restarts it; on a training
    rank (or before any layout was chosen): return at once."""
    if _chosen is None or _chosen.role != "spare":
        return
    _wait_as_spare(_chosen)


def spare_copies() -> SpareCopies | None:
    """The channel to this start's spares, when it has spares and a memory tier."""
    return _copies


def on_spare(duty: SpareDuty) -> None:
    """Register what a spare does while it waits (module docstring)."""
    if duty not in _duties:
        _duties.append(duty)


def release_spares() -> None:
    """On training rank 0 of a job with spares: tell them the run ended cleanly, so that they exit 0 too."""
    if _chosen is not None and _chosen.rank == 0 and _chosen.choice.spares and _store is not None:
        try:
            _store.set(_RELEASED, "1")
            # rank 0 hosts the store: it stays until every spare has read the news (or 30 s, for one that is gone)
            _store.wait([f"{_RELEASED}/{r}" for r in range(_chosen.choice.training, _chosen.world)], _ACK_TIMEOUT)
        except (RuntimeError, dist.DistError):  # the store is gone already, or a spare did not answer
            pass


def _group() -> object:
    """The default process group now (a later start in the same process has another)."""
    return dist.group.WORLD if dist.is_initialized() else None


def _leave_spares_out(choice: Choice, rank: int, memory_tier: bool) -> None:
    """The training ranks take a default process group of their own; the spares keep only the store (and, with a
    memory tier, the channel of its copies)."""
    global _store, _copies
    from torch.distributed.distributed_c10d import _get_default_store

    _store = _get_default_store()
    backend = dist.get_backend()
    world = dist.get_world_size()
    dist.barrier()   # every rank has its choice before the group goes away
    if memory_tier:
        store = dist.PrefixStore(f"ucp/copies{world}", _store)
        _copies = SpareCopies(dist.ProcessGroupGloo(store, rank, world, _COPY_TIMEOUT), store, choice.training, world)
    dist.destroy_process_group()
    if rank < choice.training:
        dist.init_process_group(backend, store=dist.PrefixStore(f"ucp/train{choice.training}", _store), rank=rank,
                                world_size=choice.training)
        os.environ["WORLD_SIZE"] = str(choice.training)   # DeepSpeed reads it next to the group
        atexit.register(release_spares)


def _wait_as_spare(place: RankLayout) -> NoReturn:
    logger.warning("ucp: rank %d of %d is a spare (layout tensor_parallel %d x pipeline_parallel %d x data_parallel "
                   "%d uses %d ranks): it waits for the next restart", place.rank, place.world, place.tp, place.pp,
                   place.dp, place.choice.training)
    polls = [poll for duty in _duties if _copies is not None and _config is not None
             for poll in [duty(place, _config, _copies)] if poll is not None]
    released = False
    while True:
        try:
            for poll in polls:
                poll()   # before the release: the run's last memory checkpoint is sent before training ends
            if _store is None or _store.check([_RELEASED]):
                if _store is not None:
                    _store.set(f"{_RELEASED}/{place.rank}", "1")
                released = True
                break
        except (RuntimeError, dist.DistError) as exc:
            # The store (hosted by training rank 0) or a peer is gone before rank 0 said the run ended: a node was
            # lost. Exit 0 here would tell this node's agent that the job finished, and it would leave the job;
            # a failure makes it restart with the nodes left.
            logger.warning("ucp: spare rank %d lost the job before the run ended (%s): it ends for the restart",
                           place.rank, exc)
            break
        time.sleep(_POLL_S)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0 if released else 1)   # no process group to tear down; nothing of the training to finalize


def _cost_model_inputs(section: ElasticSection, zero_stage: int, module: Any) -> CostModelInputs | None:
    """What the cost model needs (`cost_model_step_time`, `cost_model_replicas`) where the section lists
    model-parallel sizes and the model's shape is known (`"model"`, or the module's Hugging Face config of a shape
    `ucp plan` reads), else None."""
    from ucp.hmp.model_shapes import ModelConfig, ModelConfigError, load_model_config

    if not section.sizes_given:
        return None   # data parallelism only: one layout, as before layouts were chosen
    if section.model is not None:
        model = load_model_config(section.model)
    elif hasattr(getattr(module, "config", None), "to_dict"):
        try:
            model = ModelConfig.from_hf(module.config.to_dict(), name=type(module).__name__)
        except ModelConfigError:   # not a Llama/Qwen2/Mistral-shaped config: no estimate, the next rule decides
            return None
    else:
        return None
    gpu_memory = section.gpu_memory or _smallest_memory_gib()
    return (model, float(gpu_memory), section.global_batch, section.micro_batch, section.seq_len, zero_stage)


def _smallest_memory_gib() -> float:
    """The accelerator's memory (host memory shared by the node's ranks on CPU), the smallest over all ranks, so
    that every rank takes the same choice."""
    if torch.cuda.is_available():
        mine = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        mine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB / local
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = torch.tensor([mine], dtype=torch.float64)
        dist.all_reduce(box, op=dist.ReduceOp.MIN)
        mine = float(box.item())
    return mine
