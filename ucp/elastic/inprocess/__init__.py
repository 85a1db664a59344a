"""`ucp.elastic.run(train)`: the survivors of a fault keep training in the same process.

    def train():                  # builds the model, ucp.deepspeed.initialize(... "load": "auto" ...), trains
        ...
    ucp.elastic.run(train)        # in place of ucp.elastic.init_distributed(); train()

`run` makes the process group (as `init_distributed`) and calls `train()`. When a rank is lost, every survivor:

1. sees it: a collective fails (the peer's connections closed), or the heartbeat (`heartbeat`) finds
   a rank silent for `"elastic": {"detect_s": N}` seconds; the first to see it writes the world's fault key, and
   every rank that reads it cuts its connections to the peers (`connections`), so that no thread of
   the survivors stays blocked in a collective;
2. leaves the world: the save threads end (a save whose collectives had all run commits whole, one cut short
   fails and is not committed: the previous checkpoint stays the newest), every process group is aborted
   (torch's, DeepSpeed's, ucp's), DeepSpeed's global communication state is reset, the old engine is collected;
3. meets the other survivors in the job's store (the rendezvous endpoint that `ucp-torchrun` hands its workers,
   which outlives any one node, the old round's store host included): each survivor arrives, and the first to
   see every rank of the old world either arrived or silent closes the new world (the arrived ranks, in their
   old order); its new rank 0 starts the world's own store (as `init_distributed` does for each round);
4. calls `train()` again: `"load": "auto"` loads the newest complete checkpoint (the memory tier's, own node's
   copy and the peers', where newer than disk) at the new world size; the report line says what it cost.

Anything else (a second fault during the regroup, no checkpoint to load, a save thread or a group that cannot
be left, a survivor that arrives after the others closed the new world) ends that rank with exit code 1 and
one line saying why; the launcher's process restart takes over (`ucp-torchrun`'s agents restart the job's
processes as before). Under torchrun's agents the survivors are not restarted by their agents: an agent
restarts its workers when they fail or when a new node waits to join, not when another node is lost.
"""
from __future__ import annotations

import gc
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch.distributed as dist

from ucp.elastic.inprocess.connections import cut_peer_connections
from ucp.elastic.inprocess.heartbeat import Heartbeat, beat_key
from ucp.elastic.rendezvous import init_distributed
from ucp.elastic.shares import DEFAULT_DETECT_S
from ucp.errors import ConfigError

logger = logging.getLogger("ucp.elastic")

STORE_ENV = "UCP_ELASTIC_STORE"   # "HOST:PORT" of the job's store: ucp-torchrun's rendezvous endpoint
RUN_ENV = "UCP_ELASTIC_RUN"       # the rendezvous id: the job's keys in that store
REGROUP_S = 120.0      # the most a regroup may take (a slow survivor's teardown included) before it is given up
SAVE_THREADS_S = 60.0  # the most the save threads of the lost world may take to end
FAULT_TEXTS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "pair.cc", "Socket Timeout",
               "Timed out waiting")

T = TypeVar("T")

_detect_s = DEFAULT_DETECT_S
_restart: Restart | None = None   # the in-process restart whose first step is still to come


@dataclass(frozen=True)
class Restart:
    """An in-process restart, for its report (`ucp.deepspeed.life.StepBook`)."""

    old_world: int
    new_world: int
    fault_seen: float   # time.time() when this rank saw the fault
    regrouped: float    # time.time() when the new world's group was made (train() called again)


def started(detect_s: float | None, loaded: bool) -> Restart | None:
    """Called once per start by `ucp.deepspeed.initialize`, its engine built and loaded: the heartbeat takes the
    config's `"elastic": {"detect_s": N}` (None: keep it) from the next beat on, and the in-process restart not yet
    reported is handed over, once, for the restart report. After an in-process restart, a start that found no
    checkpoint to load (`loaded` False) would not continue the run: this rank exits 1 and the launcher decides."""
    global _detect_s, _restart
    if detect_s is not None:
        _detect_s = detect_s
        if _heartbeat is not None:
            _heartbeat.detect_s = detect_s
    restart, _restart = _restart, None
    if restart is not None and not loaded:
        give_up("no complete checkpoint to continue from (neither the memory tier nor the save folder has one)")
    return restart


_heartbeat: Heartbeat | None = None


_leaving: list[Callable[[], None]] = []


def when_leaving(forget: Callable[[], None]) -> None:
    """Call `forget` when a broken world is left, once its save threads have ended (the layers above this one
    register what they hold of the old world: `ucp.deepspeed.saving.saver` its savers)."""
    _leaving.append(forget)


@dataclass
class World:
    """One world of the job: its id (its keys in the job's store), this rank and the size."""

    id: str
    rank: int
    size: int


def run(train: Callable[[], T], backend: str | None = None) -> T:
    """Make the process group and call `train()`; after a lost rank, call it again in the same process at the
    world size left (module docstring). Returns what the last `train()` returned."""
    global _heartbeat, _restart
    host, port, job = _job_store()
    init_distributed(backend)
    backend = dist.get_backend()
    world = World(_first_world_id(), dist.get_rank(), dist.get_world_size())
    store = _client(host, port)
    while True:
        beat = Heartbeat(_client_keys(host, port, job, world), world.rank, world.size, _detect_s,
                         lambda reason: _cut(port))
        _heartbeat = beat
        beat.start()
        try:
            result = train()
        except Exception as exc:   # noqa: BLE001 - which faults are a lost peer is decided just below
            fault_seen = time.time()
            reason = beat.fault or _peer_fault(exc)
            if reason is None:
                beat.stop()
                raise
            del exc   # its traceback holds the old engine
            reason = beat.declare(f"rank {world.rank}: {reason}")
        else:
            beat.stop(finished=True)
            _heartbeat = None
            return result
        logger.warning("ucp: rank %d of %d: the world is broken (%s); leaving it, regrouping in the same process",
                       world.rank, world.size, reason)
        _leave()
        old = world
        world = _regroup(store, job, old, beat, backend)
        beat.stop()
        _restart = Restart(old.size, world.size, fault_seen, time.time())


def _job_store() -> tuple[str, int, str]:
    where, job = os.environ.get(STORE_ENV, ""), os.environ.get(RUN_ENV, "")
    host, _, port = where.rpartition(":")
    if not host or not port.isdigit() or not job:
        raise ConfigError(f"ucp.elastic.run: {STORE_ENV}={where!r}, {RUN_ENV}={job!r} in the environment: launch "
                          "with ucp-torchrun and --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT --rdzv-id=ID (the "
                          "survivors of a fault meet in that store)")
    return host, int(port), job


def _client(host: str, port: int) -> dist.Store:
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=REGROUP_S))


def _keys(store: dist.Store, job: str, world: World | str) -> dist.Store:
    return dist.PrefixStore(f"ucp/inprocess/{job}/{world.id if isinstance(world, World) else world}", store)


def _client_keys(host: str, port: int, job: str, world: World) -> dist.Store:
    """The world's keys through a connection of their own (the heartbeat thread's)."""
    return _keys(_client(host, port), job, world)


def _first_world_id() -> str:
    """An id every rank of this start's group shares (rank 0's)."""
    ids = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(ids, src=0)
    return str(ids[0])


def _cut(store_port: int) -> None:
    cut_peer_connections({store_port})


def _peer_fault(exc: BaseException) -> str | None:
    """The line of `exc` (or its causes) that says a peer's connection failed, or None: not a lost peer."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        text = str(seen)
        if isinstance(seen, (RuntimeError, OSError)) and any(t in text for t in FAULT_TEXTS):
            line = next((x for x in text.splitlines() if any(t in x for t in FAULT_TEXTS)), text)
            return f"{type(seen).__name__}: {line.split(' This is typically')[0].strip()[:300]}"   # gloo's advice
        seen = seen.__cause__ or seen.__context__
    return None


def give_up(reason: str) -> None:
    """End this rank with exit code 1 and one line; the launcher restarts the processes (nothing else runs: the
    old world's threads and atexit handlers could wait on peers that are gone)."""
    print(f"ucp: in-process restart failed: {reason}; exiting with 1 so that the launcher restarts the processes",
          file=sys.stderr, flush=True)
    for handler in logging.getLogger().handlers + logger.handlers:
        handler.flush()
    os._exit(1)


def _leave() -> None:
    """Leave the broken world: end the save threads, abort every process group, reset DeepSpeed's global
    communication state (module docstring, 2)."""
    deadline = time.monotonic() + SAVE_THREADS_S
    for thread in threading.enumerate():
        if thread.name.startswith("ucp-save"):
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                give_up(f"save thread {thread.name} of the lost world did not end within {SAVE_THREADS_S:.0f} s")
    for forget in _leaving:
        forget()
    aborted = threading.Thread(target=_abort_groups, name="ucp-abort", daemon=True)
    aborted.start()
    aborted.join(timeout=REGROUP_S / 4)
    if aborted.is_alive() or dist.is_initialized():
        give_up(f"the process groups of the lost world could not be left within {REGROUP_S / 4:.0f} s")
    _reset_deepspeed()
    gc.collect()


def _abort_groups() -> None:
    try:
        dist.distributed_c10d._abort_process_group()
    except (RuntimeError, ValueError, dist.DistError):
        pass
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError, dist.DistError):
            pass


_DEEPSPEED_GROUPS = {"_EXPERT_PARALLEL_GROUP": dict, "_EXPERT_PARALLEL_GROUP_RANKS": dict,
                     "_EXPERT_DATA_PARALLEL_GROUP": dict, "_EXPERT_DATA_PARALLEL_GROUP_RANKS": dict,
                     "_ALL_TO_ALL_GROUP": dict, "_WORLD_GROUP": None, "_ZERO_PARAM_INTRA_PARALLEL_GROUP": None,
                     "_TENSOR_MODEL_PARALLEL_GROUP": None, "_MODEL_PARALLEL_GROUP": None,
                     "_DATA_PARALLEL_GROUP": None, "_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE": None,
                     "_MPU_TENSOR_MODEL_PARALLEL_RANK": None, "mpu": None}


def _reset_deepspeed() -> None:
    """DeepSpeed's module-level state of the old world: its communication backend (`deepspeed.comm.cdb`, which
    holds the old default group) and the groups of `deepspeed.utils.groups`, as a fresh import has them."""
    if "deepspeed" not in sys.modules:
        return
    import deepspeed.comm.comm as ds_comm
    import deepspeed.utils.groups as ds_groups

    ds_comm.cdb = None
    for name, fresh in _DEEPSPEED_GROUPS.items():
        if hasattr(ds_groups, name):
            setattr(ds_groups, name, fresh() if fresh is dict else None)


def _regroup(store: dist.Store, job: str, old: World, beat: Heartbeat, backend: str) -> World:
    """Meet the other survivors of `old` in the job's store and make the new world's process group."""
    began = time.monotonic()
    keys = _keys(store, job, old)
    arrival = keys.add("arrived", 1)
    keys.set(f"arrival/{arrival}", str(old.rank))
    logger.warning("ucp: rank %d of %d waits for the other survivors (arrival %d)", old.rank, old.size, arrival)
    decision = _close(keys, old, beat, began)
    new_id, count = decision.split()
    members = sorted(int(keys.get(f"arrival/{i}")) for i in range(1, int(count) + 1))
    if old.rank not in members:
        give_up(f"rank {old.rank} arrived after the other survivors had regrouped without it")
    beat.watch(members)
    world = World(new_id, members.index(old.rank), len(members))
    new_keys = _keys(store, job, new_id)
    try:
        if world.rank == 0:
            own = dist.TCPStore("0.0.0.0", 0, world.size, is_master=True, wait_for_workers=False,
                                timeout=timedelta(seconds=REGROUP_S))
            new_keys.set("store", f"{socket.getfqdn()} {own.port}")
        else:
            _wait(new_keys, "store", beat, began)
            where, port = new_keys.get("store").decode().split()
            own = dist.TCPStore(where, int(port), world.size, is_master=False, timeout=timedelta(seconds=REGROUP_S))
        new_keys.set(f"ready/{world.rank}", "1")
        for r in range(world.size):
            _wait(new_keys, f"ready/{r}", beat, began)
        os.environ.update(RANK=str(world.rank), WORLD_SIZE=str(world.size))   # DeepSpeed reads them beside the group
        dist.init_process_group(backend, store=own, rank=world.rank, world_size=world.size)
    except (RuntimeError, dist.DistError, ValueError) as exc:
        give_up(beat.second_fault or f"the new world of {world.size} ranks could not be made: {exc}")
    if beat.second_fault:
        give_up(beat.second_fault)
    logger.warning("ucp: rank %d of %d is rank %d of %d survivors (regrouped in %.1f s)", old.rank, old.size,
                   world.rank, world.size, time.monotonic() - began)
    return world


def _close(keys: dist.Store, old: World, beat: Heartbeat, began: float) -> str:
    """The new world as the first survivor to see every rank arrived or silent wrote it: "ID COUNT" (the first
    COUNT arrivals). A rank still beating but not arrived is waited for up to `detect_s`."""
    stale_s = 2 * beat.period + 0.5
    beats: dict[int, tuple[int, float]] = {}
    while not keys.check(["closed"]):
        now = time.monotonic()
        arrived = int(keys.add("arrived", 0))
        here = {int(keys.get(f"arrival/{i}")) for i in range(1, arrived + 1)}
        for r in range(old.size):
            count = int(keys.add(beat_key(r), 0))
            if r not in beats or beats[r][0] != count:
                beats[r] = (count, now)
        waiting = [r for r in range(old.size) if r not in here and now - beats[r][1] < stale_s]
        if not waiting or now - began > beat.detect_s + stale_s:
            keys.compare_set("closed", "", f"{uuid.uuid4().hex} {arrived}")
            break
        if now - began > REGROUP_S:
            give_up(f"the survivors did not regroup within {REGROUP_S:.0f} s")
        time.sleep(0.1)
    return keys.get("closed").decode()


def _wait(keys: dist.Store, key: str, beat: Heartbeat, began: float) -> None:
    """Wait for `key`, giving up at a second fault (a member of the new world silent) or after REGROUP_S."""
    while not keys.check([key]):
        if beat.second_fault:
            give_up(beat.second_fault)
        if time.monotonic() - began > REGROUP_S:
            give_up(f"the survivors did not regroup within {REGROUP_S:.0f} s (waiting for {key})")
        time.sleep(0.05)
