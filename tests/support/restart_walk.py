"""Run a training script and record, on rank 0, the walk of one restart through the modules of `ucp.deepspeed` and
`ucp.elastic` (docs/ARCHITECTURE.md, "One restart of an elastic job", the count of visits).

    python restart_walk.py OUT.json SCRIPT [ARGS...]     (under torchrun, as SCRIPT itself would run)

The walk covers `ucp.deepspeed.initialize` and the first optimizer step: the life's wrapper of the engine's step,
each micro-step up to the first gradient accumulation boundary, with the threads they start (the saver preparing
ahead, the writer that commits the step's save) as visits of the module that started them. A visit is counted
each time the walk enters a module from another one; calls one after the other from the same visit into the same
module are one visit; the byte-level helpers of the load and the save (`HELPERS`) are left out, their calls
counted as their caller's. OUT.json (the modules in the order they were entered) is rewritten as the walk grows:
ucp ends its processes past `atexit`. The script should train one step after its restart, so that the walk ends
with that step's save.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import threading
from types import FrameType
from typing import Any

PACKAGES = ("ucp.deepspeed.", "ucp.elastic.")
# Below the modules the walk counts: what each rank holds and where bytes go (docs/ARCHITECTURE.md, the layers).
HELPERS = frozenset(f"ucp.deepspeed.{name}" for name in (
    "engine.targets", "engine.autotp", "engine.moe", "engine.placement", "loading.mpu", "loading.source",
    "loading.flat_runs", "loading.readers", "loading.exchange", "finish", "saving.mpu", "saving.layout", "saving.plan",
    "saving.files", "saving.writer"))
INITIALIZE = ("ucp.deepspeed.hook", "initialize")
STEP = ("ucp.deepspeed.life", "_step")


class Visit:
    """One visit of a module: the visits it made in turn. A call from a visit into the module its last visit
    entered continues that visit (calls one after the other from the same caller into the same module)."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.visits: list[Visit] = []

    def enter(self, module: str) -> Visit:
        if self.visits and self.visits[-1].module == module:
            return self.visits[-1]
        self.visits.append(Visit(module))
        return self.visits[-1]

    def walk(self) -> list[str]:
        """The modules in the order the walk entered them, each visit once."""
        return [self.module] + [m for visit in self.visits for m in visit.walk()]


class Thread:
    """One thread's place in the walk: the frames that entered a visit, innermost last (`depth` > 0 while inside
    the walk; a thread started inside it is walked for all its life, as a visit of the one that started it)."""

    def __init__(self, root: Visit) -> None:
        self.stack: list[tuple[FrameType | None, Visit]] = [(None, root)]
        self.depth = 0


class Walk:
    def __init__(self, out: str | None) -> None:
        self.out = out
        self.root = Visit("(training script)")
        self.main = Thread(self.root)
        self.stepped = False

    def mine(self) -> Thread | None:
        """The current thread's place (None for a thread still starting, or one not started inside the walk)."""
        thread = threading._active.get(threading.get_ident())  # type: ignore[attr-defined]  # no side effect
        if thread is threading.main_thread():
            return self.main
        return getattr(thread, "_ucp_walk", None)

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        me = self.mine()
        if me is None:
            return
        if event == "return":
            if me.stack[-1][0] is frame:
                me.stack.pop()
            if (frame.f_globals.get("__name__", ""), frame.f_code.co_name) in (INITIALIZE, STEP) and me.depth:
                me.depth -= 1
            return
        module = frame.f_globals.get("__name__", "")
        name = (module, frame.f_code.co_name)
        if name in (INITIALIZE, STEP) and (me.depth or name == INITIALIZE or self._first_step(frame)):
            me.depth += 1
        if me.depth and _walked(module) and module != me.stack[-1][1].module:
            me.stack.append((frame, me.stack[-1][1].enter(module)))
            self.write()

    def _first_step(self, frame: FrameType) -> bool:
        """Whether this call of the life's wrapper is part of the first optimizer step: each micro-step up to the
        first gradient accumulation boundary (DeepSpeed's `step` is called once per micro-batch)."""
        if self.stepped:
            return False
        engine = frame.f_locals["self"].engine
        self.stepped = bool(getattr(engine, "is_gradient_accumulation_boundary", lambda: True)())
        return True

    def starting(self, thread: threading.Thread) -> None:
        """The current thread is about to start `thread`: walked for all its life when started inside the walk, as
        a visit of the module that started it."""
        me = self.mine()
        if me is not None and me.depth:
            child = Thread(me.stack[-1][1])
            child.depth = 1
            thread._ucp_walk = child  # type: ignore[attr-defined]

    def write(self) -> None:
        if self.out is not None:
            walk = [m.removeprefix("ucp.").removeprefix("deepspeed.") for m in self.root.walk()[1:]]
            with open(self.out, "w") as f:
                json.dump(walk, f)


def _walked(module: str) -> bool:
    return module.startswith(PACKAGES) and module not in HELPERS


def main() -> None:
    out, script, *args = sys.argv[1:]
    walk = Walk(out if os.environ.get("RANK", "0") == "0" else None)
    start = threading.Thread.start

    def start_walked(thread: threading.Thread) -> None:
        walk.starting(thread)
        start(thread)

    threading.Thread.start = start_walked  # type: ignore[method-assign]
    threading.setprofile(walk.profile)
    sys.setprofile(walk.profile)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
