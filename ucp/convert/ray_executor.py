"""The Ray backend: conversion as a MapReduce on a Ray cluster, and `ucp submit` (Ray job submission).

This is the only module that imports ray; `import ucp` never does.

`RayExecutor.write_bins` runs the plan's bins as a shuffle. One map task per source rank file
Extracts the fragments that file holds for each bin it feeds (positional reads, a few threads at a
time) and yields one object per bin, so a mapper holds one bin's share at a time. Fragments move by
ObjectRef through Ray's object store, from the mapper's node to the reducer's, never through the
driver (Ray keeps returns under 100 KiB inline with their owner, the driver: the fragments of small
parameters). One reduce task per bin Unions and StripPads each state and streams it into the bin's
safetensors file in the output directory, through `ucp.convert.driver.stream_bin`, with the local
backend's file writer, so the files are byte-identical. The driver plans, submits and commits the
index. Like the local backend's, the tasks work on numpy arrays and import no torch, and the bytes the
map tasks read are checked against the rank files' own CRC-32s (`ucp.convert.source_check`): each
reducer CRCs the pieces it receives, and the driver joins them per zip entry.

Ray retries a task whose worker or node died (`MAX_RETRIES`) and rebuilds lost map outputs from
lineage; a task that raises (a damaged shard) is not retried, and its error reaches the caller as
the original one-line ucp error.
"""
from __future__ import annotations

import asyncio
import itertools
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import ray
from ray.exceptions import RayError, RayTaskError

from ucp.convert.driver import WriteBin, WrittenBin, stream_bin
from ucp.convert.executor import Report, default_workers
from ucp.errors import UcpError
from ucp.format.crc import crc32
from ucp.format.dtypes import NUMPY_DTYPES
from ucp.format.index import DTYPE_SIZES
from ucp.plan.assemble import assemble
from ucp.plan.plan import Fragment, Piece
from ucp.sizes import human_bytes
from ucp.storage.fileio import pread_into

T = TypeVar("T")
R = TypeVar("R")

MAX_RETRIES = 3  # per task, on system failures only (killed worker, lost node); an exception is final
READ_THREADS = 4  # reads in flight per map task: NVMe and parallel file systems want several at once
HEARTBEAT_S = 30.0  # log a line at least this often while tasks run

# The ucp command lines `ucp submit` runs, and the subpackages setup.cfg maps under `ucp` (package_dir).
SUBMITTABLE = ("convert", "verify", "inspect")
_SUBPACKAGES = ("cli", "converters", "patterns")


class RayJobError(UcpError):
    """A Ray task failed for good (retries spent), or a Ray job could not be submitted."""


@dataclass(frozen=True)
class MapFile:
    """A map task: the pieces one source file holds for each bin it feeds, in the reducers' reading order."""

    path: str
    bins: tuple[int, ...]
    pieces: tuple[tuple[Piece, ...], ...]


def shuffle_plan(tasks: Sequence[WriteBin]) -> list[MapFile]:
    """One map task per source file, feeding every bin that has fragments in it."""
    per_file: dict[str, dict[int, tuple[Piece, ...]]] = {}
    for b, task in enumerate(tasks):
        for path, pieces in bin_pieces(task).items():
            per_file.setdefault(path, {})[b] = tuple(pieces)
    return [MapFile(path, tuple(per_file[path]), tuple(per_file[path].values())) for path in sorted(per_file)]


def bin_pieces(task: WriteBin) -> dict[str, list[Piece]]:
    """The pieces a bin needs from each source file, in the order its map output holds them."""
    found: dict[str, list[Piece]] = {}
    for p in task.params:
        for source in p.states.values():
            for f in source.fragments:
                found.setdefault(f.piece.path, []).append(f.piece)
    return found


def _layout(pieces: Sequence[Piece]) -> list[int]:
    """Byte offsets of `pieces` packed back to back in a map output."""
    return list(itertools.accumulate((_span(p) for p in pieces), initial=0))


def _span(piece: Piece) -> int:
    """Bytes a piece takes in a map output: its own, rounded up to 8 so every piece stays aligned."""
    return -(-piece.numel * DTYPE_SIZES[piece.dtype] // 8) * 8


@ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)
def _extract(job: MapFile):
    """Map: yield, for each bin `job` feeds, the bytes of its pieces back to back (Extract)."""
    with ThreadPoolExecutor(READ_THREADS) as pool:
        for pieces in job.pieces:
            starts = _layout(pieces)
            out = np.empty(starts[-1], dtype=np.uint8)
            list(pool.map(lambda start, p: pread_into(job.path, _view(out, start, p), p.byte_offset), starts, pieces))
            yield out


def _view(buffer: np.ndarray, start: int, piece: Piece) -> np.ndarray:
    """The piece's elements at byte `start` of a map output, without a copy."""
    nbytes = piece.numel * DTYPE_SIZES[piece.dtype]
    return buffer[start:start + nbytes].view(NUMPY_DTYPES[piece.dtype])


@ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)
def _reduce(task: WriteBin, paths: tuple[str, ...], *shares) -> WrittenBin:
    """Reduce: Union → StripPad each state from the mappers' shares and stream the bin's file.

    The shares are read-only views of the object store; fragments are views of them (Union and
    StripPad never write into their inputs), so the only copies are the ones Union makes. The
    result carries the CRC-32 of every piece's source bytes (`sources`), which the driver checks
    against the rank files' own CRCs (`ucp.convert.source_check`), as the local backend's are.
    """
    buffers = {path: np.frombuffer(share, dtype=np.uint8) for path, share in zip(paths, shares)}
    # Where each piece sits in its file's share: the layout the mapper used, whatever order the writer asks in.
    where = {path: dict(zip(pieces, _layout(pieces))) for path, pieces in bin_pieces(task).items()}

    def take(fragment: Fragment) -> np.ndarray:
        path = fragment.piece.path
        return _view(buffers[path], where[path][fragment.piece], fragment.piece).reshape(fragment.info.shape)

    written = stream_bin(task, _no_progress,
                         lambda p, source: assemble(source, [take(f) for f in source.fragments], name=p.name,
                                                    strict=task.strict))
    return WrittenBin(written, tuple(_source_segment(path, piece, buffers[path], start)
                                     for path, starts in where.items() for piece, start in starts.items()))


def _source_segment(path: str, piece: Piece, buffer: np.ndarray, start: int) -> tuple[str, int, int, int]:
    """(file, begin, end, CRC-32) of a piece's bytes as the mapper read them from the rank file."""
    nbytes = piece.numel * DTYPE_SIZES[piece.dtype]
    return path, piece.byte_offset, piece.byte_offset + nbytes, crc32(buffer[start:start + nbytes])


@ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False)
def _run(fn, task):
    return fn(task, _no_progress)


def _no_progress(nbytes: int) -> None:
    """Ray tasks do not stream byte counts; the driver logs progress as tasks finish."""


class RayExecutor:
    """Runs conversions on Ray: on the cluster at `address` (or $RAY_ADDRESS, which a Ray job sets),
    else on a local Ray instance of `workers` CPUs that it starts and stops. Use as a context manager.

    `workers` sets the number of bins, as for the local backend (same `workers`, same files); on a
    cluster it defaults to the cluster's CPU count.
    """

    def __init__(self, address: str | None = None, workers: int | None = None, progress: bool = True):
        self.address = address or os.environ.get("RAY_ADDRESS")
        self.requested = workers
        self.progress = progress
        self.workers = workers or 0

    def __enter__(self) -> RayExecutor:
        if self.address:
            try:
                ray.init(address=self.address)
            except (ConnectionError, RuntimeError) as exc:
                raise RayJobError(f"cannot join the Ray cluster at {self.address} ({_first_line(exc)}); start it "
                                  "with `ray start --head`, or pass its address as --ray-address HEAD:6379") from None
            self.workers = self.requested or max(1, int(ray.cluster_resources().get("CPU", 1)))
        else:
            self.workers = self.requested or default_workers()
            ray.init(num_cpus=self.workers, include_dashboard=False)
        nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
        self._log(f"{'connected to ' + self.address if self.address else 'started a local Ray instance'}: "
                  f"{nodes} node(s), {int(ray.cluster_resources().get('CPU', 0))} CPUs; {self.workers} workers")
        return self

    def __exit__(self, *exc) -> None:
        ray.shutdown()

    def map(self, fn: Callable[[T, Report], R], tasks: Sequence[T], *, total_bytes: int, desc: str) -> list[R]:
        """One Ray task per task (used to verify files under --resume, and for --format deepspeed)."""
        refs = [_run.remote(fn, t) for t in tasks]
        return self._gather(refs, [f"task {i}" for i in range(len(tasks))], [0] * len(tasks), desc)

    def write_bins(self, tasks: Sequence[WriteBin], *, total_bytes: int) -> list[WrittenBin]:
        if not tasks:
            return []
        maps = shuffle_plan(tasks)
        self._log(f"convert: {len(maps)} map tasks (one per source file) → {len(tasks)} reduce tasks "
                  f"(one per data file), {human_bytes(total_bytes)}")
        reducers = _submit_shuffle(tasks, maps)
        sizes = [sum(p.nbytes for p in t.params) for t in tasks]
        return self._gather(reducers, [t.file_name for t in tasks], sizes, "convert")

    def _gather(self, refs: list, labels: list[str], sizes: list[int], desc: str) -> list:
        results: list = [None] * len(refs)
        position = {ref: i for i, ref in enumerate(refs)}
        pending, done, done_bytes, start = list(refs), 0, 0, time.monotonic()
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1, timeout=HEARTBEAT_S)
                for ref in ready:
                    i = position[ref]
                    results[i] = _result(ref, labels[i])
                    done, done_bytes = done + 1, done_bytes + sizes[i]
                    of_bytes = f", {human_bytes(done_bytes)} of {human_bytes(sum(sizes))}" if sum(sizes) else ""
                    self._log(f"{desc}: {labels[i]} done ({done}/{len(refs)}{of_bytes}, "
                              f"{time.monotonic() - start:.1f} s)")
                if not ready:
                    self._log(f"{desc}: {done}/{len(refs)} done, running ({time.monotonic() - start:.0f} s)")
        except BaseException:
            for ref in pending:
                ray.cancel(ref, force=True)
            raise
        return results

    def _log(self, message: str) -> None:
        if self.progress:
            print(f"ucp ray: {message}", file=sys.stderr, flush=True)


def _submit_shuffle(tasks: Sequence[WriteBin], maps: list[MapFile]) -> list:
    """Submit every map and reduce task; returns the reducers' refs.

    The map outputs' refs live only in the reducers' task specs once this returns, so Ray frees
    each output as soon as its reducer is done.
    """
    inputs: list[list[tuple[str, ray.ObjectRef]]] = [[] for _ in tasks]
    for job in maps:
        refs = _extract.options(num_returns=len(job.bins)).remote(job)
        for b, ref in zip(job.bins, refs if isinstance(refs, list) else [refs]):  # one return: a ref, not a list
            inputs[b].append((job.path, ref))
    return [_reduce.remote(t, tuple(path for path, _ in inputs[b]), *(ref for _, ref in inputs[b]))
            for b, t in enumerate(tasks)]


def _result(ref, label: str):
    try:
        return ray.get(ref)
    except RayTaskError as exc:
        if isinstance(exc.cause, Exception) and not isinstance(exc.cause, RayError):
            raise exc.cause from None  # the task's own error (e.g. a truncated shard), as the local backend raises it
        raise RayJobError(f"ray: {label} failed: {_first_line(exc)}") from None
    except RayError as exc:
        raise RayJobError(f"ray: {label} failed after {MAX_RETRIES} retries ({type(exc).__name__}: "
                          f"{_first_line(exc)}); data files already finished are kept, run the same command "
                          "with --resume to convert the rest") from None


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


# --------------------------------------------------------------------------------------------------
# Job submission


def submit_job(address: str, argv: Sequence[str], *, working_dir: str | None = None, ship_ucp: bool = False) -> int:
    """Run `ucp <argv>` as a Ray job on the cluster whose job server is at `address`, print its logs
    until it ends, and return 0 when it succeeded, 1 otherwise.

    `convert` runs with `--executor ray` unless argv chooses an executor. With `ship_ucp`, this ucp
    is uploaded with the job (runtime_env `py_modules`) and runs as `python -m ucp.cli.main`;
    otherwise the cluster's nodes must have ucp installed. `working_dir` is uploaded and becomes
    the job's working directory.
    """
    from ray.job_submission import JobStatus, JobSubmissionClient

    argv = list(argv)
    if not argv or argv[0] not in SUBMITTABLE:
        raise UcpError(f"give the ucp command after '--' ({', '.join(SUBMITTABLE)}), e.g. "
                       "ucp submit --address http://HEAD:8265 -- convert --input /shared/ckpt --output /shared/out")
    if argv[0] == "convert" and not any(a == "--executor" or a.startswith("--executor=") for a in argv):
        argv += ["--executor", "ray"]
    program = ["python", "-m", "ucp.cli.main"] if ship_ucp else ["ucp"]
    entrypoint = shlex.join(program + argv)
    runtime_env: dict = {"working_dir": working_dir} if working_dir else {}
    with tempfile.TemporaryDirectory(prefix="ucp-submit-") as tmp:
        if ship_ucp:
            runtime_env["py_modules"] = [ucp_package_copy(tmp)]
        try:
            client = JobSubmissionClient(address)
            job_id = client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env or None)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            raise RayJobError(f"cannot submit to {address} ({_first_line(exc)}); pass the job "
                              "server of the head node, e.g. --address http://HEAD:8265") from None
    print(f"ucp submit: job {job_id} on {address}: {entrypoint}", file=sys.stderr, flush=True)
    try:
        asyncio.run(_tail_logs(client, job_id))
    except KeyboardInterrupt:
        print(f"ucp submit: stopped following job {job_id}, which keeps running; "
              f"stop it with: ray job stop --address {address} {job_id}", file=sys.stderr)
        return 130
    info = client.get_job_info(job_id)
    if info.status == JobStatus.SUCCEEDED:
        print(f"ucp submit: job {job_id} succeeded", file=sys.stderr)
        return 0
    print(f"ucp submit: job {job_id} {info.status.value.lower()}: {info.message or 'no message'}; "
          f"logs: ray job logs --address {address} {job_id}", file=sys.stderr)
    return 1


async def _tail_logs(client, job_id: str) -> None:
    async for chunk in client.tail_job_logs(job_id):
        sys.stdout.write(chunk)
        sys.stdout.flush()


def ucp_package_copy(folder: str) -> str:
    """A copy of the importable `ucp` package under `folder`, its mapped subpackages included, for py_modules.

    setup.cfg maps cli/, converters/ and patterns/ under `ucp`; an editable install keeps them
    outside ucp/, so they are copied in from wherever they are imported.
    """
    import importlib

    root = os.path.join(folder, "ucp")
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    # The package folder itself: this module is ucp/convert/ray_executor.py (no import of the top-level package,
    # which sits above every layer).
    shutil.copytree(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), root, ignore=skip)
    for name in _SUBPACKAGES:
        module = importlib.import_module(f"ucp.{name}")
        shutil.copytree(module.__path__[0], os.path.join(root, name), ignore=skip, dirs_exist_ok=True)
    return root
