"""Conversion as a MapReduce: plan (driver) → write bins (executor) → commit the index (driver).

Each task reads the fragments of its parameters straight from the rank files (Extract), merges
them (Union, StripPad) one state at a time, and writes them into its own safetensors file
(`ucp.convert.bin_copy`: most states are copied block by block, never whole), so every source byte is read
once, every output byte written once, and a worker never holds more than one state of one parameter.
The bytes read are checked against the rank files' own CRC-32s (`ucp.convert.source_check`), and the index
is committed only after that and after every file is durable. Neither the driver nor the workers
import torch.

Each finished data file gets a manifest (see `ucp.convert.manifest`), so `--resume` redoes only the bins an
interrupted run did not finish. A `ShuffleExecutor` (the Ray backend) runs the same bins as a
MapReduce instead, with the same writer, so its files are byte-identical.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ucp.convert.bin_copy import BinFile, SourceSegment, copy_states, write_array
from ucp.convert.executor import Executor, LocalExecutor, Report, ShuffleExecutor
from ucp.convert.manifest import (
    MANIFEST_SUFFIX,
    BinCheck,
    committed_damage,
    manifest_name,
    remove_manifests,
    reusable_bin,
    write_manifest,
)
from ucp.convert.object_input import local_source
from ucp.convert.result import ConvertResult
from ucp.convert.source_check import check_sources
from ucp.convert.split_policy import SplitPolicy, apply_split_policy
from ucp.converters.trainer_folders import left_out_summary
from ucp.errors import CorruptCheckpointError, OutputExistsError, UcpError, UnsupportedStorageError
from ucp.format.crc import CHUNK_BYTES, crc32, join_segments
from ucp.format.folder import (
    INDEX_NAME,
    PARTIAL_SUFFIX,
    commit_index,
    data_file_name,
    fsync_dir,
    is_ucp_file,
    local_path,
    read_index,
    tensor_key,
)
from ucp.format.index import FORMAT_NAME, ExtraFile, stored_shape
from ucp.format.safetensors_stream import StoredTensor, TensorSlot
from ucp.format.splits import to_split_major
from ucp.plan.balance import plan_bins
from ucp.plan.index_builder import WrittenFile, build_index, records_of
from ucp.plan.plan import ConversionPlan, ParamPlan, StateSource
from ucp.storage.fileio import read_regular, writing_alone
from ucp.storage.layer import is_remote
from ucp.storage.locations import Location, location

logger = logging.getLogger("ucp.convert")


@dataclass(frozen=True)
class WriteBin:
    output: str
    file_name: str
    params: tuple[ParamPlan, ...]
    strict: bool
    fingerprint: str  # of the source, recorded in the bin's manifest so --resume keeps only this conversion's files
    chunk_bytes: int = CHUNK_BYTES  # the states' chunk checksums cover runs of this many bytes


def convert(input_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str], *, tag: str | None = None,
            workers: int | None = None, fmt: str = "ucp", strict: bool = False,
            executor: Executor | None = None, progress: bool = True,
            param_names: list[str] | None = None, resume: bool = False,
            splits: SplitPolicy | None = None, patterns: dict[str, str] | None = None,
            chunk_bytes: int = CHUNK_BYTES) -> ConvertResult:
    """Convert the DeepSpeed checkpoint at `input_dir` into `output_dir` (format `ucp` or `deepspeed`).

    With `resume`, data files that an interrupted conversion of the same source finished are kept
    when they still match their checksums; only the other bins are converted again. With `splits`,
    tensors are stored split-major along their TP partition dim (docs/FORMAT.md, "Splits").
    `patterns` (`--pattern`) says how the TP shards of parameters join, by name or regex of names,
    for tensor-parallel sources that do not declare it.
    """
    from ucp.converters.dispatch import plan_deepspeed

    source = location(input_dir)  # a URL no installed filesystem serves is refused before anything is read or written
    output = location(output_dir)
    if is_remote(output) and (fmt != "ucp" or resume):
        raise UnsupportedStorageError(f"{output}: --output s3:// takes --format ucp without --resume (an interrupted "
                                      "conversion to object storage is converted again); convert to a local folder "
                                      "for --format deepspeed")
    if fmt not in ("ucp", "deepspeed"):
        raise UcpError(f"unknown output format '{fmt}'; use 'ucp' or 'deepspeed'")
    if resume and fmt != "ucp":
        raise UcpError("--resume works with --format ucp only; for --format deepspeed delete the output "
                       "directory and convert again")
    if splits is not None and fmt != "ucp":
        raise UcpError("--splits works with --format ucp only")
    executor = executor or LocalExecutor(workers, progress=progress)
    with local_source(source, tag) as local:
        plan = plan_deepspeed(local, tag, param_names, patterns)
        if local != source and fmt == "ucp":  # the index names the URL (the deepspeed format reads the copy)
            plan.source["path"] = plan.source["path"].replace(str(local.resolve()), str(source), 1)
        return _write(plan, output, executor, fmt=fmt, strict=strict, resume=resume, splits=splits,
                      chunk_bytes=chunk_bytes)


def _write(plan: ConversionPlan, output: Location, executor: Executor, *, fmt: str, strict: bool, resume: bool,
           splits: SplitPolicy | None, chunk_bytes: int) -> ConvertResult:
    """Write the checkpoint `plan` reads into `output`, in format `fmt`."""
    if splits is not None:
        plan = apply_split_policy(plan, splits)
    if fmt == "deepspeed":
        from ucp.convert.deepspeed_format import write_deepspeed_universal

        return write_deepspeed_universal(plan, local_path(output, "ucp convert --format deepspeed --output"),
                                         executor, strict=strict)
    if is_remote(output):
        from ucp.convert.object_output import convert_to_object_store

        return convert_to_object_store(output, source_fingerprint(plan, chunk_bytes), lambda staging: write_atomic(
            plan, staging, executor, strict=strict, chunk_bytes=chunk_bytes))
    return write_atomic(plan, output, executor, strict=strict, resume=resume, chunk_bytes=chunk_bytes)


def source_fingerprint(plan: ConversionPlan, chunk_bytes: int = CHUNK_BYTES) -> str:
    """Identifies the source files (names, sizes, mtimes), to tell 'already converted' from 'different'.

    A split-major conversion also folds in every tensor's (dim, count), so neither the 'already
    converted' check nor --resume mixes files of another split layout.
    """
    h = hashlib.sha256()
    for path in sorted([*plan.source_files, *plan.extra_files.values()]):
        st = os.stat(path)
        h.update(f"{os.path.basename(path)}:{st.st_size}:{st.st_mtime_ns};".encode())
    for p in plan.params:
        if p.splits is not None:
            h.update(f"{p.name}:{p.splits};".encode())
    if chunk_bytes != CHUNK_BYTES:
        h.update(f"chunks:{chunk_bytes};".encode())
    return h.hexdigest()[:32]


def prepare_output(output: Path, fingerprint: str, resume: bool = False,
                   carried: frozenset[str] = frozenset()) -> bool:
    """Make `output` ready to receive a checkpoint; True when it already holds this very conversion.

    Leftovers of an interrupted run (ucp's files, and the `carried` extra files it copies) are
    deleted, unless `resume` asks to keep them for `keep_finished`.
    """
    if (output / INDEX_NAME).is_file():
        existing = read_index(output).run.source
        if existing.get("fingerprint") == fingerprint:
            return True
        raise OutputExistsError(f"{output}: already holds a different checkpoint (converted from "
                                f"{existing.get('path', 'elsewhere')}); choose another --output "
                                "or delete it")
    if output.exists():
        foreign = [n for n in os.listdir(output)
                   if not is_ucp_file(n) and n.removesuffix(PARTIAL_SUFFIX) not in carried]
        if foreign:
            raise OutputExistsError(f"{output}: is not empty (holds '{foreign[0]}', which ucp did not write); "
                                    "choose an empty or new --output directory")
        if not resume:
            for name in os.listdir(output):  # leftovers of an interrupted run: not a checkpoint
                os.remove(output / name)
    output.mkdir(parents=True, exist_ok=True)
    return False


def write_atomic(plan: ConversionPlan, output: Path, executor: Executor, *, strict: bool = False,
                 resume: bool = False, chunk_bytes: int = CHUNK_BYTES) -> ConvertResult:
    """Write `plan`'s tensors into the ucp checkpoint `output` (each state's chunk checksums over
    runs of `chunk_bytes`, see docs/FORMAT.md) and commit its index."""
    with writing_alone(output):
        return _write_atomic(plan, output, executor, strict=strict, resume=resume, chunk_bytes=chunk_bytes)


def _write_atomic(plan: ConversionPlan, output: Path, executor: Executor, *, strict: bool,
                  resume: bool, chunk_bytes: int) -> ConvertResult:
    fingerprint = source_fingerprint(plan, chunk_bytes)
    if prepare_output(output, fingerprint, resume, frozenset(plan.extra_files)):
        remove_manifests(output)  # left behind when a run died between its commit and this cleanup
        index = read_index(output)
        damage = committed_damage(output, index)  # "already done" only where the data still is what was committed
        if damage is not None:
            raise CorruptCheckpointError(f"{output}: holds this conversion, but its data changed after the commit "
                                         f"({damage}); delete the folder and convert again")
        return ConvertResult(output, len(index.params), tuple(index.files), 0, already_done=True)
    bins = plan_bins(plan, executor.workers)
    tasks = [WriteBin(str(output), data_file_name(i, len(bins)), tuple(b), strict, fingerprint, chunk_bytes)
             for i, b in enumerate(bins)]
    kept = keep_finished(output, tasks, executor) if resume else {}
    todo = [t for t in tasks if t.file_name not in kept]
    total = sum(p.nbytes for t in todo for p in t.params)
    if isinstance(executor, ShuffleExecutor):
        results = executor.write_bins(todo, total_bytes=total)
    else:
        results = executor.map(write_bin, todo, total_bytes=total, desc="convert")
    try:
        check_sources(plan, [s for r in results for s in r.sources])
    except UcpError:
        remove_manifests(output)  # so that no --resume keeps a file converted from damaged bytes
        raise
    extra = {name: copy_extra_file(Path(source), output / name) for name, source in plan.extra_files.items()}
    if plan.left_out:
        logger.info("left out of %s: %s", output, left_out_summary(plan.left_out))
    fsync_dir(output)
    index = build_index(*records_of(plan), fingerprint, [*kept.values(), *(r.file for r in results)], extra)
    commit_index(output, index)
    remove_manifests(output)
    return ConvertResult(output, len(plan.params), tuple(index.files),
                         sum(f.nbytes for f in index.files.values()), files_written=len(todo) + len(extra) + 1,
                         redone=sum(len(t.params) for t in todo))


def keep_finished(output: Path, tasks: list[WriteBin], executor: Executor) -> dict[str, WrittenFile]:
    """--resume: the results of bins whose data files an earlier run finished and that are still intact.

    Everything else ucp left in `output` (partial files, files of bins that are redone, files of a
    run with another worker count) is deleted before the conversion writes anything.
    """
    checks = [BinCheck(t.output, t.file_name, tuple(s.key for s in bin_slots(t.params)), t.fingerprint)
              for t in tasks if (output / manifest_name(t.file_name)).is_file()]
    size = sum(os.path.getsize(output / c.file_name) for c in checks if (output / c.file_name).is_file())
    found = executor.map(reusable_bin, checks, total_bytes=size, desc="verify") if checks else []
    kept = {c.file_name: r for c, r in zip(checks, found) if r is not None}
    for name in os.listdir(output):
        if name not in kept and name.removesuffix(MANIFEST_SUFFIX) not in kept:
            os.remove(output / name)
    fsync_dir(output)
    return kept


def bin_slots(params: tuple[ParamPlan, ...]) -> list[TensorSlot]:
    return [TensorSlot(tensor_key(p.name, state), source.dtype, stored_shape(p.shape, p.splits))
            for p in params for state, source in p.states.items()]


@dataclass(frozen=True)
class WrittenBin:
    """What a reduce task returns: the data file it wrote, and the CRC-32 segments of the source bytes it
    read, (path, begin, end, crc32) each, for `ucp.convert.source_check` (not kept in the manifest)."""

    file: WrittenFile
    sources: tuple[tuple[str, int, int, int], ...]


def write_bin(task: WriteBin, report: Report) -> WrittenBin:
    """A reduce task that Extracts its own fragments, by byte offset from the rank files."""
    return WrittenBin(*_write_file(task, report, lambda out, slots, after_state: copy_states(
        out, task.params, slots, task.strict, after_state)))


def stream_bin(task: WriteBin, report: Report,
               state_array: Callable[[ParamPlan, StateSource], np.ndarray]) -> WrittenFile:
    """Write every state of the bin's parameters, as `state_array` gives it, into one safetensors file
    (the Ray backend's reducer, whose fragments come from the object store; the same bytes as `write_bin`'s)."""

    def fill(out: BinFile, slots: list[TensorSlot], after_state: Callable[[StateSource], None]) -> Filled:
        stored, keys = {}, iter(slots)
        for p in task.params:
            for source in p.states.values():
                slot = next(keys)
                array = state_array(p, source)
                if p.splits is not None:
                    array = to_split_major(array, *p.splits)
                if array.nbytes != slot.nbytes:
                    raise ValueError(f"{slot.key}: got {array.nbytes} bytes, the header says {slot.nbytes}")
                begin, end = out.begins[slot.key], out.begins[slot.key] + slot.nbytes
                whole, chunks = join_segments(write_array(out, array, begin), begin, end, out.chunk_bytes)
                stored[slot.key] = StoredTensor(slot.key, begin, end, whole, tuple(chunks))
                after_state(source)
        return stored, []

    return _write_file(task, report, fill)[0]


# Where each state of a bin landed, and the source segments read: what a bin writer's `fill` returns.
Filled = tuple[dict[str, StoredTensor], list[SourceSegment]]


def _write_file(task: WriteBin, report: Report,
                fill: Callable[[BinFile, list[TensorSlot], Callable[[StateSource], None]], Filled],
                ) -> tuple[WrittenFile, tuple[SourceSegment, ...]]:
    """The bin's file, written by `fill(file, slots, after_state)` (which returns where each state landed and
    the source segments read); durable (fsynced, renamed, directory fsynced) before its manifest is written."""
    final = os.path.join(task.output, task.file_name)
    partial = final + PARTIAL_SUFFIX
    slots = bin_slots(task.params)
    states_written = 0

    def after_state(source: StateSource) -> None:
        nonlocal states_written
        report(source.nbytes)
        states_written += 1
        if states_written == 1:
            _hold_for_tests(task.file_name)

    out = None
    try:
        out = BinFile(partial, slots, {"format": FORMAT_NAME}, task.chunk_bytes)
        stored, sources = fill(out, slots, after_state)
        out.close()
    except BaseException:
        if out is not None:
            out.abort()
        with contextlib.suppress(FileNotFoundError):
            os.remove(partial)
        raise
    os.replace(partial, final)
    fsync_dir(Path(task.output))
    # The size the header planned and the writes filled, never read back: another process may own the path by now.
    written = WrittenFile(task.file_name, out.size, task.chunk_bytes, stored)
    write_manifest(task.output, written, task.fingerprint)
    return written, tuple(sources)


def _hold_for_tests(file_name: str) -> None:
    """Fault injection for tests/integration/test_ray.py, inert unless $UCP_TEST_HOLD_DIR is set.

    While `$UCP_TEST_HOLD_DIR/<file_name>.hold` exists, the writer of that data file stops after its
    first tensor, having written its pid to `<file_name>.pid`, so a test can kill it mid-file.
    """
    folder = os.environ.get("UCP_TEST_HOLD_DIR")
    hold = os.path.join(folder or "", file_name + ".hold")
    if not folder or not os.path.exists(hold):
        return
    pid_file = os.path.join(folder, file_name + ".pid")
    with open(pid_file + PARTIAL_SUFFIX, "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + PARTIAL_SUFFIX, pid_file)
    while os.path.exists(hold):
        time.sleep(0.05)


def copy_extra_file(source: Path, target: Path) -> ExtraFile:
    """Copy a small side file (see `ucp.converters.trainer_folders`) durably; its index record: size and CRC-32."""
    data = read_regular(str(source), follow=False)  # planned as a regular file: still no link, FIFO or device
    partial = target.with_name(target.name + PARTIAL_SUFFIX)
    with open(partial, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, target)
    return ExtraFile(target.name, len(data), crc32(data))
