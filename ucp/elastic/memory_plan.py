"""The host-memory tier's plans: which ranks share a node, who copies its snapshot to whom, which memory
checkpoint is complete on the nodes that survived, and what each node must fetch before it loads one.

A memory save (`ucp.deepspeed.memory.tier`) writes each rank's pieces into its node's directory (a sparse
copy of the checkpoint's data files), and `replicas` copies of them into the directories of the next nodes
(node i's ranks send to nodes i+1 .. i+replicas, mod the node count). A node's manifest lists the saving
ranks whose pieces it holds, and every saving rank that has none (under HMP, the ranks of the replicas that do not
write): those are held wherever the checkpoint is. A memory checkpoint is complete when the nodes alive now hold,
between them, every saving rank's pieces. Ranks are numbered by their place in the saving group; nodes by their lowest
rank. Pure: no I/O.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

BASE = -1  # a fill's "source" that stands for the index and the data files' headers (every copy holds them)


def nodes_of(keys: Sequence[str]) -> list[list[int]]:
    """The ranks of each node, `keys[r]` naming rank r's node; nodes in the order of their lowest rank."""
    nodes: dict[str, list[int]] = {}
    for rank, key in enumerate(keys):
        nodes.setdefault(key, []).append(rank)
    return list(nodes.values())


def peer_pairs(nodes: Sequence[Sequence[int]], replicas: int) -> list[tuple[int, int]]:
    """(sender, receiver) rank pairs: the j-th rank of node i sends its pieces to the j-th rank (mod that node's
    size) of each of the nodes i+1 .. i+replicas (mod the node count; at most every other node once)."""
    pairs = []
    for i, ranks in enumerate(nodes):
        for d in range(1, min(replicas, len(nodes) - 1) + 1):
            peer = nodes[(i + d) % len(nodes)]
            pairs += [(rank, peer[j % len(peer)]) for j, rank in enumerate(ranks)]
    return pairs


def held_by(node: Sequence[int], pairs: Sequence[tuple[int, int]], idle: Sequence[int] = ()) -> list[int]:
    """The ranks whose pieces `node` holds after a save: its own, those its ranks receive, and the `idle` ranks,
    which save no pieces (so that losing their nodes loses nothing)."""
    mine = set(node)
    return sorted(mine | {src for src, dst in pairs if dst in mine} | set(idle))


@dataclass(frozen=True)
class NodeCopy:
    """One node's committed copy of a memory checkpoint."""

    tag: str
    step: int
    fingerprint: str  # the index's: copies of one save agree on it
    ranks: int        # the saving group's size
    holds: frozenset[int]


@dataclass(frozen=True)
class Lost:
    """A memory checkpoint newer than the one chosen whose pieces of `missing` ranks no node alive holds."""

    tag: str
    step: int
    missing: tuple[int, ...]
    ranks: int


@dataclass(frozen=True)
class Choice:
    tag: str | None            # the newest complete memory checkpoint newer than the disk tier's, if any
    fingerprint: str | None
    lost: tuple[Lost, ...]     # newer ones that are incomplete, newest first


def choose(copies: Sequence[Mapping[str, NodeCopy]], newer_than: int) -> Choice:
    """The newest memory checkpoint with step > `newer_than` that the nodes' `copies` (per node: tag -> copy)
    hold completely between them."""
    saves: dict[tuple[str, str], list[NodeCopy]] = {}
    for node in copies:
        for copy in node.values():
            saves.setdefault((copy.tag, copy.fingerprint), []).append(copy)
    lost: list[Lost] = []
    for (tag, fingerprint), found in sorted(saves.items(), key=lambda kv: -kv[1][0].step):
        step, ranks = found[0].step, found[0].ranks
        if step <= newer_than:
            break
        missing = set(range(ranks)).difference(*(c.holds for c in found))
        if not missing:
            return Choice(tag, fingerprint, tuple(lost))
        lost.append(Lost(tag, step, tuple(sorted(missing)), ranks))
    return Choice(None, None, tuple(lost))


@dataclass(frozen=True)
class Fill:
    """Node `dst` fetches from node `src` the pieces of saving rank `source` (`BASE`: the index and headers)."""

    src: int
    dst: int
    source: int


def fills(copies: Sequence[NodeCopy | None], ranks: int) -> list[Fill]:
    """What each node must fetch so that it holds the whole checkpoint, from the first node holding each part;
    `copies[n]` is node n's copy (None: it has none). The checkpoint must be complete (`choose`)."""
    out = []
    for dst, copy in enumerate(copies):
        held = copy.holds if copy is not None else frozenset()
        wanted = [s for s in range(ranks) if s not in held]
        if copy is None:
            wanted.insert(0, BASE)
        for source in wanted:
            src = next(n for n, c in enumerate(copies) if c is not None and (source == BASE or source in c.holds))
            out.append(Fill(src, dst, source))
    return out
