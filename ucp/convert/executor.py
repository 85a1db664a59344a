"""Where conversion tasks run: a local process pool by default, Ray (`ucp.convert.ray_executor`) on a cluster.

A task function has the signature `fn(task, report)`, where `report(nbytes)` feeds the progress
bar. Backends return results in task order and re-raise a task's error in the driver.
"""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import queue as queue_module
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from typing import Any, Protocol, TypeVar, runtime_checkable

from ucp.progress import progress_bar
from ucp.storage.fileio import drop_inherited_locks

T = TypeVar("T")
R = TypeVar("R")
Report = Callable[[int], None]


class Executor(Protocol):
    workers: int

    def map(self, fn: Callable[[T, Report], R], tasks: Sequence[T], *, total_bytes: int, desc: str) -> list[R]:
        ...


@runtime_checkable
class ShuffleExecutor(Executor, Protocol):
    """A backend that writes the bins of a conversion itself, as a MapReduce with a shuffle.

    `write_bins(tasks)` takes `ucp.convert.driver.WriteBin`s and returns what `ucp.convert.driver.write_bin` would
    have returned for each, in order: map tasks Extract the fragments of each source file, reduce
    tasks run `ucp.convert.driver.stream_bin` on them. The Ray backend is one.
    """

    def write_bins(self, tasks: Sequence[Any], *, total_bytes: int) -> list[Any]:
        ...


def default_workers() -> int:
    return max(1, min(8, os.cpu_count() or 1))


_progress_queue: multiprocessing.queues.Queue[int] | None = None  # set in each pool worker by _init_worker
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _init_worker(q, parent: int) -> None:
    global _progress_queue
    _progress_queue = q
    _die_with_parent(parent)
    drop_inherited_locks()
    if "torch" in sys.modules:  # a driver that works with torch (the load hook, --format deepspeed)
        sys.modules["torch"].set_num_threads(1)  # the pool supplies the parallelism; keep workers from oversubscribing


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGKILL this worker when the process that forked it dies (even by SIGKILL), so no
    orphan goes on writing into the output; a parent already gone means exit now."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _report_to_queue(nbytes: int) -> None:
    if _progress_queue is not None:
        _progress_queue.put(nbytes)


def _run_in_worker(fn, task):
    return fn(task, _report_to_queue)


class LocalExecutor:
    """A process pool on this machine (fork start), sized to `workers`."""

    def __init__(self, workers: int | None = None, progress: bool = True):
        self.workers = workers or default_workers()
        self.progress = progress

    def map(self, fn: Callable[[T, Report], R], tasks: Sequence[T], *, total_bytes: int, desc: str) -> list[R]:
        with progress_bar(total_bytes, desc, self.progress) as bar:
            if self.workers == 1 or len(tasks) <= 1:
                return [fn(task, bar.update) for task in tasks]
            return self._map_pool(fn, tasks, bar)

    def _map_pool(self, fn, tasks, bar) -> list:
        ctx = multiprocessing.get_context("fork")
        progress_queue = ctx.Queue()
        stop = threading.Event()

        def drain() -> None:
            while not stop.is_set() or not progress_queue.empty():
                try:
                    bar.update(progress_queue.get(timeout=0.1))
                except queue_module.Empty:
                    continue

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        try:
            with ProcessPoolExecutor(max_workers=min(self.workers, len(tasks)), mp_context=ctx,
                                     initializer=_init_worker, initargs=(progress_queue, os.getpid())) as pool:
                futures = [pool.submit(_run_in_worker, fn, task) for task in tasks]
                done, pending = wait(futures, return_when=FIRST_EXCEPTION)
                for f in pending:
                    f.cancel()
                for f in futures:
                    error = f.exception() if f.done() and not f.cancelled() else None
                    if error is not None:
                        raise error
                return [f.result() for f in futures]
        finally:
            stop.set()
            progress_queue.put(0)  # wakes the drainer now rather than at its next 0.1 s timeout
            drainer.join()
