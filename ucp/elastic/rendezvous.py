"""`init_distributed`: a process group whose store belongs to this rendezvous round alone.

torchrun's elastic agent shares its own TCP store with its workers by default
(`TORCHELASTIC_USE_AGENT_STORE=True`) and that store outlives every round: the keys the workers of one round
wrote stay there when they die. torch's `env://` init puts no round in the key names, so a restarted gloo worker
can read the address a dead worker left under the same key, fail in `connectFullMesh` ("Connection refused")
and leave its peers waiting, at every restart. `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` avoids it, but only for a
user who knows it (and the agents need it anyway to admit a node that joins later: `ucp.elastic.torchrun`).

Here rank 0 of each round starts a store of its own on a free port and announces it in the agent's store with a
token; the other ranks take an announcement only once the store it names answers with that token. A stale
announcement names a store that died with its rank 0 (or now answers with another token), so it is passed over,
and every rank of the round meets in a store that no earlier round wrote to. A store that died leaves its port
closed: a connect refused there passes the announcement over at once (a TCPStore client would retry it for the
whole probe), which after a restart is the common case, the ranks reading the dead round's announcement before
the new rank 0 replaced it.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from datetime import timedelta

import torch
import torch.distributed as dist

from ucp.errors import ConfigError, RendezvousError

logger = logging.getLogger("ucp")

_ANNOUNCEMENT = "ucp/round_store"   # in the agent's store: "PORT TOKEN" of the round's own store
_TOKEN = "ucp/round_token"          # in the round's own store: TOKEN
_PROBE = timedelta(seconds=3)       # how long one announced store may take to answer before it is taken as stale
_DEFAULT_TIMEOUT = timedelta(minutes=30)   # torch's own default for process groups

_own_store_in_use = False


def init_distributed(backend: str | None = None, timeout: timedelta = _DEFAULT_TIMEOUT) -> None:
    """Initialize torch.distributed's default process group from the launcher's environment, safely across
    elastic restarts; call it in place of `deepspeed.init_distributed()` / `dist.init_process_group()`.

    `backend`: "gloo", "nccl", ...; by default NCCL where CUDA is available, else gloo. Under torchrun's shared
    agent store (its default) the group gets a store of its own for this rendezvous round (module docstring);
    under anything else (`TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`, another launcher that sets RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT) it is `dist.init_process_group(backend)` as usual. Does nothing where the group
    exists already (Ray Train)."""
    global _own_store_in_use
    if dist.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout)
        return
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    store = _round_store(os.environ["MASTER_ADDR"], _env_int("MASTER_PORT"), rank, world, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    _own_store_in_use = True


def warn_shared_rendezvous_store() -> None:
    """Under torchrun's elastic agents with restarts, say what their shared store (torch's default) costs. Its
    agents cannot admit a node that joins later (`ucp.elastic.torchrun`); and where the workers' process group
    was not made by `init_distributed`, a restarted gloo worker can read an address a dead worker left in the
    store and hang in connect. Rank 0, once per start."""
    if (os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            or os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") == "0"
            or not dist.is_initialized() or dist.get_rank() != 0):
        return
    if not _own_store_in_use and dist.get_backend() == "gloo":
        logger.warning("ucp: torchrun shares its rendezvous store with these gloo workers: a restart can hang in "
                       "gloo's connect on an address a dead worker left there; initialize with "
                       "ucp.elastic.init_distributed() instead of deepspeed.init_distributed()")
    logger.warning("ucp: torchrun's agents share one rendezvous store (torch's default): they cannot admit a node "
                   "that joins later, nor lose the one that hosts the store; launch with ucp-torchrun (torchrun "
                   "with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1)")


def _round_store(host: str, agent_port: int, rank: int, world: int, timeout: timedelta) -> dist.Store:
    agent = dist.TCPStore(host, agent_port, world, is_master=False, timeout=timeout)
    if rank == 0:
        # Rank 0 runs on the node whose agent hosts the shared store, the MASTER_ADDR every worker was given.
        own = dist.TCPStore(host, 0, world, is_master=True, timeout=timeout, wait_for_workers=False)
        token = uuid.uuid4().hex
        own.set(_TOKEN, token)
        agent.set(_ANNOUNCEMENT, f"{own.port} {token}")
        return own
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        port, token = agent.get(_ANNOUNCEMENT).decode().split()   # waits for a first announcement
        try:
            if _listening(host, int(port)):
                own = dist.TCPStore(host, int(port), world, is_master=False, timeout=_PROBE)
                if own.get(_TOKEN).decode() == token:
                    own.set_timeout(timeout)
                    return own
        except (RuntimeError, dist.DistError):
            pass   # a store that died with an earlier round's rank 0, or a port taken by something else since
        if time.monotonic() > deadline:
            raise RendezvousError(f"ucp.elastic.init_distributed: rank {rank} found no store of this rendezvous round "
                              f"announced by rank 0 in torchrun's store at {host}:{agent_port} within "
                              f"{timeout.total_seconds():.0f} s; check that rank 0 of this round started")
        time.sleep(0.2)


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections on `host:port` (refused: nothing does, no store answers there)."""
    try:
        with socket.create_connection((host, port), timeout=_PROBE.total_seconds()):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return True   # unreachable or slow for now: the store's own probe decides


def _env_int(name: str) -> int:
    value = os.environ.get(name, "")
    if not value.isdigit():
        raise ConfigError(f"ucp.elastic.init_distributed: {name}={value!r} in the environment; start the script "
                          "with torchrun (or set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT)")
    return int(value)
