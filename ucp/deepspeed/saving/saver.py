"""Asynchronous saves of a live DeepSpeed engine, straight into the atomic format.

    ucp.deepspeed.save(engine, "/ckpt/ucp")   # writes /ckpt/ucp/global_step<N>; returns at once
    ucp.deepspeed.wait(engine)                # the save is durable and committed once this returns

The `Saver` of an engine holds its saving group (every rank of the data-parallel group; of the whole job under
AutoTP, a pipeline, MoE or HMP), the save in flight and the snapshot buffers. A save, on every rank of that group:

1. (training thread) copies exactly what this rank writes into its snapshot buffer
   (`ucp.deepspeed.saving.snapshot`); rank 0 also takes the step, hyper-parameters, scheduler and client state
   (`ucp.deepspeed.saving.metadata`). Then training goes on.
2. (writer thread) writes the snapshot into the data files, whose arrangement every rank computes alike
   (`ucp.deepspeed.saving.files`), and reports per-piece CRCs to rank 0 (`ucp.deepspeed.saving.stores`: a local
   folder, or an object store through uploads).
3. (rank 0's writer) when every rank reported success: puts the data files in place, commits the index
   (`ucp.deepspeed.saving.index`), then points `<dir>/latest` at the new tag, and tells the other ranks the outcome.

When an engine saves, and what else its checkpoint life holds (retention, the memory tier's cadence, progress),
is `ucp.deepspeed.life`; `ucp.deepspeed.save` and `ucp.deepspeed.wait` are there too.

Each checkpoint has its own folder `<dir>/<tag>`, and `latest` moves only after its index is
committed, so a crash, a killed process or a full disk mid-save leaves the previous checkpoint the
latest and loadable, and the new folder without an index ("incomplete checkpoint at ...").
"""
from __future__ import annotations

import atexit
import logging
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ucp import collectives
from ucp.deepspeed.engine.autotp import tp_size, with_tensor_parallel
from ucp.deepspeed.engine.placement import engine_hmp
from ucp.deepspeed.engine.targets import Target, target_for
from ucp.deepspeed.saving.hmp import place_target
from ucp.deepspeed.saving.layout import average_partials, mpu_tp_size, refuse_unsupported
from ucp.deepspeed.saving.metadata import metadata
from ucp.deepspeed.saving.snapshot import Prepared, Preparing, copy_into, every_holding, prepare
from ucp.deepspeed.saving.stores import write_local, write_object
from ucp.deepspeed.saving.writer import BackgroundSave
from ucp.elastic.inprocess import when_leaving
from ucp.errors import ConfigError, OutputExistsError, SaveError
from ucp.format.folder import INDEX_NAME
from ucp.format.save_folder import claim_tag
from ucp.storage.layer import absolute, is_file, is_remote
from ucp.storage.locations import Location

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

logger = logging.getLogger("ucp.save")


@dataclass
class SaveStats:
    """One save as this rank saw it."""

    tag: str
    path: str
    snapshot_s: float = 0.0   # training was held this long (waiting for a previous save included)
    bytes: int = 0            # this rank's share, written by its writer thread
    durable_s: float = 0.0    # from the save call until the index was committed (0 while in flight)


class MemoryWriter(Protocol):
    """The host-memory tier as a saver sees it (`ucp.deepspeed.memory.tier.MemoryTier`)."""

    dir: Path
    last_step: int | None
    job: BackgroundSave

    def write(self, saver: Saver, prepared: Prepared, tag: str, meta: dict[str, Any] | None,
              event: torch.cuda.Event | None) -> None: ...


class Saver:
    """Saves one engine: its process group, the arrangement of its files, snapshot buffer and the save in flight."""

    def __init__(self, engine: DeepSpeedEngine):
        refuse_unsupported(engine)
        self.engine = engine
        self.target: Target = with_tensor_parallel(target_for(engine))
        hmp = engine_hmp(engine)
        if hmp is not None:  # each rank's slices of the layout; the whole job saves one checkpoint
            place_target(self.target, hmp, collectives.rank())
        self.before_snapshot = average_partials(engine, self.target)  # collectives every snapshot needs first
        self.rank = collectives.rank()
        if not dist.is_initialized():
            self.ranks = [0]
        elif (tp_size(engine) > 1 or mpu_tp_size(engine) > 1 or getattr(engine, "pipeline_parallelism", False)
              or getattr(engine, "has_moe_layers", False) or hmp is not None):  # the whole job saves one checkpoint
            self.ranks = list(range(dist.get_world_size()))
        elif self.target.dp_group is not None:
            self.ranks = dist.get_process_group_ranks(self.target.dp_group)
        else:
            self.ranks = list(range(dist.get_world_size()))
        self.leader = self.rank == self.ranks[0]  # builds the index and commits
        # A group of its own: the writer thread's collectives must never interleave with training's.
        self.group = dist.new_group(self.ranks, backend="gloo") if len(self.ranks) > 1 else None
        self.job = BackgroundSave()
        self.last_step: int | None = None
        self.stats: SaveStats | None = None
        self.after_commit: Callable[[Location], None] | None = None  # on rank 0, after each commit (retention)
        self.memory: MemoryWriter | None = None  # the host-memory tier, when the config has one
        self._prepared: dict[str, Prepared] = {}  # per tier ("disk", "memory"): each has a buffer of its own
        self._preparing: dict[str, Preparing] = {}  # per tier: the next layout, prepared ahead (`prepare_ahead`)
        _LIVE.add(self)

    def save(self, save_dir: Location, tag: str | None = None,
             client_state: dict[str, Any] | None = None, async_: bool = True) -> SaveStats:
        began = time.perf_counter()
        tag = tag or f"global_step{self.engine.global_steps}"
        self.job.wait_turn(tag)  # the buffer is reused: let the previous save finish (raises its failure)
        folder = absolute(save_dir)
        tag_dir = folder / tag
        if is_file(tag_dir / INDEX_NAME):
            raise OutputExistsError(f"{tag_dir}: already holds a committed checkpoint; pass another tag or delete it")
        prepared, meta, event, stats = self._snapshot("disk", tag, tag_dir, client_state)
        self.last_step = self.engine.global_steps
        self.stats = stats

        def work() -> None:
            if is_remote(folder):
                write_object(self, prepared, folder, tag, meta, event)
            else:
                write_local(self, prepared, folder, tag, meta, event)
            stats.durable_s = time.perf_counter() - began

        stats.snapshot_s = time.perf_counter() - began
        self.job.start(tag, work)
        if not async_:
            self.job.wait()
        return stats

    def save_memory(self, client_state: dict[str, Any] | None = None) -> SaveStats:
        """A save into the host-memory tier (`ucp.deepspeed.memory.tier`), in the background like `save`, with a
        snapshot buffer, writer thread and gloo group of its own: it never waits for a disk save in flight."""
        began = time.perf_counter()
        tier = self.memory
        if tier is None:
            raise ConfigError('no memory tier: add "memory": {"every": k} to "ucp": {"save": ...}')
        tag = f"global_step{self.engine.global_steps}"
        tier.job.wait_turn(tag)
        prepared, meta, event, stats = self._snapshot("memory", tag, tier.dir / tag, client_state)
        tier.last_step = self.engine.global_steps

        def work() -> None:
            tier.write(self, prepared, tag, meta, event)
            stats.durable_s = time.perf_counter() - began

        stats.snapshot_s = time.perf_counter() - began
        tier.job.start(tag, work)
        return stats

    def _snapshot(self, tier: str, tag: str, tag_dir: Location, client_state: dict[str, Any] | None
                  ) -> tuple[Prepared, dict[str, Any] | None, torch.cuda.Event | None, SaveStats]:
        """Copy this rank's pieces into the snapshot buffer (and on rank 0 take the metadata); training goes on
        once this returns."""
        claim_tag(tag_dir, self.leader)  # a save writes only into a folder of its own (ucp.format.save_folder)
        prepared = self._prepare(tier)
        event = copy_into(prepared, self.before_snapshot)
        meta = (metadata(self.engine, self.target, len(self.ranks), prepared, tag, tag_dir, client_state)
                if self.leader else None)
        stats = SaveStats(tag, str(tag_dir), bytes=prepared.buffer.nbytes)
        return prepared, meta, event, stats

    def wait(self) -> SaveStats | None:
        """Wait for the disk save in flight, and the memory save (its stats are the disk save's)."""
        try:
            self.job.wait()
        finally:
            if self.memory is not None:
                self.memory.job.wait()
        return self.stats

    # -- files and buffer, rebuilt only when the optimizer's states change (e.g. after the first step)

    def prepare_ahead(self) -> None:
        """Start laying out the files and allocating the snapshot buffer of each tier whose optimizer states
        changed (the moments appear at the first optimizer step), on a thread of its own: the first save then
        finds them ready instead of stalling training for them. Collective (every rank of the saving group calls
        it after the same step); gathers what every rank holds, which is small, on the training thread."""
        moments = tuple(self.target.state_names())
        if not moments:
            return  # before the first step: the layout would change at once
        stale = [tier for tier in ("disk", "memory") if (tier == "disk" or self.memory is not None)
                 and self._moments_of(tier) != moments]
        if not stale:
            return
        every = every_holding(self.target, self.rank, self.ranks, moments, alone=self.group is None)
        for tier in stale:
            self._preparing[tier] = Preparing(moments, partial(prepare, self.engine, self.target, moments, self.rank,
                                                               self.leader, every))

    def _moments_of(self, tier: str) -> tuple[str, ...] | None:
        """The optimizer states of the tier's newest layout, prepared or under way."""
        preparing = self._preparing.get(tier)
        if preparing is not None:
            return preparing.moments
        known = self._prepared.get(tier)
        return known.moments if known is not None else None

    def _prepare(self, tier: str) -> Prepared:
        moments = tuple(self.target.state_names())
        known = self._prepared.get(tier)
        preparing = self._preparing.pop(tier, None)
        if preparing is None and known is not None and known.moments == moments:
            return known
        self._prepared.pop(tier, None)  # free the old buffer (no save of this tier is in flight)
        if preparing is not None and preparing.moments == moments:
            prepared = preparing.result()  # waits only if the first save comes before the thread is done
        else:
            every = every_holding(self.target, self.rank, self.ranks, moments, alone=self.group is None)
            prepared = prepare(self.engine, self.target, moments, self.rank, self.leader, every)
        self._prepared[tier] = prepared
        return prepared


_LIVE: weakref.WeakSet[Saver] = weakref.WeakSet()


def wait_all() -> list[SaveError]:
    """Wait for every engine's save in flight; the failures, each logged (at exit, and by `finish`)."""
    failed = []
    for saver in list(_LIVE):
        try:
            saver.wait()
        except SaveError as exc:
            logger.error("ucp: at exit: %s", exc)
            failed.append(exc)
    return failed


def abandon_all() -> None:
    """Forget every engine's saver (`ucp.elastic.run`, leaving a broken world once their threads have ended): the
    exit no longer waits for them, and their failures, the lost world's, are not raised again."""
    _LIVE.clear()


def _wait_at_exit() -> None:
    """At exit, wait for the saves in flight, unless the process ends on an uncaught error: its peers may be gone or
    wait for this rank, so the save's collectives could block for the group's whole timeout and, with them, the
    restart of the job (the peers' next collective fails once this process is gone). The save is not committed;
    the previous checkpoint stays the newest."""
    if getattr(sys, "last_value", None) is not None:   # set by the interpreter for an uncaught exception
        if _LIVE:
            logger.warning("ucp: the process ends on an error: a save still in flight is abandoned, not committed")
        return
    wait_all()


atexit.register(_wait_at_exit)
when_leaving(abandon_all)
