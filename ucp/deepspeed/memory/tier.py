"""The host-memory tier: every k steps each node keeps the newest checkpoint in memory, plus peer copies.

    "ucp": {"load": "auto", "save": {"dir": "/ckpt/ucp", "every": 1000,
                                     "memory": {"every": 50, "replicas": 1, "dir": "/dev/shm/ucp-job"}}}

A node is the set of ranks whose memory directory is the same folder on the same host (by default
`/dev/shm/ucp-<hash of the save dir>`, which outlives a worker process; `$VARS` in `dir` are expanded on
each node). A memory save is an asynchronous save (`ucp.deepspeed.saving.saver`: the same snapshot buffer and
writer thread) whose data files are node-private: each rank pwrites its pieces at their final offsets into
its node's copy, so a node's data files are sparse and hold the byte ranges of its own ranks. Each rank also
sends its snapshot to its peers on the next `replicas` nodes (`ucp.elastic.memory_plan.peer_pairs`), over the
saver's own gloo group, and they pwrite it into their copies. Once every rank reported, rank 0 builds the
index; each node commits its copy in the disk order: data files renamed, then the manifest
(`ucp_memory.json`: which saving ranks' byte ranges the node holds), the index, `latest`; then it removes its
older memory checkpoints. So a node holds at most two: the one being written and the last committed.

`ucp.deepspeed.memory.resume` restores from these copies at any world size.

Every engine the saver serves has a memory tier: under AutoTP, a pipeline, MoE or HMP the saving group is the
whole job and the pieces are each rank's share of the full tensors (`ucp.deepspeed.saving.plan`), so a memory
checkpoint is the one the disk save of the same step writes, and loads at any layout. Under HMP only the writing
replica's ranks have pieces (`ucp.deepspeed.saving.hmp`); the others save none, so every node's manifest counts
them as held (`ucp.elastic.memory_plan.held_by`) and losing their nodes loses nothing.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ucp import collectives
from ucp.deepspeed.config import MemoryEvery
from ucp.deepspeed.memory.files import checked_folder, node_key, refuse_untrusted, remove_copies
from ucp.deepspeed.memory.manifest import Manifest, write_manifest
from ucp.deepspeed.memory.spare import Runs, SpareSave, SpareTargets, write_runs
from ucp.deepspeed.saving.index import RankReport, index_of, report_of
from ucp.deepspeed.saving.saver import Saver
from ucp.deepspeed.saving.snapshot import Prepared
from ucp.deepspeed.saving.writer import BackgroundSave, partial_path, write_pieces
from ucp.elastic.memory_plan import held_by, nodes_of, peer_pairs
from ucp.elastic.ranks import spare_copies
from ucp.errors import SaveError
from ucp.format.folder import commit_index, fsync_dir
from ucp.format.index import Index
from ucp.format.save_folder import replace_latest, unmark
from ucp.storage.fileio import tensor_bytes

logger = logging.getLogger("ucp.save")


class MemoryTier:
    """A saver's memory tier: its nodes and peers, fixed when training starts (collectively)."""

    def __init__(self, saver: Saver, config: MemoryEvery, step: int):
        self.config = config
        folder, problem = checked_folder(config, create=True, start_step=step)
        self.last_step: int | None = step
        # A writer thread and a gloo group of its own: a memory save never queues behind a disk save in flight,
        # and the two writers' collectives never interleave.
        self.job = BackgroundSave()
        self.group = dist.new_group(saver.ranks, backend="gloo") if saver.group is not None else None
        gathered = collectives.all_gather_objects((node_key(folder), problem), self.group)
        refuse_untrusted([problem for _, problem in gathered])
        self.dir = folder
        self.nodes = [[saver.ranks[i] for i in node] for node in nodes_of([key for key, _ in gathered])]
        self.pairs = peer_pairs(self.nodes, config.replicas)
        self.node = next(n for n in self.nodes if saver.rank in n)
        self.leader = saver.rank == self.node[0]
        self.index = {rank: i for i, rank in enumerate(saver.ranks)}  # global rank -> place in the saving group
        channel = spare_copies()   # spares of an elastic layout keep whole copies (ucp.deepspeed.memory.spare)
        self.spares = (SpareTargets(channel, [key for key, _ in gathered], saver.rank, step)
                       if channel is not None else None)
        if config.replicas > len(self.nodes) - 1 and saver.leader:
            logger.warning("ucp: the memory tier keeps %d peer copies of each node's pieces, not %d: this run has "
                           "%d node(s); losing a node loses its memory checkpoint", len(self.nodes) - 1,
                           config.replicas, len(self.nodes))
        self._runs: tuple[Prepared, list[Runs]] | None = None
        self._received: torch.Tensor | None = None
        if self.leader:  # a run resumed from an older checkpoint goes another way: it saves those steps again
            remove_copies(self.dir, config.job, lambda saved: saved > step)
        if self.group is not None:
            dist.barrier(group=self.group)  # no rank writes a memory save before the stale ones are gone

    # -- the writer thread

    def write(self, saver: Saver, prepared: Prepared, tag: str, meta: dict[str, Any] | None,
              event: torch.cuda.Event | None) -> None:
        tag_dir = self.dir / tag
        report: RankReport = (None, None)
        try:
            if event is not None:
                event.synchronize()
            report = report_of(write_pieces(tag_dir, prepared.files.files, prepared.buffer, headers=self.leader),
                               prepared)
        except Exception as exc:
            report = (None, f"rank {saver.rank}: {type(exc).__name__}: {exc}")
        runs = self._all_runs(saver, prepared)
        error = self._exchange(saver, prepared, tag_dir, runs)
        if error is not None and report[1] is None:
            report = (None, f"rank {saver.rank}: {error}")
        reports: list[RankReport] | None = collectives.gather_objects(report, saver.ranks[0], self.group)
        built: tuple[Index | None, str | None] = (None, None)
        if reports is not None and meta is not None:
            try:
                built = (index_of(prepared, tag_dir, reports, meta), None)
            except Exception as exc:
                built = (None, str(exc) if isinstance(exc, SaveError) else f"{tag_dir}: {type(exc).__name__}: {exc}")
        index, failure = collectives.broadcast_object(built, saver.ranks[0], self.group)
        if failure is None and self.leader and index is not None:
            try:
                self._commit(prepared, tag, index, runs)
            except Exception as exc:
                failure = f"{tag_dir}: {type(exc).__name__}: {exc}"
        failures = [f for f in collectives.all_gather_objects(failure, self.group) if f is not None]
        if failures:
            raise SaveError(f"memory save {tag} failed: {failures[0]}; the node's previous memory checkpoint "
                            "stays its newest")
        if self.spares is not None and self.spares.targets and index is not None:
            self._send_to_spares(self.spares, saver, prepared, tag, index, runs)
        logger.info("ucp: saved %s to host memory", tag)

    def _all_runs(self, saver: Saver, prepared: Prepared) -> list[Runs]:
        """Every rank's snapshot runs (they change only when the buffer does)."""
        if self._runs is None or self._runs[0] is not prepared:
            mine = [(r.file, r.begin, r.end, r.offset) for r in prepared.buffer.runs]
            self._runs = (prepared, collectives.all_gather_objects(mine, self.group))
            self._received = None
        return self._runs[1]

    def _exchange(self, saver: Saver, prepared: Prepared, tag_dir: Path, runs: list[Runs]) -> str | None:
        """Send this rank's snapshot to its peers, receive theirs and write it into this node's copy."""
        sends = [dst for src, dst in self.pairs if src == saver.rank]
        sources = [src for src, dst in self.pairs if dst == saver.rank]
        sizes = [sum(end - begin for _, begin, end, _ in runs[self.index[src]]) for src in sources]
        if self._received is None or self._received.numel() != sum(sizes):
            self._received = torch.empty(sum(sizes), dtype=torch.uint8)
        works = [dist.isend(prepared.buffer.data, dst, group=self.group) for dst in sends]
        offset = 0
        for src, size in zip(sources, sizes):
            works.append(dist.irecv(self._received.narrow(0, offset, size), src, group=self.group))
            offset += size
        try:
            for work in works:
                if work is not None:
                    work.wait()
            offset = 0
            for src, size in zip(sources, sizes):
                write_runs(tag_dir, runs[self.index[src]], tensor_bytes(self._received)[offset:offset + size])
                offset += size
        except Exception as exc:
            return f"peer copy: {type(exc).__name__}: {exc}"
        return None

    def _send_to_spares(self, spares: SpareTargets, saver: Saver, prepared: Prepared, tag: str, index: Index,
                        runs: list[Runs]) -> None:
        """The committed save, whole, to the spares that keep copies; a spare lost on the way is left out."""
        files = prepared.files.files
        holds = {i: tuple((file, begin, end) for file, begin, end, _ in r) for i, r in enumerate(runs)}
        manifest = Manifest(tag, int(index.run.training["global_steps"]), index.run.source["fingerprint"],
                            self.config.job, len(runs), holds, tuple((f.name, f.size, len(f.header)) for f in files))
        try:
            spares.send(SpareSave(tag, files, runs, index, manifest), prepared.buffer.data, self.index[saver.rank])
        except (RuntimeError, OSError) as exc:
            logger.warning("ucp: rank %d: no more memory copies to the spares: %s", saver.rank, exc)
            self.spares = None

    def _commit(self, prepared: Prepared, tag: str, index: Index, runs: list[Runs]) -> None:
        """This node's copy: data files into place, then the manifest, the index, `latest`; older ones go."""
        tag_dir = self.dir / tag
        for f in prepared.files.files:
            os.replace(partial_path(tag_dir, f.name), tag_dir / f.name)
        fsync_dir(tag_dir)
        idle = [r for r, i in self.index.items() if not runs[i]]  # HMP: the ranks of the replicas that do not write
        holds = {self.index[r]: tuple((file, begin, end) for file, begin, end, _ in runs[self.index[r]])
                 for r in held_by(self.node, self.pairs, idle)}
        step = int(index.run.training["global_steps"])
        write_manifest(tag_dir, Manifest(tag, step, index.run.source["fingerprint"], self.config.job, len(runs), holds,
                                         tuple((f.name, f.size, len(f.header)) for f in prepared.files.files)))
        commit_index(tag_dir, index)
        unmark(tag_dir)
        replace_latest(self.dir, tag)
        remove_copies(self.dir, self.config.job, lambda saved: saved < step)
