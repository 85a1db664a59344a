"""What a restart cost, measured: from the last step before a fault to the first step after it.

While a job trains with `"load": "auto"`, rank 0 records its progress after every optimizer step
(`<save dir>/ucp_progress.json`: step, wall time, world size; a rename, no fsync: it is a measurement,
not state). A restarted job reads it back, and after its first step logs one line on rank 0:

    ucp: restart 4 -> 3 ranks: loaded /ckpt/global_step4 (step 4), 1 step redone; fault to first step
    9.7 s = restart 6.9 s (detection and relaunch 2.1 s + engine start-up 4.8 s) + load 0.8 s + first step 2.0 s

The fault is dated by the last step recorded before it, so "detection and relaunch" (up to the call
of `ucp.deepspeed.initialize`: the launcher noticing, its rendezvous, the new process and its imports)
also holds the part of the interrupted step that was lost; "engine start-up" runs from that call to the
load (the process group, `deepspeed.initialize`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

PROGRESS_NAME = "ucp_progress.json"


@dataclass(frozen=True)
class Progress:
    """The last optimizer step a job finished, when (time.time()) and on how many ranks."""

    step: int
    time: float
    world: int


def record_progress(save_dir: str | os.PathLike[str], progress: Progress) -> None:
    path = Path(save_dir) / PROGRESS_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"step": progress.step, "time": progress.time, "world": progress.world}))
    os.replace(tmp, path)


def read_progress(save_dir: str | os.PathLike[str]) -> Progress | None:
    """The progress a previous run of the job recorded, or None (a first start, or an unreadable record)."""
    try:
        raw = json.loads((Path(save_dir) / PROGRESS_NAME).read_text())
        return Progress(int(raw["step"]), float(raw["time"]), int(raw["world"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


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

    @property
    def restart_s(self) -> float:
        return self.detection_s + self.startup_s

    @property
    def fault_to_first_step_s(self) -> float:
        return self.restart_s + self.load_s + self.first_step_s

    def line(self) -> str:
        loaded = (f"loaded {self.checkpoint} (step {self.checkpoint_step})" if self.checkpoint
                  else "no committed checkpoint, started fresh")
        redone = f"{self.steps_redone} step{'' if self.steps_redone == 1 else 's'} redone"
        return (f"ucp: restart {self.old_world} -> {self.new_world} ranks: {loaded}, {redone}; fault to first step "
                f"{self.fault_to_first_step_s:.1f} s = restart {self.restart_s:.1f} s (detection and relaunch "
                f"{self.detection_s:.1f} s + engine start-up {self.startup_s:.1f} s) + load {self.load_s:.1f} s + "
                f"first step {self.first_step_s:.1f} s")

