"""`"load": "auto"` from the host-memory tier: the newest memory checkpoint the nodes alive now hold between
them, copied whole onto every node before the load.

Collectively, on every rank: each node's ranks read the manifests of their node's committed memory
checkpoints (`ucp.deepspeed.memory.tier`) and every rank gathers all of them. The newest save newer than the
disk tier's newest checkpoint whose pieces are all on some node wins (`ucp.elastic.memory_plan.choose`);
newer ones that are not are named in one warning (the nodes that held their pieces are gone). Then each
node's first rank fetches what its copy lacks, over a gloo group, from the first node that holds it: the
index and the data files' headers when the node has no copy, and the byte ranges of each saving rank whose
pieces it does not hold (`fills`). The transfers run in one order on every rank, each a blocking send and
receive between two ranks, so none waits on another in a cycle. A filled copy is committed in the disk order
(data, manifest, index, `latest`); every rank then loads its own node's copy with `ucp.deepspeed.load`, at
any world size and layout, and its CRCs are checked as on disk.
"""
from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ucp import collectives
from ucp.deepspeed.config import MemoryEvery
from ucp.deepspeed.memory.files import checked_folder, node_key, read_copies, refuse_untrusted
from ucp.deepspeed.memory.manifest import Manifest, write_manifest
from ucp.elastic.memory_plan import BASE, Fill, NodeCopy, choose, fills, nodes_of
from ucp.format.folder import INDEX_NAME, PARTIAL_SUFFIX, fsync_dir
from ucp.format.save_folder import foreign_problem, fresh_tag, replace_latest, unmark
from ucp.storage.fileio import tensor_bytes
from ucp.storage.layer import read_ranges, write_ranges

logger = logging.getLogger("ucp.elastic")
_CHUNK = 64 << 20  # bytes sent at a time: what a transfer holds in memory on either side


def memory_resume_point(config: MemoryEvery, newer_than: int, fallback: str) -> Path | None:
    """This rank's node copy of the newest memory checkpoint newer than step `newer_than` that the nodes hold
    completely, filled from the peers; None when there is none (`fallback` says what loads instead)."""
    folder, problem = checked_folder(config, create=False)
    initialized = collectives.initialized()
    rank = collectives.rank()
    group = _gloo_group() if initialized else None
    copies_here = read_copies(folder, config.job) if problem is None else {}
    gathered = collectives.all_gather_objects((node_key(folder), copies_here, problem), group)
    refuse_untrusted([p for _, _, p in gathered])
    nodes = nodes_of([key for key, _, _ in gathered])
    manifests: list[dict[str, Manifest]] = [gathered[node[0]][1] for node in nodes]
    copies = [{tag: _copy(m) for tag, m in node.items()} for node in manifests]
    choice = choose(copies, newer_than)
    if rank == 0:
        for lost in choice.lost:
            logger.warning("ucp: memory checkpoint %s (step %d) is incomplete: the pieces of saving rank(s) %s of "
                           "%d were on nodes that are gone, with every peer copy of them; %s", lost.tag, lost.step,
                           ", ".join(map(str, lost.missing)), lost.ranks, fallback)
    if choice.tag is None:
        return None
    tag = choice.tag
    held = [c.get(tag) if tag in c and c[tag].fingerprint == choice.fingerprint else None for c in copies]
    plan = fills(held, next(c.ranks for c in held if c is not None))
    mine = next(i for i, node in enumerate(nodes) if rank in node)
    tag_dir = folder / tag
    problem = _unreadable(tag_dir, manifests[mine][tag]) if any(f.src == mine for f in plan) else None
    if any(f.dst == mine and f.source == BASE for f in plan):  # a new copy here: never over what is not ucp's
        problem = problem or foreign_problem(tag_dir)
    problems = [p for p in collectives.all_gather_objects(problem if rank == nodes[mine][0] else None, group) if p]
    if problems:  # found before any transfer starts: no rank waits for bytes that will not come
        if rank == 0:
            logger.warning("ucp: memory checkpoint %s cannot be filled from its peers (%s); %s", tag, problems[0],
                           fallback)
        return None
    for fill in plan:
        src, dst = nodes[fill.src][0], nodes[fill.dst][0]
        if rank == src:
            _send(fill, manifests[fill.src][tag], tag_dir, dst, group)
        elif rank == dst:
            _receive(fill, manifests[fill.src][tag], tag_dir, src, group)
    received = [f for f in plan if f.dst == mine]
    if received and rank == nodes[mine][0]:
        _commit_fill(tag_dir, manifests[mine].get(tag) if held[mine] is not None else None, received, manifests)
    if initialized:
        dist.barrier(group=group)
    if rank == 0 and plan:
        logger.warning("ucp: filled the memory checkpoint %s from peer copies (%d transfers)", tag, len(plan))
    return tag_dir


def _copy(manifest: Manifest) -> NodeCopy:
    return NodeCopy(manifest.tag, manifest.step, manifest.fingerprint, manifest.ranks, frozenset(manifest.holds))


def _unreadable(tag_dir: Path, manifest: Manifest) -> str | None:
    """What keeps this node from sending its copy: a missing index or data file, or one of another size."""
    try:
        (tag_dir / INDEX_NAME).stat()
        for name, nbytes, _ in manifest.files:
            size = (tag_dir / name).stat().st_size
            if size != nbytes:
                return f"{tag_dir / name}: {size} bytes, the manifest says {nbytes}"
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _ranges(fill: Fill, holder: Manifest) -> list[tuple[str, int, int]]:
    """The byte ranges a fill moves: the headers for `BASE`, else the saving rank's pieces."""
    if fill.source == BASE:
        return [(name, 0, header) for name, _, header in holder.files]
    return list(holder.holds[fill.source])


def _send(fill: Fill, holder: Manifest, tag_dir: Path, dst: int, group: Any) -> None:
    if fill.source == BASE:
        index = (tag_dir / INDEX_NAME).read_bytes()
        dist.send(torch.tensor([len(index)], dtype=torch.int64), dst, group=group)
        dist.send(torch.frombuffer(bytearray(index), dtype=torch.uint8), dst, group=group)
    for file, begin, end in _ranges(fill, holder):
        for lo in range(begin, end, _CHUNK):
            data = torch.empty(min(_CHUNK, end - lo), dtype=torch.uint8)
            read_ranges([(tag_dir / file, lo, tensor_bytes(data))])
            dist.send(data, dst, group=group)


def _receive(fill: Fill, holder: Manifest, tag_dir: Path, src: int, group: Any) -> None:
    if fill.source == BASE:  # this node has no copy: start one, sized as the holder's
        fresh_tag(tag_dir)  # checked before any transfer (foreign_problem)
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src, group=group)
        index = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(index, src, group=group)
        (tag_dir / (INDEX_NAME + PARTIAL_SUFFIX)).write_bytes(index.numpy().tobytes())
        for name, nbytes, _ in holder.files:
            with open(tag_dir / name, "wb") as f:
                f.truncate(nbytes)
    parts: list[tuple[Path, int, bytes | memoryview]] = []
    for file, begin, end in _ranges(fill, holder):
        for lo in range(begin, end, _CHUNK):
            data = torch.empty(min(_CHUNK, end - lo), dtype=torch.uint8)
            dist.recv(data, src, group=group)
            parts.append((tag_dir / file, lo, tensor_bytes(data)))
            if len(parts) >= 4:  # bound what waits to be written
                write_ranges(parts, sync=True)
                parts = []
    write_ranges(parts, sync=True)


def _commit_fill(tag_dir: Path, own: Manifest | None, received: list[Fill], manifests: list[dict[str, Manifest]]
                 ) -> None:
    """The filled copy's manifest (it now holds every saving rank's pieces), then, for a new copy, its index
    and `latest`."""
    tag = tag_dir.name
    base = own if own is not None else manifests[received[0].src][tag]
    holds = dict(own.holds) if own is not None else {}
    for fill in received:
        if fill.source != BASE:
            holds[fill.source] = manifests[fill.src][tag].holds[fill.source]
    write_manifest(tag_dir, replace(base, holds=holds))
    if own is None:
        os.replace(tag_dir / (INDEX_NAME + PARTIAL_SUFFIX), tag_dir / INDEX_NAME)
        fsync_dir(tag_dir)
        unmark(tag_dir)
        replace_latest(tag_dir.parent, tag)


def _gloo_group() -> Any:
    """The world as a gloo group (the default one when it is gloo): the transfers are host bytes."""
    return dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")

