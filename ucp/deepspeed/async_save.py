"""Asynchronous saves of a live DeepSpeed engine, straight into the atomic format.

    ucp.deepspeed.save(engine, "/ckpt/ucp")   # writes /ckpt/ucp/global_step<N>; returns at once
    ucp.deepspeed.wait(engine)                # the save is durable and committed once this returns

A save, on every rank of the data-parallel group (of the whole job under AutoTP, a pipeline, MoE or HMP):

1. (training thread) copies exactly what this rank writes into its snapshot buffer: its ZeRO run of
   every fp32 master and optimizer moment, plus the replicated tensors (ZeRO-0 parameters, frozen
   parameters, buffers) that byte balancing gives it. Under AutoTP a rank's run lies in its TP shard's
   box of the full tensor, and a box that several TP ranks (or pipeline stages: a tied module) hold is
   written by one copy (`ucp.deepspeed.save_plan`, planned once from what every rank holds, which also
   tells each rank the tensors of stages it does not run); rank 0 also copies the step,
   hyper-parameters, scheduler and client state. Then training goes on.
2. (writer thread) pwrites the snapshot at its final offsets in the shared data files, whose arrangement
   every rank computes alike (`ucp.deepspeed.save_files`), fsyncs them, and reports per-piece CRCs to rank 0
   over a gloo group of its own (the training thread owns the training group).
3. (rank 0's writer) when every rank reported success: renames the data files into place, commits
   the index, then points `<dir>/latest` at the new tag, and tells the other ranks the outcome.

Into object storage (`s3://bucket/prefix`) step 2 writes a local staging copy and uploads it as one multipart
upload per data file, each part by one rank, and step 3 completes the uploads before the index object and
`latest` (`ucp.deepspeed.object_save`).

Each checkpoint has its own folder `<dir>/<tag>`, and `latest` moves only after its index is
committed, so a crash, a killed process or a full disk mid-save leaves the previous checkpoint the
latest and loadable, and the new folder without an index ("incomplete checkpoint at ...").
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import sys
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import torch
import torch.distributed as dist

from ucp import collectives
from ucp.deepspeed.autotp import tp_size, with_tensor_parallel
from ucp.deepspeed.hmp_save import engine_hmp, place_target
from ucp.deepspeed.hmp_save import source_record as hmp_source
from ucp.deepspeed.memory_files import MemoryEvery
from ucp.deepspeed.save_files import SaveFiles, WrittenPiece, arrange_files, bytes_to_send, plan_parts, whole_crcs
from ucp.deepspeed.save_layout import (
    average_partials,
    holdings,
    mpu_tp_size,
    pattern_inputs,
    placed,
    refuse_unsupported,
)
from ucp.deepspeed.save_plan import Holding, box_runs, pattern_of, tensors, writers
from ucp.deepspeed.save_plan import entries as save_entries
from ucp.deepspeed.save_writer import BackgroundSave, SavePiece, SnapshotBuffer, partial_path, write_pieces
from ucp.deepspeed.targets import Target, TargetTensor, Zero3Target, module_aliases, target_for
from ucp.elastic.resume import prune
from ucp.errors import ConfigError, OutputExistsError, SaveError, UcpError
from ucp.format import loss_scale
from ucp.format.crc import CHUNK_BYTES
from ucp.format.folder import INDEX_NAME, commit_index, commit_latest, fsync_dir, tensor_key
from ucp.format.index import FORMAT_NAME, Index, RunRecord
from ucp.format.locations import Location, ObjectPath, location
from ucp.format.optimizer import optimizer_record
from ucp.format.safetensors_stream import TORCH_DTYPES, StoredTensor, TensorSlot
from ucp.format.storage import is_file
from ucp.patterns import PatternSpec
from ucp.plan.balance import TARGET_FILE_BYTES
from ucp.plan.index_builder import ParamRecord, WrittenFile, build_index

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

logger = logging.getLogger("ucp.save")
# What each rank's writer reports to rank 0: (key, start, numel, begin, end, segments) of each piece it wrote,
# or the error that stopped it.
T = TypeVar("T")
B = TypeVar("B")
RankReport = tuple[list[tuple[str, int, int, int, int, tuple[tuple[int, int, int], ...]]] | None, str | None]


@dataclass
class SaveStats:
    """One save as this rank saw it."""

    tag: str
    path: str
    snapshot_s: float = 0.0   # training was held this long (waiting for a previous save included)
    bytes: int = 0            # this rank's share, written by its writer thread
    durable_s: float = 0.0    # from the save call until the index was committed (0 while in flight)


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


class MemoryWriter(Protocol):
    """The host-memory tier as a saver sees it (`ucp.deepspeed.memory_tier.MemoryTier`)."""

    dir: Path
    last_step: int | None
    job: BackgroundSave

    def write(self, saver: Saver, prepared: Prepared, tag: str, meta: dict[str, Any] | None,
              event: torch.cuda.Event | None) -> None: ...


class Saver:
    """Saves one engine: its process group, the arrangement of its files, snapshot buffer and the save in flight."""

    def __init__(self, engine: DeepSpeedEngine):
        refuse_unsupported(engine)
        self.engine = engine
        self.target: Target = with_tensor_parallel(target_for(engine))
        hmp = engine_hmp(engine)
        if hmp is not None:  # each rank's slices of the layout; the whole job saves one checkpoint
            place_target(self.target, hmp, collectives.rank())
        self.before_snapshot = average_partials(engine, self.target)  # collectives every snapshot needs first
        self.rank = collectives.rank()
        if not dist.is_initialized():
            self.ranks = [0]
        elif (tp_size(engine) > 1 or getattr(engine, "pipeline_parallelism", False)
              or getattr(engine, "has_moe_layers", False) or hmp is not None):  # the whole job saves one checkpoint
            self.ranks = list(range(dist.get_world_size()))
        elif self.target.dp_group is not None:
            self.ranks = dist.get_process_group_ranks(self.target.dp_group)
        else:
            self.ranks = list(range(dist.get_world_size()))
        # A group of its own: the writer thread's collectives must never interleave with training's.
        self.group = dist.new_group(self.ranks, backend="gloo") if len(self.ranks) > 1 else None
        self.job = BackgroundSave()
        self.last_step: int | None = None
        self.stats: SaveStats | None = None
        self.keep: int | None = None  # after each commit, keep this many committed checkpoints (all when None)
        self.memory: MemoryWriter | None = None  # the host-memory tier, when the config has one
        self._prepared: dict[str, Prepared] = {}  # per tier ("disk", "memory"): each has a buffer of its own
        _LIVE.add(self)

    @property
    def leader(self) -> bool:
        return self.rank == self.ranks[0]

    def save(self, save_dir: str | os.PathLike[str], tag: str | None = None,
             client_state: dict[str, Any] | None = None, async_: bool = True) -> SaveStats:
        began = time.perf_counter()
        tag = tag or f"global_step{self.engine.global_steps}"
        self.job.wait_turn(tag)  # the buffer is reused: let the previous save finish (raises its failure)
        place = location(save_dir)
        folder = place.resolve() if isinstance(place, Path) else place
        tag_dir = folder / tag
        if is_file(tag_dir / INDEX_NAME):
            raise OutputExistsError(f"{tag_dir}: already holds a committed checkpoint; pass another tag or delete it")
        prepared, meta, event, stats = self._snapshot("disk", tag, tag_dir, client_state)
        self.last_step = self.engine.global_steps
        self.stats = stats

        def work() -> None:
            if isinstance(folder, ObjectPath):
                self._write_object(prepared, folder, tag, meta, event)
            else:
                self._write(prepared, folder, tag, meta, event)
            stats.durable_s = time.perf_counter() - began

        stats.snapshot_s = time.perf_counter() - began
        self.job.start(tag, work)
        if not async_:
            self.job.wait()
        return stats

    def save_memory(self, client_state: dict[str, Any] | None = None) -> SaveStats:
        """A save into the host-memory tier (`ucp.deepspeed.memory_tier`), in the background like `save`, with a
        snapshot buffer, writer thread and gloo group of its own: it never waits for a disk save in flight."""
        began = time.perf_counter()
        tier = self.memory
        if tier is None:
            raise ConfigError('no memory tier: add "memory": {"every": k} to "ucp": {"save": ...}')
        tag = f"global_step{self.engine.global_steps}"
        tier.job.wait_turn(tag)
        prepared, meta, event, stats = self._snapshot("memory", tag, tier.dir / tag, client_state)
        tier.last_step = self.engine.global_steps

        def work() -> None:
            tier.write(self, prepared, tag, meta, event)
            stats.durable_s = time.perf_counter() - began

        stats.snapshot_s = time.perf_counter() - began
        tier.job.start(tag, work)
        return stats

    def _snapshot(self, tier: str, tag: str, tag_dir: Location, client_state: dict[str, Any] | None
                  ) -> tuple[Prepared, dict[str, Any] | None, torch.cuda.Event | None, SaveStats]:
        """Copy this rank's pieces into the snapshot buffer (and on rank 0 take the metadata); training goes on
        once this returns."""
        if isinstance(tag_dir, Path):
            tag_dir.mkdir(parents=True, exist_ok=True)
        prepared = self._prepare(tier)
        with torch.no_grad():
            self.before_snapshot()
            for c in prepared.copies:
                prepared.buffer.fill_pieces(c.first, c.stop, c.source())
        event: torch.cuda.Event | None = None
        if prepared.buffer.data.is_pinned():
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves its __init__ untyped
            event.record()
        meta = _metadata(self, prepared, tag, tag_dir, client_state) if self.leader else None
        stats = SaveStats(tag, str(tag_dir), bytes=prepared.buffer.nbytes)
        return prepared, meta, event, stats

    def wait(self) -> SaveStats | None:
        """Wait for the disk save in flight, and the memory save (its stats are the disk save's)."""
        try:
            self.job.wait()
        finally:
            if self.memory is not None:
                self.memory.job.wait()
        return self.stats

    # -- files and buffer, rebuilt only when the optimizer's states change (e.g. after the first step)

    def _prepare(self, tier: str) -> Prepared:
        moments = tuple(self.target.state_names())
        known = self._prepared.get(tier)
        if known is not None and known.moments == moments:
            return known
        self._prepared.pop(tier, None)  # free the old buffer before allocating the new one
        every = placed(self.engine, self._every_holding(moments))
        model = tensors(every)
        entries = save_entries(model)
        slots = [TensorSlot(tensor_key(h.name, s), dtype, h.shape) for h, s, dtype in entries]
        files = arrange_files(slots, TARGET_FILE_BYTES, {"format": FORMAT_NAME})
        element_bytes: dict[str, int] = {}
        for h, _, dtype in entries:
            element_bytes[h.name] = element_bytes.get(h.name, 0) + TORCH_DTYPES[dtype].itemsize
        mine = writers(every, element_bytes)
        local = {t.name: t for t in self.target.tensors}
        own: dict[str, list[Holding]] = {}  # this rank's holdings: a box each (several for a fused TP shard)
        for held in every:
            if held.rank == self.rank:
                own.setdefault(held.name, []).append(held)
        pieces, runs = [], []
        for h, state, dtype in entries:
            if (h.name, self.rank) not in mine:
                continue
            t, key = local[h.name], tensor_key(h.name, state)
            for part in own[h.name]:
                for first, offset, numel in box_runs(part.shape, part.box, part.start, part.numel):
                    span = files.piece(key, first, numel, TORCH_DTYPES[dtype].itemsize)
                    pieces.append(SavePiece(key, span.file, span.begin, span.end, dtype, first))
                    runs.append((t, state, part.view_offset + offset, numel))
        buffer = SnapshotBuffer(pieces, pin=torch.device(self.engine.device).type == "cuda")
        of_piece = {(p.key, p.start): run for p, run in zip(pieces, runs)}
        patterns = {}
        if self.leader:
            patterns = {name: pattern_of(name, held[0].shape, held, hints)
                        for name, (held, hints) in pattern_inputs(self.engine, every).items()}
        prepared = Prepared(moments, files, buffer, _copies(buffer, of_piece), patterns, tuple(model))
        self._prepared[tier] = prepared
        return prepared

    def _every_holding(self, moments: tuple[str, ...]) -> list[Holding]:
        """What every rank of the saving group holds (collective, from the training thread, on the training
        group: the saver's own group belongs to the writer thread)."""
        mine = holdings(self.target, self.rank, moments)
        if self.group is None:
            return mine
        found: list[list[Holding]] = [[] for _ in self.ranks]
        world = self.ranks == list(range(dist.get_world_size()))
        dist.all_gather_object(found, mine, group=None if world else self.target.dp_group)
        return [h for rank in found for h in rank]

    # -- the writer thread

    def _write(self, prepared: Prepared, save_dir: Path, tag: str, meta: dict[str, Any] | None,
               event: torch.cuda.Event | None) -> None:
        tag_dir = save_dir / tag
        report: RankReport = (None, None)
        try:
            if event is not None:  # the device-to-host copies into the pinned buffer are done
                event.synchronize()
            written = write_pieces(tag_dir, prepared.files.files, prepared.buffer, headers=self.leader)
            report = ([(w.key, p.start, p.numel, w.begin, w.end, w.segments)
                       for w, p in zip(written, prepared.buffer.pieces)], None)
        except Exception as exc:  # reported to rank 0, which then does not commit
            report = (None, f"rank {self.rank}: {type(exc).__name__}: {exc}")
        reports: list[RankReport] | None = self._gather(report)
        outcome = None
        if reports is not None and meta is not None:  # rank 0 of the group: it took the metadata and gathers
            try:
                _commit(prepared, save_dir, tag, reports, meta)
            except Exception as exc:
                outcome = str(exc) if isinstance(exc, SaveError) else f"{tag_dir}: {type(exc).__name__}: {exc}"
        if self.leader and outcome is None and self.keep is not None:
            _prune(save_dir, self.keep)
        outcome = self._broadcast(outcome)
        if outcome is not None:
            raise SaveError(f"{outcome}; {save_dir / 'latest'} still names the previous checkpoint (fix the cause "
                            f"and save again, or delete the incomplete {tag_dir})")
        logger.info("ucp: saved %s", tag_dir)

    def _write_object(self, prepared: Prepared, save_dir: ObjectPath, tag: str, meta: dict[str, Any] | None,
                      event: torch.cuda.Event | None) -> None:
        """`_write` into an object store (`ucp.deepspeed.object_save`): stage, exchange the bytes of shared parts,
        upload each rank's parts, then rank 0 completes the uploads and writes the index object, then `latest`.
        On a store without S3's multipart uploads (another fsspec protocol) each file is one part, written whole
        by its uploader (`storage.part_bytes`). Every rank takes the same branch at each collective, whatever
        failed where."""
        from ucp.deepspeed import object_save

        tag_dir, files, me = save_dir / tag, prepared.files.files, self.ranks.index(self.rank)
        step = object_save.part_size(save_dir, files)
        staging, written, error = None, None, None
        uploads: dict[str, str] = {}
        etags: list[tuple[str, int, str]] = []
        try:
            runs = [(r.file, r.begin, r.end) for r in prepared.buffer.runs]
            parts = plan_parts(files, self._all_gather(runs), step)
            sends: list[list[tuple[str, int, bytes]]] = [[] for _ in self.ranks]
            try:
                staging = object_save.staging_dir()
                if event is not None:
                    event.synchronize()
                written = write_pieces(staging, files, prepared.buffer, headers=True)
                for uploader, name, begin, end in bytes_to_send(parts, runs, me, step):
                    sends[uploader] += object_save.read_ranges(staging, [(name, begin, end)])
            except Exception as exc:
                error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            got = collectives.all_to_all_objects([(error, mine) for mine in sends], self.group)
            error = error or next((e for e, _ in got if e), None)  # every rank knows whether any failed
            if error is None and staging is not None:  # staged (no error) on every rank
                opened: dict[str, str] | str = {}
                if self.leader:
                    try:
                        opened = object_save.open_uploads(save_dir, tag_dir, files)
                    except Exception as exc:
                        opened = f"rank {self.rank}: {type(exc).__name__}: {exc}"
                opened = self._broadcast(opened)
                if isinstance(opened, str):
                    error = opened
                else:
                    uploads = dict(opened)
                    try:
                        object_save.write_ranges(staging, [piece for _, theirs in got for piece in theirs])
                        etags = object_save.upload_mine(staging, tag_dir, uploads, parts, me)
                    except Exception as exc:
                        error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            report: RankReport = (None, error) if error is not None or written is None else (
                [(w.key, p.start, p.numel, w.begin, w.end, w.segments)
                 for w, p in zip(written, prepared.buffer.pieces)], None)
            reports = self._gather((report, etags))
            outcome = None
            if reports is not None and meta is not None:
                try:
                    index = index_of(prepared, tag_dir, [r for r, _ in reports], meta)
                    object_save.complete(tag_dir, uploads, [e for _, mine in reports for e in mine], parts)
                    commit_index(tag_dir, index)
                    commit_latest(save_dir, tag)
                except Exception as exc:
                    outcome = str(exc) if isinstance(exc, SaveError) else f"{tag_dir}: {type(exc).__name__}: {exc}"
                finally:
                    object_save.abort(tag_dir, uploads)  # whatever is still open: the save failed
                if outcome is None and self.keep is not None:
                    _prune(save_dir, self.keep)
            outcome = self._broadcast(outcome)
        finally:
            object_save.remove_staging(staging)
        if outcome is not None:
            raise SaveError(f"{outcome}; {save_dir / 'latest'} still names the previous checkpoint (fix the cause "
                            "and save again; the next save removes what this one left)")
        logger.info("ucp: saved %s", tag_dir)

    def _gather(self, report: T) -> list[T] | None:
        """Every rank's report, on rank 0 of the group; None on the others."""
        return collectives.gather_objects(report, self.ranks[0], self.group)

    def _all_gather(self, value: T) -> list[T]:
        return collectives.all_gather_objects(value, self.group)

    def _broadcast(self, outcome: B) -> B:
        return collectives.broadcast_object(outcome, self.ranks[0], self.group)


# -- what the index says besides tensors, taken at snapshot time on rank 0 --------------------------------

def _metadata(saver: Saver, prepared: Prepared, tag: str, tag_dir: Location,
              client_state: dict[str, Any] | None) -> dict[str, Any]:
    engine, target = saver.engine, saver.target
    groups, group_index = _param_groups(target, prepared.model)
    params = []
    for h in prepared.model:
        group = h.group  # every trainable tensor is in a param group
        params.append({"name": h.name, "shape": h.shape, "kind": h.kind, "states": dict(h.states),
                       "group": group_index[group] if group is not None else None,
                       "step": target.saved_step(group) if group is not None else None,
                       "model_dtype": h.model_dtype})
    config = engine.config if isinstance(engine.config, dict) else {}
    precision = "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"
    training = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                "skipped_steps": engine.skipped_steps}
    scaler = loss_scale.live_scaler(engine.optimizer)
    if precision == "fp16" and scaler is not None:
        training["loss_scaler"] = loss_scale.record_live(scaler)
    stages = engine.num_stages if getattr(engine, "pipeline_parallelism", False) else 1
    tp = tp_size(engine) * mpu_tp_size(engine)  # AutoTP's or a Megatron-style mpu's (never both)
    import deepspeed

    hmp = engine_hmp(engine)
    source = hmp_source(hmp) if hmp is not None else {"dp": len(saver.ranks) // (tp * stages), "tp": tp, "pp": stages}
    return {
        "params": params,
        "source": {"framework": "deepspeed", "ds_version": deepspeed.__version__,
                   "zero_stage": engine.zero_optimization_stage(), **source,
                   "precision": precision, "tag": tag, "path": str(tag_dir), "writer": "ucp.deepspeed.save"},
        "training": training,
        "optimizer": optimizer_record(config.get("optimizer"), groups, list(prepared.moments), engine.optimizer_name()),
        "lr_scheduler": _to_json(engine.lr_scheduler.state_dict()) if engine.lr_scheduler is not None else None,
        "client_state": _to_json(client_state or {}),
        "aliases": module_aliases(engine.module),  # what DeepSpeed's own save lists in shared_params
    }


def _param_groups(target: Target, model: Sequence[Holding]) -> tuple[list[dict[str, Any]], dict[int, int]]:
    """The torch param groups as the index records them, and each engine group's index among them: group i
    holds the trainable tensors of `model` (every pipeline stage's) in group i, with this rank's hyper-parameters
    of group i (the stages' optimizers are built from one config).

    ZeRO-3 splits a param group into sub-groups with the same hyper-parameters; like `ucp convert`,
    consecutive sub-groups with equal hyper-parameters are one group again.
    """
    names: dict[int, list[str]] = {}
    for h in model:
        if h.group is not None:
            names.setdefault(h.group, []).append(h.name)
    groups: list[dict[str, Any]] = []
    index = {}
    for i, entry in enumerate(target.optimizer_groups):
        hyper = _to_json({k: v for k, v in entry["group"].items() if k != "params"})
        if isinstance(target, Zero3Target) and groups and groups[-1]["hyperparams"] == hyper:
            groups[-1]["params"] += names.get(i, [])
        else:
            groups.append({"hyperparams": hyper, "params": names.get(i, [])})
        index[i] = len(groups) - 1
    return groups, index


def _to_json(value: object) -> Any:
    """A JSON copy of `value`: tensors as numbers or lists, anything else JSON cannot hold by its repr."""
    def plain(v: object) -> object:
        if torch.is_tensor(v):
            return v.item() if v.dim() == 0 else v.tolist()
        return repr(v)
    return json.loads(json.dumps(value, default=plain))


# -- rank 0's commit -------------------------------------------------------------------------------------

def _commit(prepared: Prepared, save_dir: Path, tag: str, reports: list[RankReport], meta: dict[str, Any]) -> None:
    tag_dir = save_dir / tag
    index = index_of(prepared, tag_dir, reports, meta)
    for f in prepared.files.files:
        os.replace(partial_path(tag_dir, f.name), tag_dir / f.name)
    fsync_dir(tag_dir)
    commit_index(tag_dir, index)
    commit_latest(save_dir, tag)


def index_of(prepared: Prepared, tag_dir: Location, reports: list[RankReport], meta: dict[str, Any]) -> Index:
    """The index of the save the ranks' `reports` describe (each rank's pieces must tile every tensor)."""
    failed = [error for _, error in reports if error]
    if failed:
        raise SaveError(f"{tag_dir}: not committed, {failed[0]}")
    pieces = [WrittenPiece(key, begin, end, tuple((lo, hi, crc) for lo, hi, crc in segments))
              for report, _ in reports for key, _start, _numel, begin, end, segments in report or []]
    crcs = whole_crcs(prepared.files, pieces)
    params = [_param_record(p, prepared.patterns[p["name"]]) for p in meta["params"]]
    fingerprint = hashlib.sha256(f"{tag_dir}:{time.time_ns()}".encode()).hexdigest()[:32]
    run = RunRecord(meta["source"], meta["training"], meta["optimizer"], meta["lr_scheduler"], meta["client_state"])
    written = [WrittenFile(f.name, f.size, CHUNK_BYTES,
                           {k: StoredTensor(k, s.begin, s.end, crcs[k][0], tuple(crcs[k][1]))
                            for k, s in prepared.files.spans.items() if s.file == f.name})
               for f in prepared.files.files]
    return build_index(run, meta["aliases"], params, fingerprint, written)


def _prune(save_dir: Location, keep: int) -> None:
    """Retention after a commit; a checkpoint that cannot be removed stays, said in the log (the save stands)."""
    try:
        removed = prune(save_dir, keep)
    except (OSError, UcpError) as exc:
        logger.warning("ucp: keeping old checkpoints in %s: %s", save_dir, exc)
        return
    for tag in removed:
        logger.info("ucp: removed %s (\"keep\": %d)", tag, keep)


def _param_record(p: dict[str, Any], pattern: PatternSpec) -> ParamRecord:
    """The parameter's index record; its pattern says how the ranks held it (as `ucp convert` records it)."""
    return ParamRecord(name=p["name"], kind=p["kind"], shape=tuple(p["shape"]), pattern=pattern,
                       dtypes=dict(p["states"]), model_dtype=p["model_dtype"], group=p["group"], step=p["step"])


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


# -- one saver per engine, and the public entry points -------------------------------------------------

_LIVE: weakref.WeakSet[Saver] = weakref.WeakSet()


def saver_for(engine: DeepSpeedEngine) -> Saver:
    """The engine's saver, created on first use (collectively: every rank must reach this together)."""
    saver = getattr(engine, "_ucp_saver", None)
    if saver is None:
        saver = Saver(engine)
        engine._ucp_saver = saver
    return saver


def save(engine: DeepSpeedEngine, path: str | os.PathLike[str], tag: str | None = None, async_: bool = True, *,
         client_state: dict[str, Any] | None = None) -> SaveStats:
    """Save `engine` into `<path>/<tag>` (default tag `global_step<N>`), then point `<path>/latest` at it.

    Call on every rank. Returns once this rank's state is snapshotted (with `async_=False`, once
    the checkpoint is committed). A save still writing when the next one starts is waited for,
    with a warning in the log. A failed save raises `SaveError` from the next `save` or `wait`.
    """
    location(path)  # a URL no storage takes is refused before the engine is touched
    return saver_for(engine).save(path, tag, client_state, async_)


def wait(engine: DeepSpeedEngine) -> SaveStats | None:
    """Block until the engine's save in flight is committed; its stats (None if it never saved).

    Raises `SaveError` if it failed. Runs for every engine at interpreter exit too; call it before
    `torch.distributed.destroy_process_group()`, which would cut the writer's collectives.
    """
    saver = getattr(engine, "_ucp_saver", None)
    return saver.wait() if saver is not None else None


@dataclass(frozen=True)
class SaveEvery:
    """The `"save"` section of the `"ucp"` config: save into `dir` after every `every`-th optimizer step, and
    keep the newest `keep` committed checkpoints there (all when None; `ucp.elastic.resume.prune`); with
    `memory`, save into the host-memory tier too (`ucp.deepspeed.memory_tier`)."""

    dir: str
    every: int
    keep: int | None = None
    memory: MemoryEvery | None = None

    @classmethod
    def from_config(cls, options: object) -> SaveEvery:
        if not isinstance(options, dict) or not isinstance(options.get("dir"), (str, os.PathLike)):
            raise ConfigError(f'"ucp": {{"save": {options!r}}}: needs "dir", the folder to save into, e.g. '
                              '{"dir": "/ckpt/ucp", "every": 100}')
        for key in ("every", "keep"):
            value = options.get(key)
            if key == "keep" and value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                what = "optimizer steps" if key == "every" else "checkpoints to keep (at least 1)"
                raise ConfigError(f'"ucp": {{"save": {{"{key}": {value!r}}}}}: must be a positive number of {what}')
        unknown = set(options) - {"dir", "every", "keep", "memory"}
        if unknown:
            raise ConfigError(f'"ucp": {{"save": ...}}: unknown key {sorted(unknown)[0]!r}; known: "dir", "every", '
                              '"keep", "memory"')
        location(options["dir"])  # a URL no storage takes is refused in one line, before training
        memory = MemoryEvery.from_config(options["memory"], os.fspath(options["dir"])) if "memory" in options else None
        return cls(os.fspath(options["dir"]), options["every"], options.get("keep"), memory)

    def install(self, engine: DeepSpeedEngine) -> None:
        """Wrap `engine.step` to save after every `every`-th optimizer step (and into the memory tier, which the
        caller attached to the engine's saver, after every `memory.every`-th).

        Client state for these saves is read from `engine.ucp_client_state` (a dict) when set;
        `engine.ucp_save_dir` says where they go.
        """
        saver = saver_for(engine)
        engine.ucp_save_dir = self.dir
        saver.last_step = engine.global_steps
        saver.keep = self.keep
        # A pipeline engine steps inside train_batch (its `step` refuses to be called).
        method = "train_batch" if getattr(engine, "pipeline_parallelism", False) else "step"
        step: Callable[..., Any] = getattr(engine, method)

        def step_and_save(*args: Any, **kwargs: Any) -> Any:
            result = step(*args, **kwargs)
            steps, client_state = engine.global_steps, getattr(engine, "ucp_client_state", None)
            memory = saver.memory
            if (self.memory is not None and memory is not None and steps % self.memory.every == 0
                    and steps != memory.last_step):
                saver.save_memory(client_state)
            if steps % self.every == 0 and steps != saver.last_step:
                saver.save(self.dir, None, client_state, True)
            return result

        setattr(engine, method, step_and_save)


def wait_all() -> list[SaveError]:
    """Wait for every engine's save in flight; the failures, each logged (at exit, and by `finish`)."""
    failed = []
    for saver in list(_LIVE):
        try:
            saver.wait()
        except SaveError as exc:
            logger.error("ucp: at exit: %s", exc)
            failed.append(exc)
    return failed


def _wait_at_exit() -> None:
    """At exit, wait for the saves in flight, unless the process ends on an uncaught error: its peers may be gone or
    wait for this rank, so the save's collectives could block for the group's whole timeout and, with them, the
    restart of the job (the peers' next collective fails once this process is gone). The save is not committed;
    the previous checkpoint stays the newest."""
    if getattr(sys, "last_value", None) is not None:   # set by the interpreter for an uncaught exception
        if _LIVE:
            logger.warning("ucp: the process ends on an error: a save still in flight is abandoned, not committed")
        return
    wait_all()


atexit.register(_wait_at_exit)
