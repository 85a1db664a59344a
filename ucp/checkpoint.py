"""Reading checkpoints: `open_checkpoint(path)` for a ucp directory or any DeepSpeed checkpoint ucp understands.

State names follow DeepSpeed and torch: `fp32` (the master weight), the optimizer's own moment
names (`exp_avg`, `exp_avg_sq` for Adam), `step`; buffers hold one state, `value`.
"""
from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ucp.convert.source_check import EntryChecks
from ucp.converters.trainer_folders import LINK_REASON
from ucp.errors import CheckpointNotFoundError, CorruptCheckpointError, UcpError, UnsupportedStorageError
from ucp.format.crc import crc32
from ucp.format.folder import (
    DATA_PREFIX,
    INDEX_NAME,
    LATEST_NAME,
    check_tag,
    latest_checkpoint,
    read_index,
    read_latest,
)
from ucp.format.index import ExtraFile, Index, NotSaved, ParamEntry, StoredState, header_problems
from ucp.format.safetensors_stream import read_stored
from ucp.format.splits import from_split_major
from ucp.plan.plan import ParamPlan
from ucp.storage.fileio import ReadCounter, read_regular
from ucp.storage.json_file import shown
from ucp.storage.layer import is_file, is_remote, list_names, read_small
from ucp.storage.locations import Location, ObjectPath, location

STEP_STATE = "step"
DEEPSPEED_RANK_FILES = ("model_states.pt", "optim_states.pt")  # mp_rank_00_model_states.pt, zero_pp_rank_*_optim_...


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
    """A committed ucp checkpoint directory (local, or a prefix of an object store)."""

    def __init__(self, path: str | os.PathLike[str] | ObjectPath):
        self.path: Location = location(path)
        self.index: Index = read_index(self.path)  # checked in full (ucp.format.index)
        self.counter = ReadCounter()
        self._headers_checked: set[str] = set()

    @property
    def names(self) -> list[str]:
        return list(self.index.params)

    @property
    def aliases(self) -> dict[str, str]:
        """alias -> source: the second names of tied weights, each stored once under its source's name."""
        return dict(self.index.aliases)

    def info(self, name: str) -> ParamInfo:
        e = self.entry(name)
        states = tuple(e.states) + ((STEP_STATE,) if e.step is not None else ())
        return ParamInfo(name, e.shape, e.kind, states, (e.pattern or {}).get("pattern", "?"), e.nbytes, e.group)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entry(name).shape

    def states(self, name: str) -> tuple[str, ...]:
        return self.info(name).states

    def dtype(self, name: str, state: str = "fp32") -> str:
        """The dtype `tensor(name, state)` returns ("float32" but for buffers), without reading it."""
        e = self.entry(name)
        return "float32" if state == STEP_STATE and e.step is not None else e.states[state].dtype

    def step_of(self, name: str) -> float | None:
        """The optimizer step parameter `name`'s moments were last updated at, if it is trainable."""
        return self.entry(name).step

    def tensor(self, name: str, state: str = "fp32", *, verify: bool = True) -> torch.Tensor:
        """One state of one parameter in its full, unsharded shape (checksum-verified by default)."""
        e = self.entry(name)
        if state == STEP_STATE and e.step is not None:
            return torch.tensor(e.step, dtype=torch.float32)
        if state not in e.states:
            raise KeyError(f"{name}: no state '{state}' (has {', '.join(self.states(name))})")
        s = e.states[state]
        if verify:
            self.check_headers([s.file])
        stored = read_stored(self.path / s.file, s.begin, s.end, s.dtype, s.shape,
                             s.crc32 if verify else None, self.counter)
        if s.splits is not None:  # stored split-major: put the logical order back (a no-op along dim 0)
            return from_split_major(stored, s.shape, *s.splits)
        return stored

    @property
    def step(self) -> int | None:
        return self.index.run.training.get("global_steps")

    @property
    def training(self) -> dict[str, Any]:
        """global_steps, global_samples, skipped_steps and, for fp16, the loss scaler's state."""
        return self.index.run.training

    @property
    def optimizer(self) -> dict[str, Any] | None:
        return self.index.run.optimizer

    @property
    def lr_scheduler(self) -> object:
        """The LR scheduler's state_dict, as saved."""
        return self.index.run.lr_scheduler

    @property
    def not_saved(self) -> NotSaved | None:
        """The parameters the checkpoint leaves out on purpose (frozen ones, under exclude_frozen_parameters)."""
        return self.index.run.not_saved

    @property
    def client_state(self) -> dict[str, Any]:
        return self.index.run.client_state

    @property
    def source(self) -> dict[str, Any]:
        return self.index.run.source

    @property
    def extra_files(self) -> list[str]:
        """The small files carried along from the source (a Trainer's config, tokenizer, trainer_state)."""
        return list(self.index.extra_files)

    def extra_file_path(self, name: str) -> Location:
        self._extra(name)
        return self.path / name

    def extra_file(self, name: str) -> bytes:
        """The bytes of an extra file, checked against the size and CRC-32 the index records."""
        record = self._extra(name)
        data = read_small(self.extra_file_path(name), follow=False)  # a link may reach any file
        if data is None:
            raise CheckpointNotFoundError(f"{self.path / name}: missing, though {INDEX_NAME} lists it; restore it "
                                          "from the checkpoint's copy, or convert again")
        if len(data) != record.nbytes or crc32(data) != record.crc32:
            raise CorruptCheckpointError(f"{self.path / name}: differs from what {INDEX_NAME} records "
                                         f"({record.nbytes} bytes, CRC-32 {record.crc32}); convert the "
                                         "checkpoint again")
        return data

    def verify(self) -> list[str]:
        """Every problem found: a safetensors header that disagrees with the index, a checksum mismatch.

        Opening the checkpoint already checked the index itself (`ucp.format.index`): file sizes, byte
        ranges, dtypes and shapes, no overlaps, plain regular files.
        """
        problems = []
        for data in self.index.files.values():
            problems += header_problems(self.path / data.name, data, self._states_in(data.name))
        for name, entry in self.index.params.items():
            for state, s in entry.states.items():
                try:
                    read_stored(self.path / s.file, s.begin, s.end, s.dtype, s.shape, s.crc32)
                except CorruptCheckpointError:
                    problems.append(f"{name}:{state}: checksum mismatch in {s.file}")
        return problems + self._verify_extra_files()

    def check_headers(self, files: Iterable[str] | None = None) -> None:
        """Raise `CorruptCheckpointError` where a data file's safetensors header disagrees with the index (each
        of `files`, default all, once): a dtype or shape relabelled in the index keeps every CRC-32 right, since
        the bytes are the same, but reads them as other values. What `verify` reports, checked before a read
        (`tensor`, the hook) uses the index's dtypes: a header per file, no tensor bytes."""
        for name in self.index.files if files is None else files:
            if name not in self._headers_checked:
                problems = header_problems(self.path / name, self.index.files[name], self._states_in(name))
                if problems:
                    raise CorruptCheckpointError(f"{problems[0]}; the index or the file was changed after the "
                                                 "checkpoint was written: convert it again or restore it from a copy")
                self._headers_checked.add(name)

    def _states_in(self, file_name: str) -> list[StoredState]:
        return [s for e in self.index.params.values() for s in e.states.values() if s.file == file_name]

    def _verify_extra_files(self) -> list[str]:
        problems = []
        for name in self.extra_files:
            try:
                self.extra_file(name)
            except UcpError as exc:  # missing, not a regular file, or changed
                problems.append(str(exc))
        return problems

    def _extra(self, name: str) -> ExtraFile:
        try:
            return self.index.extra_files[name]
        except KeyError:
            raise KeyError(f"{self.path}: no extra file '{name}' (has {', '.join(self.extra_files) or 'none'})") \
                from None

    def entry(self, name: str) -> ParamEntry:
        """The index entry of parameter `name`, or of the source of `name` when it is a tied alias."""
        try:
            return self.index.entry(name)
        except KeyError:
            raise KeyError(f"{self.path}: no parameter '{name}'") from None


class PlannedCheckpoint:
    """A DeepSpeed checkpoint read through its conversion plan: same API, states merged on demand."""

    def __init__(self, path: str | os.PathLike[str], tag: str | None = None):
        from ucp.converters.dispatch import plan_deepspeed

        self.path = Path(path)
        self.plan = plan_deepspeed(path, tag)
        self._params = {p.name: p for p in self.plan.params}
        self.counter = ReadCounter()
        self._sources = EntryChecks()

    @property
    def names(self) -> list[str]:
        return list(self._params)

    @property
    def aliases(self) -> dict[str, str]:
        """alias -> source: the second names of tied weights, read as their source."""
        return dict(self.plan.aliases)

    def info(self, name: str) -> ParamInfo:
        p = self._param(name)
        states = tuple(p.states) + ((STEP_STATE,) if p.step is not None else ())
        return ParamInfo(name, p.shape, p.kind, states, next(iter(p.states.values())).spec.pattern.value,
                         p.nbytes, p.group)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._param(name).shape

    def states(self, name: str) -> tuple[str, ...]:
        return self.info(name).states

    def dtype(self, name: str, state: str = "fp32") -> str:
        """The dtype `tensor(name, state)` returns ("float32" but for buffers), without reading it."""
        p = self._param(name)
        return "float32" if state == STEP_STATE and p.step is not None else p.states[state].dtype

    def tensor(self, name: str, state: str = "fp32", *, verify: bool = True) -> torch.Tensor:
        """The state, merged from the rank files. With `verify`, every zip entry it comes from is checked
        against its CRC-32 (the first time) and replicated copies must agree."""
        from ucp.plan.assemble import materialize_tensor

        p = self._param(name)
        if state == STEP_STATE and p.step is not None:
            return torch.tensor(p.step, dtype=torch.float32)
        if state not in p.states:
            raise KeyError(f"{name}: no state '{state}' (has {', '.join(self.states(name))})")
        if verify:  # the rank files' own CRC-32s, each entry once
            self._sources.check(p.states[state])
        return materialize_tensor(p.states[state], name=name, strict=verify, counter=self.counter)

    def step_of(self, name: str) -> float | None:
        """The optimizer step parameter `name`'s moments were last updated at, if it is trainable."""
        return self._param(name).step

    @property
    def step(self) -> int | None:
        return self.plan.training.get("global_steps")

    @property
    def training(self) -> dict[str, Any]:
        """global_steps, global_samples, skipped_steps and, for fp16, the loss scaler's state."""
        return self.plan.training

    @property
    def optimizer(self) -> dict[str, Any] | None:
        return self.plan.optimizer

    @property
    def lr_scheduler(self) -> object:
        """The LR scheduler's state_dict, as saved."""
        return self.plan.lr_scheduler

    @property
    def not_saved(self) -> NotSaved | None:
        """The parameters the checkpoint leaves out on purpose (frozen ones, under exclude_frozen_parameters)."""
        return self.plan.not_saved

    @property
    def client_state(self) -> dict[str, Any]:
        return self.plan.client_state

    @property
    def source(self) -> dict[str, Any]:
        return self.plan.source

    @property
    def extra_files(self) -> list[str]:
        """The small files a conversion would carry along (a Trainer's config, tokenizer, trainer_state)."""
        return list(self.plan.extra_files)

    def extra_file_path(self, name: str) -> Path:
        try:
            return Path(self.plan.extra_files[name])
        except KeyError:
            raise KeyError(f"{self.path}: no extra file '{name}' (has {', '.join(self.extra_files) or 'none'})") \
                from None

    def extra_file(self, name: str) -> bytes:
        return read_regular(str(self.extra_file_path(name)), follow=False)

    def verify(self) -> list[str]:
        """Every problem found reading each state of each parameter whole, as a conversion would: each
        zip entry against the CRC-32 the rank file records, replicated copies compared; and the side files
        a conversion leaves out because they are symbolic links (which could reach any file)."""
        save_dir = Path(self.plan.source["path"]).parent
        problems = [f"{save_dir / name}: left out of conversions and exports: {reason}"
                    for name, reason in sorted(self.plan.left_out.items()) if reason == LINK_REASON]
        for name, p in self._params.items():
            for state in p.states:
                try:
                    self.tensor(name, state)
                except UcpError as exc:
                    problems.append(f"{name}:{state}: {exc}")
        return problems

    def _param(self, name: str) -> ParamPlan:
        try:
            return self._params[self.plan.aliases.get(name, name)]
        except KeyError:
            raise KeyError(f"{self.path}: no parameter '{name}'") from None


Checkpoint = AtomicCheckpoint | PlannedCheckpoint  # what open_checkpoint gives: the same reading API


def open_checkpoint(path: str | os.PathLike[str] | ObjectPath, tag: str | None = None) -> Checkpoint:
    """Open a ucp checkpoint directory (or a save directory, through its `latest`), or a DeepSpeed
    checkpoint (save dir or tag folder) through its plan. `path` may be an `s3://bucket/prefix` URL of a ucp
    checkpoint (DeepSpeed's own checkpoints are read from local folders)."""
    place = location(path)
    if tag is not None:
        check_tag(tag)
    if is_file(place / INDEX_NAME):
        return AtomicCheckpoint(place)
    latest = latest_checkpoint(place) if tag is None else None  # a ucp.deepspeed.save directory
    if latest is not None:
        return AtomicCheckpoint(latest)
    if any(n.startswith(DATA_PREFIX) for n in list_names(place)):
        return AtomicCheckpoint(place)  # raises IncompleteCheckpointError with the fix
    if is_remote(place):  # DeepSpeed's torch files are read from local folders
        refuse_deepspeed_objects(place)
        raise CheckpointNotFoundError(f"{place}: holds no ucp checkpoint (no {INDEX_NAME}, no latest naming one); "
                                      "write one there with ucp convert --output, or convert a DeepSpeed checkpoint "
                                      "from a local folder")
    if not place.is_dir():
        raise CheckpointNotFoundError(f"{place}: no such directory")
    return PlannedCheckpoint(place, tag)


def refuse_deepspeed_objects(place: ObjectPath, verb: str = "load") -> None:
    """Raise `UnsupportedStorageError`, in one line naming the fix, when prefix `place` holds a DeepSpeed checkpoint
    rather than a ucp one: DeepSpeed's rank files, directly (a tag folder) or in the folder its `latest` names (a
    save folder, a Trainer's checkpoint-N, Accelerate's save_state folder). ucp loads DeepSpeed's torch files
    from local folders only, and converts them from object storage; `verb` is what the user does with the
    conversion."""
    names = list_names(place)
    if LATEST_NAME in names:
        tag = read_latest(place)
        names += [f"{tag}/{n}" for n in list_names(place / tag)] if tag else []
    rank_file = next((n for n in names if n.endswith(DEEPSPEED_RANK_FILES)), None)
    if rank_file is not None:
        raise UnsupportedStorageError(
            f"{place}: holds a DeepSpeed checkpoint ({rank_file}), not a ucp one (no {INDEX_NAME}); ucp loads "
            f"DeepSpeed checkpoints from local folders only, and converts them from anywhere: ucp convert --input "
            f"{place} --output {place.scheme}://{place.bucket}/NEW_PREFIX, then {verb} that prefix")


MAX_DEGREE = 1 << 24  # ranks a run's data-, tensor- or pipeline-parallel degree may claim


def source_world_size(source: dict[str, Any], where: object) -> int:
    """Data x tensor x pipeline parallel of an index's `"source"`, each checked (an int from 1 to MAX_DEGREE; absent:
    1): a number an index claims must not size a loop or a check unread (issue #43)."""
    world = 1
    for key in ("dp", "tp", "pp"):
        value = source.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DEGREE:
            raise CorruptCheckpointError(f'{where}: the index\'s "source": {{"{key}": {shown(value)}}} is no number '
                                         f"of ranks (an int from 1 to {MAX_DEGREE}); the index is damaged, convert or "
                                         "save the checkpoint again")
        world *= value
    return world


def saved_world_size(path: str | os.PathLike[str] | ObjectPath) -> int:
    """How many processes trained the checkpoint at `path` (data x tensor x pipeline parallel)."""
    ckpt = open_checkpoint(path)
    return source_world_size(ckpt.source, ckpt.path)
