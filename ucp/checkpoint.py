"""Reading checkpoints: `open_checkpoint(path)` for a ucp directory or any DeepSpeed checkpoint ucp understands.

State names follow DeepSpeed and torch: `fp32` (the master weight), the optimizer's own moment
names (`exp_avg`, `exp_avg_sq` for Adam), `step`; buffers hold one state, `value`.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ucp.errors import CheckpointNotFoundError, CorruptCheckpointError
from ucp.fileio import ReadCounter
from ucp.format import INDEX_NAME, latest_checkpoint, load_index
from ucp.safetensors_stream import read_stored
from ucp.splits import from_split_major

STEP_STATE = "step"


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    kind: str            # "param" (trainable), "frozen" or "buffer"
    states: tuple[str, ...]
    pattern: str         # how the source spread the parameter (informational)
    nbytes: int
    group: int | None = None


class AtomicCheckpoint:
    """A committed ucp checkpoint directory."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.index = load_index(self.path)
        self.counter = ReadCounter()

    @property
    def names(self) -> list[str]:
        return list(self.index["params"])

    def info(self, name: str) -> ParamInfo:
        e = self._entry(name)
        states = tuple(e["states"]) + ((STEP_STATE,) if "step" in e else ())
        nbytes = sum(s["offsets"][1] - s["offsets"][0] for s in e["states"].values())
        return ParamInfo(name, tuple(e["shape"]), e["kind"], states, e.get("pattern", {}).get("pattern", "?"),
                         nbytes, e.get("group"))

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    def states(self, name: str) -> tuple[str, ...]:
        return self.info(name).states

    def tensor(self, name: str, state: str = "fp32", *, verify: bool = True) -> torch.Tensor:
        """One state of one parameter in its full, unsharded shape (checksum-verified by default)."""
        e = self._entry(name)
        if state == STEP_STATE and "step" in e:
            return torch.tensor(e["step"], dtype=torch.float32)
        if state not in e["states"]:
            raise KeyError(f"{name}: no state '{state}' (has {', '.join(self.states(name))})")
        s = e["states"][state]
        begin, end = s["offsets"]
        stored = read_stored(str(self.path / s["file"]), begin, end, s["dtype"], s["shape"],
                             s["crc32"] if verify else None, self.counter)
        if "splits" in s:  # stored split-major: put the logical order back (a no-op along dim 0)
            return from_split_major(stored, s["shape"], s["splits"]["dim"], s["splits"]["count"])
        return stored

    @property
    def step(self) -> int | None:
        return self.index.get("training", {}).get("global_steps")

    @property
    def optimizer(self) -> dict | None:
        return self.index.get("optimizer")

    @property
    def lr_scheduler(self):
        return self.index.get("lr_scheduler")

    @property
    def client_state(self) -> dict:
        return self.index.get("client_state", {})

    @property
    def source(self) -> dict:
        return self.index.get("source", {})

    def verify(self) -> list[str]:
        """Every problem found: missing or resized files, tensors out of bounds, checksum mismatches."""
        problems = []
        sizes = {}
        for name, meta in self.index["files"].items():
            path = self.path / name
            if not path.is_file():
                problems.append(f"{path}: missing")
                continue
            sizes[name] = path.stat().st_size
            if sizes[name] != meta["bytes"]:
                problems.append(f"{path}: {sizes[name]} bytes, the index records {meta['bytes']}")
        for pname, e in self.index["params"].items():
            for state, s in e["states"].items():
                if s["file"] not in sizes:
                    if s["file"] not in self.index["files"]:
                        problems.append(f"{pname}:{state}: stored in unlisted file {s['file']}")
                    continue
                begin, end = s["offsets"]
                if end > sizes[s["file"]]:
                    problems.append(f"{pname}:{state}: bytes [{begin}, {end}) past the end of {s['file']}")
                    continue
                try:
                    read_stored(str(self.path / s["file"]), begin, end, s["dtype"], s["shape"], s["crc32"])
                except CorruptCheckpointError:
                    problems.append(f"{pname}:{state}: checksum mismatch in {s['file']}")
        return problems

    def _entry(self, name: str) -> dict:
        try:
            return self.index["params"][name]
        except KeyError:
            raise KeyError(f"{self.path}: no parameter '{name}'") from None


class PlannedCheckpoint:
    """A DeepSpeed checkpoint read through its conversion plan: same API, states merged on demand."""

    def __init__(self, path: str | os.PathLike, tag: str | None = None):
        from ucp.converters.deepspeed_zero import plan_deepspeed

        self.path = Path(path)
        self.plan = plan_deepspeed(path, tag)
        self._params = {p.name: p for p in self.plan.params}
        self.counter = ReadCounter()

    @property
    def names(self) -> list[str]:
        return list(self._params)

    def info(self, name: str) -> ParamInfo:
        p = self._param(name)
        states = tuple(p.states) + ((STEP_STATE,) if p.step is not None else ())
        return ParamInfo(name, p.shape, p.kind, states, next(iter(p.states.values())).spec.pattern.value,
                         p.nbytes, p.group)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._param(name).shape

    def states(self, name: str) -> tuple[str, ...]:
        return self.info(name).states

    def tensor(self, name: str, state: str = "fp32", *, verify: bool = True) -> torch.Tensor:
        from ucp.assemble import materialize

        p = self._param(name)
        if state == STEP_STATE and p.step is not None:
            return torch.tensor(p.step, dtype=torch.float32)
        if state not in p.states:
            raise KeyError(f"{name}: no state '{state}' (has {', '.join(self.states(name))})")
        return materialize(p.states[state], name=name, strict=verify, counter=self.counter)

    @functools.cached_property
    def index(self) -> dict:
        """The index `ucp convert` would write for this checkpoint, less where its states would be stored:
        each state's entry gives its dtype and shape only."""
        from ucp.convert import param_entry

        params = {}
        for p in self.plan.params:
            params[p.name] = param_entry(p, {s: {"dtype": src.dtype, "shape": list(p.shape)}
                                             for s, src in p.states.items()})
        return {"source": self.plan.source, "training": self.plan.training, "optimizer": self.plan.optimizer,
                "lr_scheduler": self.plan.lr_scheduler, "client_state": self.plan.client_state, "params": params}

    @property
    def step(self) -> int | None:
        return self.plan.training.get("global_steps")

    @property
    def optimizer(self) -> dict | None:
        return self.plan.optimizer

    @property
    def lr_scheduler(self):
        return self.plan.lr_scheduler

    @property
    def client_state(self) -> dict:
        return self.plan.client_state

    @property
    def source(self) -> dict:
        return self.plan.source

    def _param(self, name: str):
        try:
            return self._params[name]
        except KeyError:
            raise KeyError(f"{self.path}: no parameter '{name}'") from None


def open_checkpoint(path: str | os.PathLike, tag: str | None = None) -> AtomicCheckpoint | PlannedCheckpoint:
    """Open a ucp checkpoint directory (or a save directory, through its `latest`), or a DeepSpeed
    checkpoint (save dir or tag folder) through its plan."""
    path = Path(path)
    if (path / INDEX_NAME).is_file():
        return AtomicCheckpoint(path)
    latest = latest_checkpoint(path) if tag is None else None  # a ucp.deepspeed.save directory
    if latest is not None:
        return AtomicCheckpoint(latest)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"{path}: no such directory")
    if any(n.startswith("data-") for n in os.listdir(path)):
        return AtomicCheckpoint(path)  # raises IncompleteCheckpointError with the fix
    return PlannedCheckpoint(path, tag)
