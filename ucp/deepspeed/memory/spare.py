"""Spares hold the memory tier's copies: each spare on a node of its own receives every memory checkpoint whole.

A spare (`ucp.elastic.ranks`: a rank the layout leaves out) trains nothing, so its node's memory is free for a
complete copy of each memory checkpoint; after the next restart it serves the resume like any node's copy
(`ucp.deepspeed.memory.resume`), also when the nodes that held the other copies are gone. The protocol, over the
channel `ucp.elastic.ranks.spare_copies()` (a store and a gloo group of the whole world, spares included):

1. each spare publishes its node (`node_key` of its memory folder) under `spare/<rank>/node`;
2. when the memory tier starts, every training rank reads them and takes the same targets: the first spare of each
   node that holds no training rank (a spare next to training ranks would only copy what its node holds already);
   rank 0 tells every spare whether it is one, and the step the run resumed from (a spare removes its copies
   newer than that, as the training nodes do);
3. after each memory save is committed on the training nodes, rank 0 puts its description under
   `spare/<rank>/save/<n>` (tag, data files with their headers, every saving rank's runs, index, manifest) and
   every training rank sends its snapshot to each target; the spare writes each into its copy and commits it in
   the disk order (data, manifest, index, `latest`), then removes its older copies.

The training ranks send in the memory tier's writer thread, after their own copies are committed, so a spare that
is slow delays only the next memory save.
"""
from __future__ import annotations

import base64
import json
import logging
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ucp.deepspeed.config import MemoryEvery, Section, read_section
from ucp.deepspeed.memory.files import checked_folder, node_key, remove_copies
from ucp.deepspeed.memory.manifest import Manifest, write_manifest
from ucp.deepspeed.saving.files import SaveFile
from ucp.deepspeed.saving.writer import partial_path
from ucp.elastic.layout_choice import RankLayout
from ucp.elastic.ranks import SpareCopies, on_spare
from ucp.errors import SaveError
from ucp.format.folder import commit_index, fsync_dir
from ucp.format.index import Index
from ucp.format.save_folder import fresh_tag, replace_latest, unmark
from ucp.storage.fileio import tensor_bytes
from ucp.storage.layer import write_ranges

logger = logging.getLogger("ucp.save")
# A rank's snapshot as runs of bytes: (data file, begin, end, offset in the snapshot buffer).
Runs = list[tuple[str, int, int, int]]


@dataclass(frozen=True)
class SpareSave:
    """What a spare needs, besides the snapshots, to build its copy of one memory save."""

    tag: str
    files: tuple[SaveFile, ...]
    runs: list[Runs]          # every saving rank's runs, in the saving group's order
    index: Index
    manifest: Manifest        # holding every saving rank's pieces


class SpareTargets:
    """The training side: which spares get copies, and one send per memory save."""

    def __init__(self, channel: SpareCopies, training_nodes: Sequence[str], rank: int, step: int):
        self.channel = channel
        nodes = {r: json.loads(channel.store.get(f"spare/{r}/node")) for r in channel.spares}
        self.targets: list[int] = []
        for r, (key, problem) in nodes.items():
            if problem is None and key not in training_nodes and key not in {nodes[t][0] for t in self.targets}:
                self.targets.append(r)
        self.rank = rank
        self.sent = 0
        if rank == 0:
            for r in channel.spares:
                channel.store.set(f"spare/{r}/start", json.dumps({"copies": r in self.targets, "step": step}))
            if self.targets:
                logger.warning("ucp: spare rank(s) %s keep a copy of every memory checkpoint",
                               ", ".join(map(str, self.targets)))

    def send(self, save: SpareSave, snapshot: torch.Tensor, mine: int) -> None:
        """Rank 0 describes the save to each target; every rank sends its snapshot (`mine`: its place in
        `save.runs`)."""
        if self.rank == 0:
            blob = base64.b64encode(pickle.dumps(save)).decode()
            for r in self.targets:
                self.channel.store.set(f"spare/{r}/save/{self.sent}", blob)
        if _size(save.runs[mine]):
            for r in self.targets:
                self.channel.group.send([snapshot], r, 0).wait()
        self.sent += 1


def receive_copies(place: RankLayout, config: object, channel: SpareCopies) -> Callable[[], None] | None:
    """The spare's side (registered with `ucp.elastic.ranks.on_spare`): what to do at each poll, or None when
    the config has no memory tier. `config` is the section `ucp.deepspeed.initialize` read, or the DeepSpeed config
    a script gave `ucp.elastic.layout` before it, read here as initialize reads it."""
    section = config if isinstance(config, Section) else read_section(config if isinstance(config, dict) else None)
    memory = section.save.memory if section.save is not None else None
    if memory is None:
        return None
    folder, problem = checked_folder(memory, create=True)
    channel.store.set(f"spare/{place.rank}/node", json.dumps([node_key(folder), problem]))
    if problem is not None:
        logger.warning("ucp: spare rank %d keeps no memory checkpoint: %s", place.rank, problem)
    return _Receiver(place.rank, memory, folder, channel).poll


class _Receiver:
    def __init__(self, rank: int, memory: MemoryEvery, folder: Path, channel: SpareCopies):
        self.rank, self.memory, self.folder, self.channel = rank, memory, folder, channel
        self.started: bool | None = None   # None until rank 0 says whether this spare gets copies
        self.received = 0

    def poll(self) -> None:
        store = self.channel.store
        if self.started is None:
            if not store.check([f"spare/{self.rank}/start"]):
                return
            start = json.loads(store.get(f"spare/{self.rank}/start"))
            self.started = bool(start["copies"])
            if self.started:   # a run resumed from an older checkpoint goes another way, as on the training nodes
                remove_copies(self.folder, self.memory.job, lambda saved: saved > start["step"])
        while self.started and store.check([key := f"spare/{self.rank}/save/{self.received}"]):
            save: SpareSave = pickle.loads(base64.b64decode(store.get(key)))
            store.delete_key(key)
            self.received += 1
            self._receive(save)

    def _receive(self, save: SpareSave) -> None:
        """Every saving rank's snapshot into this node's copy (all of them received even when a write fails, so
        that no sender waits), then the commit."""
        tag_dir = self.folder / save.tag
        failure: Exception | None = None
        try:
            fresh_tag(tag_dir)
            for f in save.files:
                with open(partial_path(tag_dir, f.name), "wb") as out:
                    out.truncate(f.size)
                    out.write(f.header)
        except (OSError, SaveError) as exc:
            failure = exc
        for src, runs in enumerate(save.runs):
            if not _size(runs):
                continue
            data = torch.empty(_size(runs), dtype=torch.uint8)
            self.channel.group.recv([data], src, 0).wait()
            if failure is None:
                try:
                    write_runs(tag_dir, runs, tensor_bytes(data))
                except OSError as exc:
                    failure = exc
        if failure is not None:
            logger.warning("ucp: spare rank %d could not keep memory checkpoint %s: %s", self.rank, save.tag, failure)
            return
        for f in save.files:
            os.replace(partial_path(tag_dir, f.name), tag_dir / f.name)
        fsync_dir(tag_dir)
        write_manifest(tag_dir, save.manifest)
        commit_index(tag_dir, save.index)
        unmark(tag_dir)
        replace_latest(self.folder, save.tag)
        remove_copies(self.folder, self.memory.job, lambda saved: saved < save.manifest.step)
        logger.info("ucp: spare rank %d holds memory checkpoint %s", self.rank, save.tag)


def _size(runs: Runs) -> int:
    return sum(end - begin for _, begin, end, _ in runs)


def write_runs(tag_dir: Path, runs: Runs, data: memoryview) -> None:
    """A saving rank's snapshot (its runs, back to back in `data`) into this node's partial data files."""
    cursor = 0
    parts: list[tuple[Path, int, bytes | memoryview]] = []
    for file, begin, end, _ in runs:
        parts.append((partial_path(tag_dir, file), begin, data[cursor:cursor + end - begin]))
        cursor += end - begin
    write_ranges(parts, sync=True)


on_spare(receive_copies)
