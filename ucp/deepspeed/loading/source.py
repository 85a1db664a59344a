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
  (`ucp.deepspeed.loading.flat_runs.run_reads`), cast to the state's dtype as `ucp convert` would; a TP box reads
  the rows that cover it. Any other state (TP shards, pipeline-tied copies, experts' replicas) is
  materialised whole by one rank of the group from its fragments' bytes (`ucp.plan.assemble.assemble`:
  Union, taking rank 0's copy of a replicated state as `ucp convert` does, then StripPad) and broadcast, so it
  is shared even when each rank wants a part of it.

Both are checked before anything is installed (`check` then `close`, the hook's `check_first`): each rank
reads exactly its share of the load once and CRCs what it read. A unit with a CRC-32 of its own that a rank
read whole (a chunk of a ucp checkpoint's state, a zip entry of a DeepSpeed rank file) is checked at once;
the parts of any other go to the unit's owner rank (`ucp.deepspeed.loading.exchange`), which joins them and reads
only the bytes no rank read: ZeRO's padding, states the job does not load. A zip entry records one CRC-32
(e.g. a rank's flat partition of a whole param group), so on the planned path nearly every unit is closed
that way; small entries of the rank files (steps and other scalars the plan reads, at most 64 KiB) are read
whole by their owner unless the load's parts cover them. Each read also records its CRC-32, so that what
the hook reads again to install (beyond what it could keep in memory) is compared with what was checked.
Without the check, a DeepSpeed checkpoint's bytes are read unchecked.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from ucp.checkpoint import AtomicCheckpoint, PlannedCheckpoint
from ucp.convert.source_check import SMALL_ENTRY_BYTES, EntryParts, OpenEntry, check_entry, close_entries
from ucp.deepspeed.engine.targets import TargetTensor
from ucp.deepspeed.loading.exchange import owner_of, to_owners
from ucp.deepspeed.loading.flat_runs import FlatRun, flat_runs, run_reads
from ucp.format.box_read import BoxWant, full_box, read_boxes
from ucp.format.boxes import Box
from ucp.format.byte_ranges import ByteRange
from ucp.format.checked_read import OpenChunk, check_again, close_chunks, fetch, fill
from ucp.format.crc import crc32
from ucp.format.dtypes import NUMPY_DTYPES, to_torch
from ucp.format.index import StoredState
from ucp.format.safetensors_stream import TORCH_DTYPES
from ucp.plan.assemble import assemble
from ucp.plan.plan import ConversionPlan, Piece, StateSource
from ucp.storage.fileio import ReadCounter, tensor_bytes

Key = tuple[str, str]


class Source(Protocol):
    """What the hook reads tensors through (the checkpoint itself answers the checks: its index,
    optimizer and training state)."""

    def dtype(self, key: Key) -> torch.dtype:
        """The dtype the state's values come in (what the atomic format stores)."""

    def shared(self, key: Key, t: TargetTensor) -> bool:
        """Whether one rank of `t`'s data-parallel group reads `t`'s whole box for the group."""

    def check(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool, stats,
              into: dict[Key, torch.Tensor] | None = None) -> dict:
        """The check before a load, one layer: what `read` returns, read exactly once and checked as far as this
        rank can alone; parts of units it read only part of wait for `close`. Raises `CorruptCheckpointError`
        on damage. Adds to `stats.bytes_read`, `stats.read_calls` and `stats.bytes_checked_extra`. A key of
        `into` may be read straight into the tensor given there (flat, where its value goes), which is then
        its value: no buffer of its own (a source that cannot returns a value of its own)."""

    def close(self, stats) -> None:
        """Finish the check (a collective: every rank calls it once, after its last `check`, damage or not):
        the parts of units go to their owner ranks, which check them. Raises `CorruptCheckpointError` on damage."""

    def read(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool, stats) -> dict:
        """Read `readers` (keys of `wants`, one layer's): key -> the target's elements, flat; the whole box
        for a shared key (with `bypass`). A key `check` read is read again exactly and compared with what was
        checked (`stats.bytes_read_again`); any other adds to `stats.bytes_read` and `stats.read_calls`."""


def source_for(ckpt: AtomicCheckpoint | PlannedCheckpoint) -> Source:
    return AtomicSource(ckpt) if isinstance(ckpt, AtomicCheckpoint) else PlannedSource(ckpt.plan)


def box_numel(t: TargetTensor) -> int:
    """Elements of the part of the full tensor `t`'s module holds (what a shared key broadcasts)."""
    boxes = t.pieces or ((t.box,) if t.box is not None else ())
    return sum(math.prod(hi - lo for lo, hi in box) for box in boxes) if boxes else math.prod(t.shape)


def piece_runs(t: TargetTensor, run: tuple[int, int]) -> list[tuple[int, Box, tuple[int, int]]]:
    """(piece index, its box, the run of the box's elements) for each of `t`'s pieces that `run` (elements of their
    concatenation, `TargetTensor.pieces`) reaches into, in order."""
    out, first = [], 0
    for i, box in enumerate(t.pieces or ()):
        size = math.prod(hi - lo for lo, hi in box)
        lo, hi = max(run[0], first), min(run[1], first + size)
        if hi > lo:
            out.append((i, box, (lo - first, hi - first)))
        first += size
    return out


def _of_box(full: torch.Tensor, box: Box | None) -> torch.Tensor:
    """`box` of a full tensor, flat."""
    for dim, (lo, hi) in enumerate(box or ()):
        full = full.narrow(dim, lo, hi - lo)
    return full.reshape(-1)


def _count(stats, counter: ReadCounter) -> None:
    stats.bytes_read += counter.bytes
    stats.read_calls += counter.calls


def _chunk_unit(c: OpenChunk) -> tuple[str, int]:
    return c.file, c.begin


def _entry_unit(p: OpenEntry) -> tuple[str, int]:
    return p.file, p.entry.start


class AtomicSource:
    """A ucp checkpoint, read through its index."""

    def __init__(self, ckpt: AtomicCheckpoint):
        self.ckpt = ckpt
        self._opened: list[OpenChunk] = []
        self._crcs: dict[Key, int] = {}

    def _stored(self, key: Key) -> StoredState:
        name, state = key
        return self.ckpt.index.entry(name).states[state]  # an alias: its source

    def dtype(self, key: Key) -> torch.dtype:
        return TORCH_DTYPES[self._stored(key).dtype]

    def shared(self, key: Key, t: TargetTensor) -> bool:
        return t.whole

    def check(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool, stats,
              into: dict[Key, torch.Tensor] | None = None) -> dict:
        """See `Source.check`: exact reads, their whole chunks checked; a chunk a read holds part of (where ZeRO
        partitions meet) is closed from the parts the ranks read (`ucp.format.checked_read.close_chunks`).
        Values of their own (`into` unused)."""
        counter = ReadCounter()
        try:
            values, extra = read_boxes(self.ckpt.path, self._boxes(wants, readers, bypass), self.ckpt.index.chunk_bytes,
                                       counter, open_chunks=self._opened, crcs=self._crcs)
        finally:
            _count(stats, counter)
        stats.bytes_checked_extra += extra
        return self._joined(wants, readers, values)

    def close(self, stats) -> None:
        parts, exchanged = to_owners(self._opened, _chunk_unit)
        stats.bytes_exchanged += exchanged
        counter = ReadCounter()
        try:
            stats.bytes_checked_extra += close_chunks(self.ckpt.path, parts, counter)
        finally:
            _count(stats, counter)

    def _boxes(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool) -> dict[Key, BoxWant]:
        """What each reader reads: its box; a tensor of several pieces (`TargetTensor.pieces`), each piece its run
        reaches into, under a key of its own (`_piece_key`)."""
        boxes = {}
        for key in readers:
            t, stored = wants[key], self._stored(key)
            run = (t.start, t.start + t.numel)
            if t.pieces is None:
                boxes[key] = BoxWant(stored, t.box or full_box(stored.shape), run, whole=not bypass)
                continue
            for i, box, piece_run in piece_runs(t, run):
                boxes[_piece_key(key, i)] = BoxWant(stored, box, piece_run, whole=not bypass)
        return boxes

    @staticmethod
    def _joined(wants: dict[Key, TargetTensor], readers: list[Key], values: dict[Key, torch.Tensor]
                ) -> dict[Key, torch.Tensor]:
        """`values` of `_boxes`' keys as each reader's value: the runs of its pieces, one after another."""
        for key in readers:
            t = wants[key]
            if t.pieces is not None:
                run = (t.start, t.start + t.numel)
                parts = [values.pop(_piece_key(key, i)).reshape(-1) for i, _, _ in piece_runs(t, run)]
                values[key] = torch.cat(parts)
        return values

    def read(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool, stats) -> dict:
        """This rank's reads for one layer, coalesced and checked (see `Source.read`).

        With bypass a rank reads exactly its elements when they are contiguous in storage, else the
        covering part of its box (`ucp.format.box_read`); without, every tensor it touches whole. Without
        the check before, a partial read is widened to the chunks around it to be checked.
        """
        counter = ReadCounter()
        boxes = self._boxes(wants, readers, bypass)
        again = {key: self._crcs[key] for key in boxes if key in self._crcs}
        values, extra = read_boxes(self.ckpt.path, boxes, self.ckpt.index.chunk_bytes, counter,
                                   again=again if again else None)
        if again:  # read and checked once already: not the load's share of the checkpoint again
            stats.bytes_read_again += counter.bytes
        else:
            _count(stats, counter)
            stats.bytes_checked_extra += extra
        return self._joined(wants, readers, values)


def _piece_key(key: Key, piece: int) -> Key:
    """The read key of piece `piece` of `key`'s tensor (named in a damaged read's error)."""
    return key[0], f"{key[1]} (piece {piece})"


def _piece_range(piece: Piece) -> ByteRange:
    end = piece.byte_offset + piece.numel * TORCH_DTYPES[piece.dtype].itemsize
    return ByteRange(piece.path, piece.byte_offset, end)


class PlannedSource:
    """A DeepSpeed checkpoint, read through its conversion plan (see the module docstring)."""

    def __init__(self, plan: ConversionPlan):
        self.plan = plan
        self._params = {p.name: p for p in plan.params}
        self._params.update({alias: self._params[source] for alias, source in plan.aliases.items()})
        self._runs: dict[Key, tuple[FlatRun, ...] | None] = {}
        self._parts = EntryParts()
        self._crcs: dict[Key, list[int]] = {}
        paths = sorted({f.piece.path for p in plan.params for s in p.states.values() for f in s.fragments})
        root = os.path.commonpath(paths) if len(paths) > 1 else os.path.dirname(paths[0]) if paths else ""
        self._names = {path: os.path.relpath(path, root) for path in paths}  # the same on every rank

    def _state(self, key: Key) -> StateSource:
        return self._params[key[0]].states[key[1]]

    def _flat(self, key: Key) -> tuple[FlatRun, ...] | None:
        if key not in self._runs:
            self._runs[key] = flat_runs(self._state(key))
        return self._runs[key]

    def dtype(self, key: Key) -> torch.dtype:
        return TORCH_DTYPES[self._state(key).dtype]

    def shared(self, key: Key, t: TargetTensor) -> bool:
        return t.whole or self._flat(key) is None

    def check(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool, stats,
              into: dict[Key, torch.Tensor] | None = None) -> dict:
        """See `Source.check`: every range read is CRC'd; a zip entry read whole is checked at once, the part
        read of any other goes to the entry's owner (`close`). A key of `into` whose value is its run's bytes
        as stored (a flat-stored state in the dtype of the tensor given, which it fills) is read straight into
        that tensor, range after range."""
        direct = self._direct(wants, readers, bypass, into or {})
        ranges, raws = self._fetch(wants, readers, bypass, stats, again=False, direct=direct)
        crcs = {r: crc32(tensor_bytes(raw)) for r, raw in raws.items()}
        for r in sorted(crcs, key=lambda r: (r.file, r.begin, r.end)):
            self._parts.add(r.file, self._names[r.file], r.begin, r.end, crcs[r])
        for key, rs in ranges.items():
            self._crcs[key] = [crcs[r] for r in rs]
        values = self._values(wants, {k: rs for k, rs in ranges.items() if k not in direct}, raws, bypass)
        values.update(direct)
        return values

    def _direct(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool,
                into: dict[Key, torch.Tensor]) -> dict[Key, torch.Tensor]:
        """The keys of `into` that can be read straight into their tensors: a run of a flat-stored state, stored
        in the tensor's dtype, which the tensor holds contiguously, and no range of it read for another key."""
        direct = {}
        for key in readers:
            dest, t, runs = into.get(key), wants[key], self._flat(key) if bypass else None
            if (dest is None or runs is None or TORCH_DTYPES[runs[0].piece.dtype] != dest.dtype
                    or self.dtype(key) != dest.dtype or not dest.is_contiguous()
                    or not (t.box is None or t.box == full_box(t.shape))):
                continue
            lo, hi = self._span(key, t)
            if dest.numel() == hi - lo:
                direct[key] = dest
        if len(direct) > 0:
            seen: dict[ByteRange, int] = {}
            for key in readers:
                for r in self._reads(key, wants[key], bypass):
                    seen[r] = seen.get(r, 0) + 1
            direct = {key: dest for key, dest in direct.items()
                      if all(seen[r] == 1 for r in self._reads(key, wants[key], bypass))}
        return direct

    def close(self, stats) -> None:
        """See `Source.close`: each entry this rank owns is joined from every rank's parts of it, its gaps read
        (`stats.bytes_checked_sources`, not in `bytes_read`); small entries no part covers are read whole."""
        parts, exchanged = to_owners(self._parts.opened, _entry_unit)
        stats.bytes_exchanged += exchanged
        counter = ReadCounter()
        try:
            close_entries({name: path for path, name in self._names.items()}, parts, counter)
            covered = {_entry_unit(p) for p in parts}
            rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
            for path, name in sorted(self._names.items()):
                for entry in self._parts.entries(path)[1]:
                    unit = (name, entry.start)
                    if (entry.end - entry.start <= SMALL_ENTRY_BYTES and unit not in covered
                            and owner_of(unit, world) == rank):
                        check_entry(path, entry, counter)
        finally:
            stats.bytes_checked_sources += counter.bytes

    def read(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool, stats) -> dict:
        """This rank's reads for one layer (see `Source.read`), in the states' dtypes. Runs of flat-stored
        states are read exactly (the rows covering a TP box), touching ranges coalesced; other states,
        and all of them without bypass, whole."""
        again = bool(readers) and all(key in self._crcs for key in readers)
        ranges, raws = self._fetch(wants, readers, bypass, stats, again)
        if again:
            for key, rs in ranges.items():
                for r, crc in zip(rs, self._crcs[key]):
                    check_again(raws[r], crc, f"{r.file}: bytes [{r.begin}, {r.end}) of {key[0]}:{key[1]}")
        return self._values(wants, ranges, raws, bypass)

    def _fetch(self, wants: dict[Key, TargetTensor], readers: list[Key], bypass: bool, stats, again: bool,
               direct: dict[Key, torch.Tensor] | None = None
               ) -> tuple[dict[Key, list[ByteRange]], dict[ByteRange, torch.Tensor]]:
        """The byte ranges each reader's value comes from, and their bytes (touching ones read at once); those
        of a `direct` key are read into consecutive parts of its tensor instead (`_direct`)."""
        direct = direct or {}
        ranges = {key: self._reads(key, wants[key], bypass) for key in readers}
        counter = ReadCounter()
        try:
            raws = fetch(Path(), [r for key, rs in ranges.items() if key not in direct for r in rs if r.nbytes],
                         counter)  # absolute paths
            for key, dest in direct.items():
                raws.update(fill(Path(), ranges[key], dest.detach().view(-1).view(torch.uint8), counter))
        finally:
            if again:
                stats.bytes_read_again += counter.bytes
            else:
                _count(stats, counter)
        empty = torch.empty(0, dtype=torch.uint8)
        return ranges, {r: raws.get(r, empty) for rs in ranges.values() for r in rs}

    def _reads(self, key: Key, t: TargetTensor, bypass: bool) -> list[ByteRange]:
        """Where `key`'s value for `t` comes from: the bytes of its run (or of the rows covering its box) of a
        flat-stored state; else every fragment of the state, to materialise it whole."""
        runs = self._flat(key)
        if bypass and runs is not None:
            return run_reads(runs, *self._span(key, t), TORCH_DTYPES[runs[0].piece.dtype].itemsize)
        return [_piece_range(f.piece) for f in self._state(key).fragments]

    def _values(self, wants: dict[Key, TargetTensor], ranges: dict[Key, list[ByteRange]],
                raws: dict[ByteRange, torch.Tensor], bypass: bool) -> dict:
        values = {}
        for key, rs in ranges.items():
            t, runs, parts = wants[key], self._flat(key), [raws[r] for r in rs]
            if bypass and runs is not None:
                raw = parts[0] if len(parts) == 1 else torch.cat(parts)  # no copy for one
                stored = raw.view(TORCH_DTYPES[runs[0].piece.dtype])
                values[key] = self._from_span(stored.to(self.dtype(key)), key, t)
                continue
            state = self._state(key)  # Union and StripPad, as `ucp convert` would (ucp.plan.assemble)
            arrays = [raw.numpy().view(NUMPY_DTYPES[f.piece.dtype]).reshape(f.info.shape)
                      for raw, f in zip(parts, state.fragments)]
            full = to_torch(assemble(state, arrays, name=key[0]), state.dtype)
            values[key] = self._wanted(_of_box(full, t.box), key, t, bypass)
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
