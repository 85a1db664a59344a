"""What a restart cost, measured: from the last step before a fault to the first step after it.

While a job trains with `"load": "auto"`, rank 0 records its progress after every optimizer step
(`<save dir>/ucp_progress.json`: step, wall time, world size; a rename, no fsync: it is a measurement,
not state; in an object store one small PUT, sent by a background thread so that training never waits for
it, the newest step winning). A restarted job reads it back, and after its first step logs one line on rank 0:

    ucp: restart 4 -> 3 ranks: loaded /ckpt/global_step4 (step 4), 1 step redone; fault to first step
    9.7 s = restart 6.9 s (detection and relaunch 2.1 s + engine start-up 4.8 s) + load 0.8 s + first step 2.0 s

The fault is dated by the last step recorded before it, so "detection and relaunch" (up to the call
of `ucp.deepspeed.initialize`: the launcher noticing, its rendezvous, the new process and its imports)
also holds the part of the interrupted step that was lost; "engine start-up" runs from that call to the
load (the process group, `deepspeed.initialize`).
"""
from __future__ import annotations

import atexit
import json
import logging
import math
import threading
from dataclasses import dataclass

from ucp.errors import UcpError
from ucp.format.fields import Fields
from ucp.format.index import MAX_STEP
from ucp.storage.layer import is_remote, read_json, write_whole
from ucp.storage.locations import Location

PROGRESS_NAME = "ucp_progress.json"
PROGRESS_MAX_BYTES = 4096  # three numbers
CLOSE_TIMEOUT_S = 30  # a store that does not answer does not hold the exit longer than this
logger = logging.getLogger("ucp.elastic")


@dataclass(frozen=True)
class Progress:
    """The last optimizer step a job finished, when (time.time()) and on how many ranks."""

    step: int
    time: float
    world: int


def record_progress(save_dir: Location, progress: Progress) -> None:
    data = json.dumps({"step": progress.step, "time": progress.time, "world": progress.world}).encode()
    write_whole(save_dir / PROGRESS_NAME, data, durable=False)  # a measurement: whole, but not worth an fsync


def read_progress(save_dir: Location) -> Progress | None:
    """The progress a previous run of the job recorded, or None: a first start, or a record that is not three
    numbers in range (a FIFO, a link, NaN, 1e400, a list: one warning naming it; the restart goes unmeasured)."""
    path = save_dir / PROGRESS_NAME
    fix = "the restart's cost is not reported; ucp rewrites the file after the next step"
    try:
        raw = read_json(path, PROGRESS_MAX_BYTES, fix)
        if raw is None:
            return None
        fields = Fields("progress", raw, path, fix)
        when = fields.get("time", (int, float))
        if not math.isfinite(when):
            raise fields.bad("progress.time", f"{when!r} is not a time")
        return Progress(fields.count("step", limit=MAX_STEP), float(when), fields.count("world", least=1,
                                                                                          limit=1 << 24))
    except (OSError, UcpError) as exc:
        logger.warning("ucp: %s", exc)
        return None


class ProgressRecorder:
    """Records progress into `save_dir` after each step: in place for a local folder; for a remote store
    from a background thread, which sends the newest record not yet sent (one PUT in flight at most), so a
    slow or failing store never holds training, and a failure is logged once (it is a measurement). At exit
    the thread sends what is pending and stops (it is never cut off inside a request)."""

    def __init__(self, save_dir: Location):
        self.save_dir = save_dir
        self._pending: Progress | None = None
        self._closing = False
        self._wake = threading.Condition()
        self._failed = False
        self._thread: threading.Thread | None = None
        if is_remote(save_dir):
            self._thread = threading.Thread(target=self._send, name="ucp-progress", daemon=True)
            self._thread.start()
            atexit.register(self.close)

    def record(self, progress: Progress) -> None:
        if self._thread is None:
            record_progress(self.save_dir, progress)
            return
        with self._wake:
            self._pending = progress
            self._wake.notify()

    def close(self) -> None:
        """Send what is pending, then stop the thread (waits for at most one request)."""
        if self._thread is None:
            return
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout=CLOSE_TIMEOUT_S)

    def _send(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closing:
                    self._wake.wait()
                progress, self._pending = self._pending, None
            if progress is None:
                return
            try:
                record_progress(self.save_dir, progress)
            except UcpError as exc:
                if not self._failed:
                    logger.warning("ucp: %s: progress not recorded (%s); a restart will not report its cost",
                                   self.save_dir, exc)
                self._failed = True


@dataclass(frozen=True)
class RestartReport:
    """One restart, as its first step saw it (`engine.ucp_restart`)."""

    old_world: int
    new_world: int
    checkpoint: str | None     # what was loaded (None: no committed checkpoint, started fresh)
    checkpoint_step: int
    steps_redone: int
    detection_s: float         # last step before the fault -> ucp.deepspeed.initialize called (launcher, imports)
    startup_s: float           # -> start of the load (deepspeed.initialize)
    load_s: float
    first_step_s: float        # end of the load -> end of the first step after it
    layout: str | None = None  # the layout this start trains on (`ucp.elastic.layout_choice.Choice.describe`)
    # In the same process (`ucp.elastic.run`): detection_s runs to the fault seen, regroup_s from there to the new
    # group, startup_s from there (train() called again) to the load: the engine.
    regroup_s: float | None = None

    @property
    def restart_s(self) -> float:
        return self.detection_s + self.startup_s + (self.regroup_s or 0.0)

    @property
    def fault_to_first_step_s(self) -> float:
        return self.restart_s + self.load_s + self.first_step_s

    def line(self) -> str:
        loaded = (f"loaded {self.checkpoint} (step {self.checkpoint_step})" if self.checkpoint
                  else "no committed checkpoint, started fresh")
        redone = f"{self.steps_redone} step{'' if self.steps_redone == 1 else 's'} redone"
        if self.regroup_s is not None:
            return (f"ucp: in-process restart {self.old_world} -> {self.new_world} ranks: {loaded}, {redone}; fault "
                    f"to first step {self.fault_to_first_step_s:.1f} s = detection {self.detection_s:.1f} s + "
                    f"regroup {self.regroup_s:.1f} s + engine {self.startup_s:.1f} s + load {self.load_s:.1f} s + "
                    f"first step {self.first_step_s:.1f} s" + (f"; layout {self.layout}" if self.layout else ""))
        return (f"ucp: restart {self.old_world} -> {self.new_world} ranks: {loaded}, {redone}; fault to first step "
                f"{self.fault_to_first_step_s:.1f} s = restart {self.restart_s:.1f} s (detection and relaunch "
                f"{self.detection_s:.1f} s + engine start-up {self.startup_s:.1f} s) + load {self.load_s:.1f} s + "
                f"first step {self.first_step_s:.1f} s" + (f"; layout {self.layout}" if self.layout else ""))

