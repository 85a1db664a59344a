"""Where the DeepSpeed hook's bytes come from: a ucp checkpoint's index, or a DeepSpeed checkpoint's plan.

Both sources answer the same question for one layer: the elements each `TargetTensor` wants of
each state, read by byte offset. A key (parameter, state) is *shared* when one rank of the
data-parallel group reads the target's whole box and broadcasts it (`ucp.deepspeed` assigns the
readers and broadcasts); every other key is read by the rank that wants it, exactly its bytes
where storage allows.

* `AtomicSource` — a ucp checkpoint: states are whole, logical tensors at known offsets
  (`ucp.format.box_read`); shared keys are those the whole group wants (ZeRO-0 models, frozen
  parameters, buffers). Every read is checked (`ucp.format.checked_read`): a whole state against its
  CRC-32, part of one against the CRC-32 of each chunk it is widened to.
* `PlannedSource` — a DeepSpeed checkpoint, resharded on the fly through its `ConversionPlan`. A
  state stored as runs of its flattened tensor (ZeRO-1/2/3 partitions, or one whole tensor in the
  module) serves any run of wanted elements from just the overlapping bytes of the rank files
  (`ucp.deepspeed.flat_runs.run_reads`), cast to the state's dtype as `ucp convert` would; a TP box reads
  the rows that cover it. Any other state (TP shards, pipeline-tied copies, experts' replicas) is
  materialised whole by one rank of the group (`ucp.convert.assemble.materialize_tensor`: Union, taking rank 0's
  copy of a replicated state as `ucp convert` does, then StripPad) and broadcast, so it is shared
  even when each rank wants a part of it.

What is verified on the planned path: the plan itself (every rank file present, partitions tiling
every tensor, partition counts and groups agreeing across files, see `ucp.converters`) and every
read lying inside its file (a truncated file fails the read). Not verified: the bytes themselves.
A torch zip entry carries a CRC-32 of the whole entry only (e.g. a rank's flat partition of a whole
param group), and a rank reads parts of it; run `ucp convert` and `ucp verify` where the source's
integrity is in doubt.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ucp.checkpoint import AtomicCheckpoint, PlannedCheckpoint
from ucp.convert.assemble import materialize_tensor
from ucp.convert.plan import ConversionPlan, StateSource
from ucp.convert.source_check import check_entry, touched_entries
from ucp.deepspeed.flat_runs import FlatRun, flat_runs, run_reads
from ucp.deepspeed.readers import assign_readers
from ucp.deepspeed.targets import TargetTensor
from ucp.errors import UcpError
from ucp.format.box_read import BoxWant, full_box, read_boxes
from ucp.format.boxes import Box
from ucp.format.byte_ranges import ByteRange
from ucp.format.checked_read import OpenChunk, close_chunks, fetch
from ucp.format.fileio import ReadCounter
from ucp.format.index import StoredState
from ucp.format.safetensors_stream import TORCH_DTYPES

Key = tuple[str, str]
KEEP_BYTES = 1 << 30  # of what the check before a load read, kept for the load itself


class Source(Protocol):
    """What the hook reads tensors through (the checkpoint itself answers the checks: its index,
    optimizer and training state)."""

    def check_first(self, layers: Iterable[dict[Key, TargetTensor]], mine: Callable[[dict], list[Key]],
                    bypass: bool, stats) -> None:
        """Read and check what this rank's share of the load covers, installing nothing; raise
        `CorruptCheckpointError` on damage. Counts what it reads in `stats`."""

    def dtype(self, key: Key) -> torch.dtype:
        """The dtype the state's values come in (what the atomic format stores)."""

    def shared(self, key: Key, t: TargetTensor) -> bool:
        """Whether one rank of `t`'s data-parallel group reads `t`'s whole box for the group."""

    def read(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool, stats) -> dict:
        """Read `readers` (keys of `wants`, one layer's): key -> the target's elements, flat; the whole box
        for a shared key (with `bypass`). Adds to `stats.bytes_read` and `stats.read_calls`."""


def source_for(ckpt: AtomicCheckpoint | PlannedCheckpoint) -> Source:
    return AtomicSource(ckpt) if isinstance(ckpt, AtomicCheckpoint) else PlannedSource(ckpt.plan)


def box_numel(t: TargetTensor) -> int:
    """Elements of the part of the full tensor `t`'s module holds (what a shared key broadcasts)."""
    return math.prod(hi - lo for lo, hi in t.box) if t.box is not None else math.prod(t.shape)


def _of_box(full: torch.Tensor, box: Box | None) -> torch.Tensor:
    """`box` of a full tensor, flat."""
    for dim, (lo, hi) in enumerate(box or ()):
        full = full.narrow(dim, lo, hi - lo)
    return full.reshape(-1)


def _held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """The memory `tensors` keep alive: their storages' bytes, each storage once (reads share buffers)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def _all_ranks(opened: list[OpenChunk]) -> list[OpenChunk]:
    """Every rank's open chunks (collective over the world; each rank's own without distributed).

    About two small records per state per rank reach every rank: cheap at the scales measured here, but
    growing with world size x states; routing each chunk's pieces to one owner rank would bound it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return opened
    found: list[Any] = [None] * dist.get_world_size()  # every rank's list of open chunks, once gathered
    dist.all_gather_object(found, opened)
    return [c for chunks in found for c in chunks]


def _count(stats, counter: ReadCounter) -> None:
    stats.bytes_read += counter.bytes
    stats.read_calls += counter.calls


class AtomicSource:
    """A ucp checkpoint, read through its index.

    The check before the load (`check_first`) keeps what it read, up to `keep_bytes`, for `read` to
    install without reading it again; whatever did not fit is read again (counted in
    `bytes_read_again`), so memory stays bounded by `keep_bytes` plus one layer.
    """

    def __init__(self, ckpt: AtomicCheckpoint, keep_bytes: int = KEEP_BYTES):
        self.ckpt = ckpt
        self.keep_bytes = keep_bytes
        self._kept: dict[Key, torch.Tensor] = {}
        self._checked = False

    def _stored(self, key: Key) -> StoredState:
        name, state = key
        return self.ckpt.index.entry(name).states[state]  # an alias: its source

    def dtype(self, key: Key) -> torch.dtype:
        return TORCH_DTYPES[self._stored(key).dtype]

    def shared(self, key: Key, t: TargetTensor) -> bool:
        return t.whole

    def check_first(self, layers: Iterable[dict[Key, TargetTensor]], mine: Callable[[dict], list[Key]],
                    bypass: bool, stats) -> None:
        """Every read of the load, checked chunk by chunk (see `Source.check_first`); whole layers of what it
        read are kept while they fit in `keep_bytes`. A chunk that a rank reads only part of (where ZeRO
        partitions meet) is checked from the parts the ranks read, exchanged once (a collective), rather
        than read whole by each (`ucp.format.checked_read.close_chunks`)."""
        opened: list[OpenChunk]
        counter, kept, opened = ReadCounter(), 0, []
        self._checked = True
        damaged = None
        try:
            for wants in layers:
                values, extra = read_boxes(self.ckpt.path, self._boxes(wants, mine(wants), bypass),
                                           self.ckpt.index.chunk_bytes, counter, open_chunks=opened)
                stats.bytes_checked_extra += extra
                size = _held_bytes(values.values())
                if kept + size <= self.keep_bytes:
                    self._kept.update(values)
                    kept += size
        except UcpError as exc:  # still meet the others in the exchange below
            damaged = exc
        everyone = _all_ranks(opened)
        if damaged is not None:
            raise damaged
        stats.bytes_checked_extra += close_chunks(self.ckpt.path, opened, everyone, counter)
        _count(stats, counter)

    def _boxes(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool) -> dict[Key, BoxWant]:
        boxes = {}
        for key in readers:
            t, stored = wants[key], self._stored(key)
            boxes[key] = BoxWant(stored, t.box or full_box(stored.shape), (t.start, t.start + t.numel),
                                 whole=not bypass)
        return boxes

    def read(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool, stats) -> dict:
        """This rank's reads for one layer, coalesced and checked (see `Source.read`).

        With bypass a rank reads exactly its elements when they are contiguous in storage, else the
        covering part of its box (`ucp.format.box_read`); without, every tensor it touches whole.
        """
        values = {key: self._kept.pop(key) for key in readers if key in self._kept}
        rest = [key for key in readers if key not in values]
        if rest:
            counter = ReadCounter()
            got, extra = read_boxes(self.ckpt.path, self._boxes(wants, rest, bypass), self.ckpt.index.chunk_bytes,
                                    counter)
            values.update(got)
            if self._checked:  # read and checked once already: not the load's share of the checkpoint again
                stats.bytes_read_again += counter.bytes
            else:
                _count(stats, counter)
                stats.bytes_checked_extra += extra
        return values


class PlannedSource:
    """A DeepSpeed checkpoint, read through its conversion plan (see the module docstring)."""

    def __init__(self, plan: ConversionPlan):
        self.plan = plan
        self._params = {p.name: p for p in plan.params}
        self._params.update({alias: self._params[source] for alias, source in plan.aliases.items()})
        self._runs: dict[Key, tuple[FlatRun, ...] | None] = {}

    def _state(self, key: Key) -> StateSource:
        return self._params[key[0]].states[key[1]]

    def check_first(self, layers: Iterable[dict[Key, TargetTensor]], mine: Callable[[dict], list[Key]],
                    bypass: bool, stats) -> None:
        """This rank's share of the rank files' zip entries that the plan reads, each read whole and checked
        against the CRC-32 its zip records (`ucp.convert.source_check`): a zip records one CRC per entry (a
        rank's whole flat partition), so the job's ranks split the entries between them, reading the
        checkpoint once in all. Which layers this rank loads does not matter."""
        entries = {(path, e.name): e for path, found in touched_entries(self.plan).items() for e in found}
        rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        owners = assign_readers({key: e.end - e.start for key, e in entries.items()}, list(range(world)))
        for (path, name), entry in sorted(entries.items()):
            if owners[(path, name)] == rank:
                check_entry(path, entry)
                stats.bytes_checked_sources += entry.end - entry.start

    def _flat(self, key: Key) -> tuple[FlatRun, ...] | None:
        if key not in self._runs:
            self._runs[key] = flat_runs(self._state(key))
        return self._runs[key]

    def dtype(self, key: Key) -> torch.dtype:
        return TORCH_DTYPES[self._state(key).dtype]

    def shared(self, key: Key, t: TargetTensor) -> bool:
        return t.whole or self._flat(key) is None

    def read(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool, stats) -> dict:
        """This rank's reads for one layer (see `Source.read`), in the states' dtypes. Runs of flat-stored
        states are read exactly (the rows covering a TP box), touching ranges coalesced; other states,
        and all of them without bypass, whole."""
        counter = ReadCounter()
        ranges: dict[Key, list[ByteRange]] = {}
        values = {}
        for key in readers:
            t, runs = wants[key], self._flat(key)
            if not bypass or runs is None:
                full = materialize_tensor(self._state(key), name=key[0], counter=counter)
                values[key] = self._wanted(_of_box(full, t.box), key, t, bypass)
                continue
            ranges[key] = run_reads(runs, *self._span(key, t), TORCH_DTYPES[runs[0].piece.dtype].itemsize)
        chunks = fetch(Path(), [r for rs in ranges.values() for r in rs], counter)  # pieces name their files
        _count(stats, counter)
        for key, parts in ranges.items():
            raw = chunks[parts[0]] if len(parts) == 1 else torch.cat([chunks[r] for r in parts])  # no copy for one
            stored = raw.view(TORCH_DTYPES[self._flat(key)[0].piece.dtype])  # type: ignore[index]  # a run read
            values[key] = self._from_span(stored.to(self.dtype(key)), key, wants[key])
        return values

    def _wanted(self, box: torch.Tensor, key: Key, t: TargetTensor, bypass: bool) -> torch.Tensor:
        """A shared key's whole box; else the target's run of it."""
        return box if bypass and self.shared(key, t) else box.narrow(0, t.start, t.numel)

    def _span(self, key: Key, t: TargetTensor) -> tuple[int, int]:
        """The elements [lo, hi) of the flattened tensor to read: the target's run, or the rows covering its box."""
        if t.box is None or t.box == full_box(t.shape):
            return (0, box_numel(t)) if self.shared(key, t) else (t.start, t.start + t.numel)
        row = math.prod(t.shape[1:])
        return t.box[0][0] * row, t.box[0][1] * row

    def _from_span(self, span: torch.Tensor, key: Key, t: TargetTensor) -> torch.Tensor:
        """What `read` returns for `t`, from the elements `_span` gave."""
        if t.box is None or t.box == full_box(t.shape):
            return span
        rows = span.reshape(-1, *t.shape[1:])
        box = ((0, rows.shape[0]),) + tuple(t.box[1:])
        return self._wanted(_of_box(rows, box), key, t, True)
