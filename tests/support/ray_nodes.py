"""A Ray cluster of several raylets on this machine, each a "node" with one worker slot (loopback only).

Each raylet is `ray start --block` in a session of its own, so that a node is lost by killing its session:
the raylet and every worker process it started. The head holds the GCS and is never taken away.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil

from support.launch import ds_env
from support.processes import wait_for

# No token auth (a token in ~/.ray would switch it on for `ray start` but not for drivers joining by address),
# no usage-stats prompt.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
# A node that is gone is marked dead after 2 missed health checks 1 s apart (Ray's default: 5 of 3 s), so that
# Ray Train does not first try to restart at the old size on a node that no longer answers.
FAST_NODE_DEATH = {"RAY_health_check_period_ms": "1000", "RAY_health_check_failure_threshold": "2"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_session(proc: subprocess.Popen) -> None:
    """Stop `ray start --block` (its own session) and then kill whatever of that session is left."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=20)
    kill_session(proc)


def kill_session(proc: subprocess.Popen) -> None:
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(p.pid) == proc.pid:
                p.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


class Nodes:
    """A head raylet and worker raylets, each with `--num-cpus 1` and one `slot`."""

    def __init__(self, root: Path):
        self.root = root  # short: Ray's socket paths under it must stay below 108 bytes
        self.temp_dir = root / "t"
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        self.env = ds_env({**RAY_ENV, **FAST_NODE_DEATH})
        self.raylets: list[subprocess.Popen] = []
        self.address = ""

    def _start(self, head: bool) -> subprocess.Popen:
        """One raylet; tried again (twice) where `ray start` gives up after its fixed 30 s wait for the raylet to
        register, which a loaded 2-core machine can exceed."""
        tries = 0
        while True:
            try:
                return self._start_once(head)
            except RuntimeError as e:
                kill_session(self.raylets.pop())
                tries += 1
                if tries == 3 or "timed out during startup" not in str(e):
                    raise

    def _start_once(self, head: bool) -> subprocess.Popen:
        index = len(self.raylets)
        where = ["--head", f"--port={free_port()}", "--include-dashboard=false",
                 f"--ray-client-server-port={free_port()}"] if head else [f"--address={self.address}"]
        # Ports of their own: raylets on one machine would otherwise all take the same defaults.
        ports = {name: free_port() for name in ("node-manager-port", "object-manager-port", "metrics-export-port",
                                                 "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
                                                 "runtime-env-agent-port")}
        # `ray start` by this interpreter (not whichever `ray` is on PATH): Ray's workers run the interpreter that
        # started their raylet, and must see the packages (ucp included) that this one does.
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", *where, "--num-cpus=1",
               '--resources={"slot": 1}', "--disable-usage-stats",
               f"--temp-dir={self.temp_dir}", *(f"--{name}={port}" for name, port in ports.items())]
        log = self.root / f"raylet{index}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.raylets.append(proc)

        def up():
            if proc.poll() is not None:
                raise RuntimeError(f"ray start exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            return "will now block forever" in log.read_text(errors="replace")

        wait_for(up, 120, f"raylet {index}")
        return proc

    def start(self, workers: int) -> str:
        """The head, then `workers` more raylets; the GCS address."""
        self._start(head=True)
        self.address = (self.temp_dir / "ray_current_cluster").read_text().strip()
        for _ in range(workers):
            self.add()
        return self.address

    def add(self) -> int:
        """One more raylet (a node back); its index."""
        self._start(head=False)
        return len(self.raylets) - 1

    def live(self) -> list[int]:
        """The indexes of the raylets running now (the head's is 0)."""
        return [i for i, proc in enumerate(self.raylets) if proc.poll() is None]

    def ensure(self, slots: int) -> str:
        """Start the cluster or add raylets until `slots` run (one worker slot each); the GCS address. Tests that
        share one cluster (it takes long to start) each ask for the nodes they need."""
        if not self.raylets:
            self.start(workers=slots - 1)
        while len(self.live()) < slots:
            self.add()
        self.wait_free(slots)
        return self.address

    def wait_free(self, slots: int, timeout: float = 180) -> None:
        """Until the GCS offers `slots` free worker slots: a raylet just added registers, and what the previous
        job's workers held is given back, some seconds after `ray start` returns and the job ends. A driver started
        earlier sizes its worker group by what is free then (Ray Train: "ready resources for 2 workers")."""
        probe = ("import sys, time, ray\n"
                 "ray.init(address=sys.argv[1], logging_level='ERROR')\n"
                 "deadline = time.monotonic() + float(sys.argv[3])\n"
                 "while ray.available_resources().get('slot', 0) < int(sys.argv[2]):\n"
                 "    if time.monotonic() > deadline:\n"
                 "        sys.exit(f'free slots: {ray.available_resources().get(\"slot\", 0)}')\n"
                 "    time.sleep(0.5)\n")
        subprocess.run([sys.executable, "-c", probe, self.address, str(slots), str(timeout)], env=self.env,
                       check=True, timeout=timeout + 60, stdout=subprocess.DEVNULL)

    def lose(self, index: int) -> None:
        """The node is gone: its raylet and every process it started, SIGKILL."""
        if index == 0:
            raise ValueError("the head holds the GCS: take another node away")
        kill_session(self.raylets[index])

    def stop(self) -> None:
        for proc in reversed(self.raylets):
            stop_session(proc)

    def train_workers(self) -> list[psutil.Process]:
        """The Ray Train worker processes now running on the cluster's raylets."""
        out = []
        for raylet in self.raylets:
            if raylet.poll() is None:
                with contextlib.suppress(psutil.NoSuchProcess):
                    out += [p for p in psutil.Process(raylet.pid).children(recursive=True)
                            if "RayTrainWorker" in " ".join(p.cmdline())]
        return out
