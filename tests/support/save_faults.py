"""Fault injection into ucp's asynchronous save, installed by the training script of a test run.

    install(hold_dir)   # in the rank's process, before training

With `<hold_dir>/<tag>.rank<r>.fail` present, rank r's writer fails as a full disk would, after its
first data write. While `<hold_dir>/<tag>.hold` exists, every rank's writer stops after its first
data write, having written its pid to `<tag>.rank<r>.pid`, so a test can kill it mid-save.
"""
from __future__ import annotations

import os
import time
from pathlib import Path


def install(hold_dir: str | os.PathLike) -> None:
    """Make every save of this process meet the faults that files in `hold_dir` ask for."""
    import torch.distributed as dist

    from ucp.deepspeed.saving import stores as save_stores
    from ucp.deepspeed.saving import writer as save_writer

    hold_dir = Path(hold_dir)
    write_pieces, pwrite_all = save_stores.write_pieces, save_writer._pwrite_all

    def faulty_write_pieces(directory, files, buffer, *, headers):
        tag, rank = Path(directory).name, dist.get_rank()
        headers_left = len(files) if headers else 0  # the leader writes every file's header first

        def pwrite(fd, data, offset):
            nonlocal headers_left
            pwrite_all(fd, data, offset)
            if headers_left:
                headers_left -= 1
                return
            save_writer._pwrite_all = pwrite_all  # the first data write only
            _meet_faults(hold_dir, tag, rank)

        save_writer._pwrite_all = pwrite
        try:
            return write_pieces(directory, files, buffer, headers=headers)
        finally:
            save_writer._pwrite_all = pwrite_all

    save_stores.write_pieces = faulty_write_pieces


def _meet_faults(hold_dir: Path, tag: str, rank: int) -> None:
    if (hold_dir / f"{tag}.rank{rank}.fail").exists():
        raise OSError(28, "No space left on device (injected by tests/support/save_faults.py)")
    hold = hold_dir / f"{tag}.hold"
    if not hold.exists():
        return
    pid_file = hold_dir / f"{tag}.rank{rank}.pid"
    partial = pid_file.with_name(pid_file.name + ".partial")
    partial.write_text(str(os.getpid()))
    os.replace(partial, pid_file)
    while hold.exists():
        time.sleep(0.05)
