"""End a training process with its exit code, every time: `ucp.deepspeed.finish()`.

Why this exists: on CPython up to 3.13, a thread that asks for the GIL after the main thread has
begun to finalize the interpreter is ended with `pthread_exit`. When that thread is one of gloo's
worker threads (`pt_gloo_runloop`, which holds C++ frames that may not unwind), the forced unwind
calls `std::terminate`: the process prints "terminate called without an active exception" and dies
with SIGABRT after all its work is done, and torchrun reports the job failed. Gloo's worker threads
take the GIL to run Python callbacks of a finished collective and to free Python-owned tensors a
collective held, so any collective whose tail end is still running on a worker thread when the script
returns can do it (docs/RELIABILITY.md has a two-line reproduction, and the same abort in stock
DeepSpeed and Trainer runs).

`finish` removes every way in: it waits for this process's ucp saves, lets every rank reach the
same point (so no peer's collective is in flight), tears the process groups down, flushes what was
written, and leaves without finalizing the interpreter, so no thread can ask for the GIL too late.
Call it last; it does not return.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

import torch.distributed as dist

from ucp.deepspeed.saving.saver import wait_all
from ucp.elastic.ranks import release_spares

logger = logging.getLogger("ucp.save")


def finish(exit_code: int | None = 0) -> NoReturn:
    """Wait for ucp's saves, tear down torch.distributed and exit with `exit_code`, skipping finalization.

    `exit_code` is what `main()` returned, as for `sys.exit` (None is 0). A save that failed is
    logged and turns exit code 0 into 1. Other `atexit` handlers do not run
    (the interpreter is not finalized): flush or close what they would have (wandb, files) before.
    """
    exit_code = exit_code or 0
    if wait_all() and exit_code == 0:
        exit_code = 1
    if exit_code == 0:
        release_spares()   # the run ended: spares of an elastic 3D layout exit 0 too (ucp.elastic.ranks)
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception as exc:  # a peer already gone: nothing left to agree on, still leave cleanly
            logger.warning("ucp: at finish: %s: %s", type(exc).__name__, exc)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe whose reader left
            pass
    os._exit(exit_code)
