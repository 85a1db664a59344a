"""Launch torchrun / python subprocesses for the DeepSpeed-on-CPU test harness."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Sequence

TORCH_EXTENSIONS_DIR = os.path.expanduser("~/.cache/ucp-tests/torch_extensions")


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# DeepSpeed's CPU ops that the test jobs load; built once per machine by build_deepspeed_ops().
DEEPSPEED_OPS = ("ShareMemCommBuilder", "FusedAdamBuilder")
# torch holds an op's ``lock`` file only while it checks or builds the op; once the ops are built,
# the check takes milliseconds, so a lock older than this was left by a process that was killed.
STALE_LOCK_S = 60.0


def build_deepspeed_ops(log_path: Path) -> None:
    """Compile DeepSpeed's CPU ops in one process before any test starts ranks.

    torch's JIT loader takes a ``lock`` file around every check or build of an op and never
    takes it back from a process that dies holding it; the tests kill ranks on purpose (elastic
    restarts, kills mid-save), and one killed during the check would leave every later job
    waiting forever. With the ops built here, release_stale_extension_locks() can tell a
    left-over lock from a live one by its age (run_logged's ds_env() removes stale ones first).
    """
    load = "; ".join(f"a.create_op_builder('{name}').load()" for name in DEEPSPEED_OPS)
    run_logged([sys.executable, "-c", f"from deepspeed.accelerator import get_accelerator as g; a = g(); {load}"],
               log_path, timeout=900)


def release_stale_extension_locks(max_age_s: float = STALE_LOCK_S) -> list[Path]:
    """Remove op ``lock`` files under TORCH_EXTENSIONS_DIR older than ``max_age_s``; return them."""
    removed = []
    for lock in Path(TORCH_EXTENSIONS_DIR).glob("*/lock"):
        try:
            if time.time() - lock.stat().st_mtime >= max_age_s:
                lock.unlink()
                removed.append(lock)
        except FileNotFoundError:
            pass
    return removed


def ds_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for DeepSpeed-on-CPU child processes.

    Called just before each launch, it also removes op locks left by killed processes (see
    build_deepspeed_ops), so that one killed rank cannot hang every later job.
    """
    release_stale_extension_locks()
    env = dict(os.environ)
    env["DS_ACCELERATOR"] = "cpu"
    env["TORCH_EXTENSIONS_DIR"] = TORCH_EXTENSIONS_DIR
    env["OMP_NUM_THREADS"] = "1"
    env["MKL_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if extra:
        env.update(extra)
    return env


def _tail(path: Path, n: int = 60) -> str:
    """Last ``n`` lines of the log, preceded by the end of the first failing rank's traceback.

    torchrun ends a failed job with a long summary that pushes the real error out of the tail.
    """
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"<could not read {path}: {e}>"
    tail = lines[-n:]
    rank_lines = [ln for ln in lines if ln.startswith("[rank")]
    cause = []
    if rank_lines:
        first_rank = rank_lines[0].split("]", 1)[0]
        cause = [ln for ln in rank_lines if ln.startswith(first_rank + "]")][-25:]
    if cause and not set(cause) <= set(tail):
        return "\n".join(["--- first failing rank (end) ---", *cause, "--- log tail ---", *tail])
    return "\n".join(tail)


def run_logged(cmd: Sequence[str], log_path: Path, timeout: int = 600, env: dict[str, str] | None = None,
               cwd: Path | None = None) -> float:
    """Run ``cmd`` with stdout+stderr appended to ``log_path``; return wall seconds.

    Raises ``RuntimeError`` (with the last 60 log lines) on a non-zero exit or a timeout.
    """
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(map(str, cmd))}\n")
        log.flush()
        proc = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT,
                                env=env if env is not None else ds_env(), cwd=cwd, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Kill the whole process group we created (torchrun + its workers), nothing else.
            try:
                os.killpg(proc.pid, 9)
            except ProcessLookupError:
                pass
            proc.wait()
            raise RuntimeError(f"timed out after {timeout}s: {' '.join(map(str, cmd))}\n"
                               f"--- last lines of {log_path} ---\n{_tail(log_path)}")
    elapsed = time.monotonic() - t0
    with open(log_path, "a") as log:
        log.write(f"[exit {rc} after {elapsed:.1f}s]\n")
    if rc != 0:
        raise RuntimeError(f"exit code {rc}: {' '.join(map(str, cmd))}\n"
                           f"--- last lines of {log_path} ---\n{_tail(log_path)}")
    return elapsed


def run_torchrun(script: Path, args: list[str], nproc: int, log_path: Path, timeout: int = 600) -> None:
    """Run ``torchrun --nproc_per_node nproc script *args`` on CPU (DS_ACCELERATOR=cpu, gloo).

    Uses a fresh free MASTER_PORT (rendezvous on 127.0.0.1) so concurrent launches do not
    collide. Output of all ranks goes to ``log_path``. Raises ``RuntimeError`` with the last
    60 log lines if the job fails or exceeds ``timeout`` seconds.
    """
    for attempt in range(3):
        cmd, env = torchrun_command(script, args, nproc)
        try:
            run_logged(cmd, log_path, timeout=timeout, env=env)
            return
        except RuntimeError as e:
            # Another process may have grabbed the port between free_port() and the bind.
            if attempt < 2 and "timed out" not in str(e) and _port_clash(str(e)):
                continue
            raise


def torchrun_command(script: Path, args: list[str], nproc: int,
                     extra_env: dict[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """``torchrun`` command line and environment for ``nproc`` CPU ranks on a fresh free port."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1",
        "--nproc_per_node", str(nproc),
        "--master_addr", "127.0.0.1",
        "--master_port", str(port),
        str(script), *map(str, args),
    ]
    return cmd, ds_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(extra_env or {})})


def start_torchrun(script: Path, args: list[str], nproc: int, log_path: Path,
                   extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``torchrun`` in the background, in a session of its own, output appended to ``log_path``.

    The caller waits for it (or kills the session with ``os.killpg(proc.pid, 9)``).
    """
    cmd, env = torchrun_command(script, args, nproc, extra_env)
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _port_clash(text: str) -> bool:
    text = text.lower()
    return "address already in use" in text or "eaddrinuse" in text
