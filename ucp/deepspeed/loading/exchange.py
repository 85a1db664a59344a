"""The parts of each checked unit, routed to one owner rank: the exchange of the check before a load.

A unit is a run of stored bytes with a CRC-32 of its own: a chunk of a state of a ucp checkpoint (its index
records the CRC), or a tensor's zip entry in a DeepSpeed rank file (the zip directory does). Ranks that read
parts of a unit CRC their parts; every part goes to the unit's owner, which joins them in file order
(`crc32_combine`) and reads only the bytes no rank read. The owner of a unit is a hash of its file's name and
first byte, so every rank computes it alike without talking, and units spread evenly over the ranks.

One all-to-all moves the parts (`to_owners`): each rank sends each of its parts once, to one rank, and
receives the parts of the units it owns. Per rank that is 2 x 8 x world bytes of counts (the all-to-all's
sizes), plus its parts and the parts of the units it owns, pickled one list per peer: 60 to 160 bytes a part
(the more peers a rank's parts spread over, the more lists, each with its own pickle header). A ZeRO-1/2 target
reads O(states) parts a rank, a ZeRO-3 target O(parameters x states), whatever the world size; so a rank
exchanges O(parameters x states) + O(world) bytes. An all-gather, as before, handed every rank every rank's
parts: world x that. `benchmarks/load_exchange.py` measures both on synthetic worlds of 64 to 256 ranks.
"""
from __future__ import annotations

import pickle
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

import torch.distributed as dist

from ucp import collectives
from ucp.format.crc import crc32

T = TypeVar("T")
Unit = tuple[str, int]  # (file name, first byte) of a unit: the same on every rank


def owner_of(unit: Unit, world: int) -> int:
    """The rank that joins the parts of `unit` and checks it."""
    name, begin = unit
    return crc32(f"{name}:{begin}".encode()) % world


def by_owner(parts: Iterable[T], unit: Callable[[T], Unit], world: int) -> list[list[T]]:
    """`parts`, sorted into one list per owner rank of the unit each is a part of."""
    out: list[list[T]] = [[] for _ in range(world)]
    for part in parts:
        out[owner_of(unit(part), world)].append(part)
    return out


def payloads(parts: Sequence[T], unit: Callable[[T], Unit], world: int) -> list[bytes]:
    """What a rank sends each rank: the pickled list of the parts that rank owns (empty when none)."""
    return [pickle.dumps(mine) if mine else b"" for mine in by_owner(parts, unit, world)]


def to_owners(parts: Sequence[T], unit: Callable[[T], Unit]) -> tuple[list[T], int]:
    """Every rank's parts of the units this rank owns (a collective: all ranks call it), and how many bytes this
    rank sent and received for it. Without distributed, or on one rank, `parts` themselves."""
    if not collectives.initialized() or dist.get_world_size() == 1:
        return list(parts), 0
    world = dist.get_world_size()
    sent = payloads(parts, unit, world)
    received = collectives.all_to_all_bytes(sent, dist.group.WORLD)
    mine: list[T] = []
    for raw in received:
        if raw:
            mine += pickle.loads(raw)  # records this job's ranks made, as all_gather_object's
    return mine, 2 * 8 * world + sum(map(len, sent)) + sum(map(len, received))
