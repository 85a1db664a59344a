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

The same run records a second walk next to OUT.json, in OUT-config.json: the walk of the config through the start
(issue #41), `ucp.deepspeed.initialize` from its arguments to the engine it returns, through every module of ucp, but
counting only the calls that are handed the config: the DeepSpeed config given to initialize, its `"ucp"` section or
any part of it (a dict, or a dict holding one, read raw), or a value of the section's typed reading (`CONFIG_TYPES`)
or a part of one. It says how often the start goes back to a module to read another piece of the config. And in
OUT-raw.json, the functions (module.function) handed the raw `"ucp"` section or a raw part of it, in the order first
called: who reads the section's dicts rather than their typed reading.
"""
from __future__ import annotations

import inspect
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
EVERY_MODULE = ("ucp.",)
# The typed reading of the "ucp" section (issue #41), and of its parts, by module and class name.
CONFIG_TYPES = frozenset({("ucp.deepspeed.config", "Section"), ("ucp.deepspeed.config", "SaveOptions"),
                          ("ucp.deepspeed.config", "MemoryEvery"), ("ucp.deepspeed.memory.files", "MemoryEvery"),
                          ("ucp.elastic.shares", "ElasticSection")})
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
    def __init__(self, out: str | None, config_only: bool = False) -> None:
        self.out = out
        self.root = Visit("(training script)")
        self.main = Thread(self.root)
        self.start_only = config_only
        self.stepped = config_only   # the config's walk walks no step
        self.attribute = "_ucp_walk_config" if config_only else "_ucp_walk"   # a thread's place in this walk
        self.packages, self.helpers = (EVERY_MODULE, frozenset()) if config_only else (PACKAGES, HELPERS)
        self.config: set[int] | None = set() if config_only else None   # ids of the config's raw parts
        self.raw: set[int] = set()   # ids of the raw "ucp" section's dicts and lists
        self.raw_readers: list[str] = []

    def mine(self) -> Thread | None:
        """The current thread's place (None for a thread still starting, or one not started inside the walk)."""
        thread = threading._active.get(threading.get_ident())  # type: ignore[attr-defined]  # no side effect
        if thread is threading.main_thread():
            return self.main
        return getattr(thread, self.attribute, None)

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return"):
            return
        me = self.mine()
        if me is None:
            return
        if event == "return":
            if self.config is not None and me.depth:
                self._is_config(arg)   # a typed reading made here: its parts are the config's from now on
            if me.stack[-1][0] is frame:
                me.stack.pop()
            if (frame.f_globals.get("__name__", ""), frame.f_code.co_name) in (INITIALIZE, STEP) and me.depth:
                me.depth -= 1
                if self.start_only and not me.depth and me is self.main:
                    self.write()   # the start's walk ends where initialize returns
            return
        module = frame.f_globals.get("__name__", "")
        name = (module, frame.f_code.co_name)
        if name in (INITIALIZE, STEP) and (me.depth or name == INITIALIZE or self._first_step(frame)):
            if name == INITIALIZE and not me.depth and self.config is not None:
                kwargs = frame.f_locals.get("kwargs") or {}
                config = kwargs.get("config", kwargs.get("config_params"))
                if config is None:
                    config = getattr(next(iter(frame.f_locals.get("args") or ()), None), "deepspeed_config", None)
                self._remember(config, self.config)
                self._remember(config.get("ucp") if isinstance(config, dict) else None, self.raw)
            me.depth += 1
        if me.depth and self._walked(module) and self._handed_config(frame) and module != me.stack[-1][1].module:
            me.stack.append((frame, me.stack[-1][1].enter(module)))
            if not self.start_only:
                self.write()

    def _remember(self, value: object, ids: set[int]) -> None:
        """The dicts and lists of a raw config, at any depth, into `ids`."""
        if isinstance(value, (dict, list, tuple)) and id(value) not in ids:
            if not isinstance(value, tuple):
                ids.add(id(value))
            for item in value.values() if isinstance(value, dict) else value:
                self._remember(item, ids)

    def _is_config(self, value: object) -> bool:
        assert self.config is not None
        if id(value) in self.config:
            return True
        if isinstance(value, dict) and any(id(v) in self.config for v in value.values()):
            return True   # a dict holding parts of the config: a checked copy of the section
        kind = type(value)
        if (kind.__module__, kind.__name__) in CONFIG_TYPES:
            for part in vars(value).values() if hasattr(value, "__dict__") else ():
                if not isinstance(part, (str, int, float, bool, type(None))):
                    self.config.add(id(part))   # the typed value's parts: a layout, a batch, the load's options
            return True
        return False

    def _handed_config(self, frame: FrameType) -> bool:
        """Whether this call is handed (a part of) the config: always, but in the config's walk."""
        if self.config is None:
            return True
        code, values = frame.f_code, frame.f_locals
        names = list(code.co_varnames[:code.co_argcount + code.co_kwonlyargcount])
        args = [values.get(n) for n in names]
        if code.co_flags & inspect.CO_VARARGS:
            args += list(values.get(code.co_varnames[len(names)], ()))
        if code.co_flags & inspect.CO_VARKEYWORDS:
            args += list(values.get(code.co_varnames[len(names) + bool(code.co_flags & inspect.CO_VARARGS)], {})
                         .values())
        raw = [a for a in args if id(a) in self.raw
               or isinstance(a, dict) and any(id(v) in self.raw for v in a.values())]
        reader = f"{frame.f_globals.get('__name__', '')}.{code.co_name}"
        if raw and reader not in self.raw_readers:
            self.raw_readers.append(reader)
        return any(self._is_config(a) for a in args)

    def _walked(self, module: str) -> bool:
        return module.startswith(self.packages) and module not in self.helpers

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
            setattr(thread, self.attribute, child)

    def write(self) -> None:
        if self.out is not None:
            walk = [m.removeprefix("ucp.").removeprefix("deepspeed.") for m in self.root.walk()[1:]]
            with open(self.out, "w") as f:
                json.dump(walk, f)
            if self.config is not None:
                with open(self.out.removesuffix("-config.json") + "-raw.json", "w") as f:
                    json.dump(self.raw_readers, f)


def main() -> None:
    out, script, *args = sys.argv[1:]
    rank0 = os.environ.get("RANK", "0") == "0"
    walks = [Walk(out if rank0 else None), Walk(out.removesuffix(".json") + "-config.json" if rank0 else None, True)]
    start = threading.Thread.start

    def start_walked(thread: threading.Thread) -> None:
        for walk in walks:
            walk.starting(thread)
        start(thread)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        for walk in walks:
            walk.profile(frame, event, arg)

    threading.Thread.start = start_walked  # type: ignore[method-assign]
    threading.setprofile(profile)
    sys.setprofile(profile)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))   # as `python SCRIPT` does: its folder's modules
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
