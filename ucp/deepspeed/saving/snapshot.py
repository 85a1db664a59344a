"""The snapshot of a save: what the training thread copies, and waits for, before training goes on.

Each rank copies exactly what it writes into its snapshot buffer (`ucp.deepspeed.saving.writer.SnapshotBuffer`): its
ZeRO run of every fp32 master and optimizer moment, plus the replicated tensors (ZeRO-0 parameters, frozen
parameters, buffers) that byte balancing gives it. Under AutoTP a rank's run lies in its TP shard's box of the full
tensor, and a box that several TP ranks (or pipeline stages: a tied module) hold is written by one copy
(`ucp.deepspeed.saving.plan`, planned once from what every rank holds). `prepare` lays out the files and the buffer
(once per set of optimizer states; `Preparing` does it on a thread of its own, ahead of the first save, so that
training never waits for the planning nor for the buffer's pages); `copy_into` fills the buffer from the live
tensors at each save.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ucp.deepspeed.engine.targets import Target, TargetTensor
from ucp.deepspeed.saving.files import SaveFiles, arrange_files
from ucp.deepspeed.saving.layout import holdings, pattern_inputs, placed
from ucp.deepspeed.saving.plan import Holding, box_runs, pattern_of, tensors, writers
from ucp.deepspeed.saving.plan import entries as save_entries
from ucp.deepspeed.saving.writer import SavePiece, SnapshotBuffer
from ucp.format.folder import tensor_key
from ucp.format.index import FORMAT_NAME
from ucp.format.safetensors_stream import TORCH_DTYPES, TensorSlot
from ucp.patterns import PatternSpec
from ucp.plan.balance import TARGET_FILE_BYTES

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine
    from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class Prepared:
    """Layout and snapshot buffer for one set of optimizer states, reused by every save."""

    moments: tuple[str, ...]
    files: SaveFiles
    buffer: SnapshotBuffer
    copies: tuple[Copy, ...]                        # what the snapshot copies from the live tensors
    patterns: dict[str, PatternSpec]                # each tensor's pattern (on the leader, which builds the index)
    model: tuple[Holding, ...]                      # every tensor of the model (of every pipeline stage), in order


@dataclass(frozen=True)
class Copy:
    """Elements [offset, offset + numel) of a live tensor's `view(state)` go to buffer pieces [first, stop)."""

    tensor: TargetTensor
    state: str
    offset: int
    numel: int
    first: int
    stop: int

    def source(self) -> torch.Tensor:
        return self.tensor.view(self.state).narrow(0, self.offset, self.numel)


def prepare(engine: DeepSpeedEngine, target: Target, moments: tuple[str, ...], rank: int, leader: bool,
            every: list[Holding]) -> Prepared:
    """The files, buffer and copies of this rank's share, from what `every` rank of the saving group holds."""
    every = placed(engine, every)
    model = tensors(every)
    entries = save_entries(model)
    slots = [TensorSlot(tensor_key(h.name, s), dtype, h.shape) for h, s, dtype in entries]
    files = arrange_files(slots, TARGET_FILE_BYTES, {"format": FORMAT_NAME})
    element_bytes: dict[str, int] = {}
    for h, _, dtype in entries:
        element_bytes[h.name] = element_bytes.get(h.name, 0) + TORCH_DTYPES[dtype].itemsize
    mine = writers(every, element_bytes)
    local = {t.name: t for t in target.tensors}
    own: dict[str, list[Holding]] = {}  # this rank's holdings: a box each (several for a fused TP shard)
    for held in every:
        if held.rank == rank:
            own.setdefault(held.name, []).append(held)
    pieces, runs = [], []
    for h, state, dtype in entries:
        if (h.name, rank) not in mine:
            continue
        t, key = local[h.name], tensor_key(h.name, state)
        for part in own[h.name]:
            for first, offset, numel in box_runs(part.shape, part.box, part.start, part.numel):
                span = files.piece(key, first, numel, TORCH_DTYPES[dtype].itemsize)
                pieces.append(SavePiece(key, span.file, span.begin, span.end, dtype, first))
                runs.append((t, state, part.view_offset + offset, numel))
    buffer = SnapshotBuffer(pieces, pin=torch.device(engine.device).type == "cuda")
    of_piece = {(p.key, p.start): run for p, run in zip(pieces, runs)}
    patterns = {}
    if leader:
        patterns = {name: pattern_of(name, held[0].shape, held, hints)
                    for name, (held, hints) in pattern_inputs(engine, every).items()}
    return Prepared(moments, files, buffer, _copies(buffer, of_piece), patterns, tuple(model))


class Preparing:
    """`prepare` running on a thread of its own; `result` waits for it (and raises what it raised).

    The planning is pure and the buffer is this rank's own (allocated and every page touched there), so the
    training thread only waits where a save needs the layout before the thread is done."""

    def __init__(self, moments: tuple[str, ...], work: Callable[[], Prepared]):
        self.moments = moments
        self._prepared: Prepared | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(work,), name="ucp-save-prepare", daemon=True)
        self._thread.start()

    def _run(self, work: Callable[[], Prepared]) -> None:
        try:
            self._prepared = work()
        except BaseException as exc:  # handed to the training thread by `result`
            self._error = exc

    def result(self) -> Prepared:
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._prepared is None:
            raise RuntimeError("ucp: the snapshot's preparation ended without a result")
        return self._prepared


def every_holding(target: Target, rank: int, ranks: list[int], moments: tuple[str, ...], alone: bool
                  ) -> list[Holding]:
    """What every rank of the saving group `ranks` holds (collective, from the training thread, on the training
    group: the saver's own group belongs to the writer thread); `alone`: the group is this rank."""
    mine = holdings(target, rank, moments)
    if alone:
        return mine
    found: list[list[Holding]] = [[] for _ in ranks]
    world = ranks == list(range(dist.get_world_size()))
    group: ProcessGroup | None = None if world else target.dp_group
    dist.all_gather_object(found, mine, group=group)
    return [h for rank in found for h in rank]


def copy_into(prepared: Prepared, before: Callable[[], None]) -> torch.cuda.Event | None:
    """Copy this rank's pieces into the snapshot buffer, after the collectives every snapshot needs first
    (`before`); on a device, the event the writer waits on before it reads the pinned buffer."""
    with torch.no_grad():
        before()
        for c in prepared.copies:
            prepared.buffer.fill_pieces(c.first, c.stop, c.source())
    event: torch.cuda.Event | None = None
    if prepared.buffer.data.is_pinned():
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves its __init__ untyped
        event.record()
    return event


def _copies(buffer: SnapshotBuffer, runs: dict[tuple[str, int], tuple[TargetTensor, str, int, int]]
            ) -> tuple[Copy, ...]:
    """The snapshot's copies: each run of a live tensor into its buffer piece, runs that continue each other
    (the rows of one box, adjacent in the buffer and in the rank's shard) joined into one copy."""
    out: list[Copy] = []
    for i, p in enumerate(buffer.pieces):
        t, state, offset, numel = runs[(p.key, p.start)]
        last = out[-1] if out else None
        if (last is not None and last.tensor is t and last.state == state and last.offset + last.numel == offset
                and last.stop == i):
            out[-1] = Copy(t, state, last.offset, last.numel + numel, last.first, i + 1)
        else:
            out.append(Copy(t, state, offset, numel, i, i + 1))
    return tuple(out)
