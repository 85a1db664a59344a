"""Export a checkpoint as a `torch.distributed.checkpoint` (DCP) folder, in the FQN-keyed layout of
`get_model_state_dict` / `get_optimizer_state_dict`:

    {"model": {fqn: tensor},
     "optimizer": {"state": {fqn: {"exp_avg", "exp_avg_sq", "step"}},
                   "param_groups": [{"lr": ..., "betas": ..., ..., "params": [fqn, ...]}]}}

so a job of any world size (FSDP2, DDP, one process) loads it with `dcp.load` and then
`set_model_state_dict` / `set_optimizer_state_dict`. It is written by DCP's own `FileSystemWriter`.
DCP plans a save from tensor metadata and only then asks the planner for each tensor's data, so the
state dict handed to it holds meta-device placeholders and `_ReadingPlanner` reads each tensor from
the checkpoint when DCP's writer asks for it. DCP's writer keeps every tensor of a file alive until
it closes the file, so `_BoundedFileWriter` starts a new file whenever the next tensor would take
one past the size of the largest tensor: memory stays about one tensor (or two), as for `--to hf`.
"""
from __future__ import annotations

import contextlib
import io
import os
import queue
import warnings
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict_saver import save
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future
from tqdm import tqdm

from ucp.checkpoint import STEP_STATE, Checkpoint, open_checkpoint
from ucp.errors import ExportError, UcpError
from ucp.export.hf import DTYPES
from ucp.export.model_config import find_config, model_keys
from ucp.export.optimizer import default_target, export_groups
from ucp.export.staging import staged_output
from ucp.format.safetensors_stream import TORCH_DTYPES
from ucp.plan.plan import BUFFER, BUFFER_STATE, TRAINABLE, WEIGHT_STATE
from ucp.progress import progress_bar
from ucp.storage.locations import Location, location

METADATA_NAME = ".metadata"  # what DCP's FileSystemReader opens first; an s3:// export uploads it last


@dataclass(frozen=True)
class Source:
    name: str     # the checkpoint parameter
    state: str
    dtype: torch.dtype


@dataclass(frozen=True)
class DcpExport:
    output: Location
    model_tensors: int
    optimizer_params: int
    bytes: int


class _ReadingPlanner(DefaultSavePlanner):
    """DCP's default planner, except that a placeholder's data is read from the checkpoint on demand."""

    def __init__(self, ckpt: Checkpoint, sources: dict[int, Source], bar: tqdm) -> None:
        super().__init__()
        self._ckpt, self._sources, self._bar = ckpt, sources, bar

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = super().lookup_object(index)
        source = self._sources.get(id(obj))
        if source is None:
            return obj
        tensor = self._ckpt.tensor(source.name, source.state).to(source.dtype)
        self._bar.update(tensor.nbytes)
        return tensor


class _WriteFailures(io.FileIO):
    """A file DCP writes into, which keeps the OSError a write met: DCP writes tensors with `torch.save`,
    whose writer turns a full disk into a RuntimeError naming no errno ("unexpected pos ...")."""

    def __init__(self, path: str | os.PathLike[str], failures: list[OSError]) -> None:
        super().__init__(path, "wb")
        self._failures = failures

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except OSError as exc:
            self._failures.append(OSError(exc.errno, exc.strerror, str(self.name)))
            raise


class _RecordingFileSystem(FileSystem):
    """DCP's local file system, its written files keeping the first OSError a write met (`failures`)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: list[OSError] = []

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with io.BufferedWriter(_WriteFailures(path, self.failures)) as stream:
            yield stream


class _BoundedFileWriter(FileSystemWriter):
    """DCP's file-system writer, with each file (`__0_K.distcp`) holding at most `max_bytes` of tensors
    (one larger tensor gets a file of its own) instead of all of them in one file. Only the grouping of
    write items into files is ours; the files are written by FileSystemWriter's own `_write_data`, and
    DCP's metadata records which file holds each item, so `dcp.load` reads any grouping."""

    def __init__(self, path: Path, max_bytes: int, workers: int) -> None:
        super().__init__(path, thread_count=workers)
        self._max_bytes = max_bytes
        self.recording = _RecordingFileSystem()
        self.fs = self.recording

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        files: list[list[WriteItem]] = [[]]
        size = 0
        for item in sorted(plan.items, key=lambda i: i.type != WriteItemType.BYTE_IO):  # small pickles first
            nbytes = item.tensor_storage_size() or 0
            if files[-1] and size + nbytes > self._max_bytes:
                files.append([])
                size = 0
            files[-1].append(item)
            size += nbytes
        file_queue: queue.Queue[tuple[str | os.PathLike[str], str, list[WriteItem]]] = queue.Queue()
        for k, items in enumerate(files):
            name = f"{plan.storage_data.prefix}{k}.distcp"
            file_queue.put((self.fs.concat_path(self.path, name), name, items))
        return self._write_data(planner, file_queue)


def to_dcp(input: str | os.PathLike[str], output: str | os.PathLike[str], *, dtype: str = "float32",
           config: str | os.PathLike[str] | None = None, workers: int = 1, tag: str | None = None,
           optimizer: str | None = None, progress: bool = True) -> DcpExport:
    """Write `output` as a DCP checkpoint of the model weights (in `dtype`) and fp32 optimizer states.

    With a model config (`config`, or the one beside the checkpoint), tied copies are written under
    every name `get_model_state_dict` gives them, from the weight they copy. `optimizer` is the class the
    loading job's optimizer is, whose param-group keys the export holds (`ucp.export.optimizer`):
    "torch.optim.AdamW" (the default for an Adam-family optimizer), "torch.optim.Adam", or "saved" (the
    checkpoint's own keys, the default otherwise).
    """
    place = location(output)  # a URL no installed filesystem serves is refused before anything is read
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    ckpt = open_checkpoint(input, tag)
    saved_optimizer = ckpt.optimizer
    groups = None
    if saved_optimizer is not None:
        groups = export_groups(saved_optimizer, optimizer or default_target(saved_optimizer), str(ckpt.path))
    model_config = find_config(ckpt, config)
    tied = model_keys(model_config).tied if model_config is not None else {}
    sources: dict[int, Source] = {}

    def placeholder(name: str, state: str, target: torch.dtype) -> torch.Tensor:
        t = torch.empty(ckpt.shape(name), dtype=target, device="meta")
        sources[id(t)] = Source(name, state, target)
        return t

    copies = {copy: original for copy, original in tied.items() if original is not None and original in ckpt.names}
    model = {}
    for name in ckpt.names:
        if name in copies:  # a frozen duplicate or an alias of its original: written from the original below
            continue
        state = BUFFER_STATE if ckpt.info(name).kind == BUFFER else WEIGHT_STATE
        own = TORCH_DTYPES[ckpt.dtype(name, state)]
        model[name] = placeholder(name, state, TORCH_DTYPES[dtype] if own.is_floating_point else own)
    for copy, original in copies.items():  # under get_model_state_dict's name too, even where the checkpoint lacks it
        model[copy] = placeholder(original, WEIGHT_STATE, TORCH_DTYPES[dtype])
    state_dict: dict[str, Any] = {"model": model}
    trainable = [n for n in ckpt.names if ckpt.info(n).kind == TRAINABLE]
    if saved_optimizer is not None:
        state_dict["optimizer"] = {
            "state": {n: {**{s: placeholder(n, s, torch.float32) for s in saved_optimizer["states"]},
                          STEP_STATE: ckpt.tensor(n, STEP_STATE)} for n in trainable},
            "param_groups": groups,
        }
    sizes = [t.numel() * t.element_size() for t in _placeholders(state_dict)]
    total, largest = sum(sizes), max(sizes, default=1)
    with staged_output(place, METADATA_NAME) as staging, progress_bar(total, "export", progress) as bar, \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # no_dist is the intent
        writer = _BoundedFileWriter(staging, largest, max(1, workers))
        try:
            save(state_dict, storage_writer=writer, planner=_ReadingPlanner(ckpt, sources, bar), no_dist=True)
        except CheckpointException as exc:  # DCP wraps each rank's error: raise ours (a full disk, a bad read) as is
            failure = next(iter(exc.failures.values()))[0]
            raise (failure if isinstance(failure, (UcpError, OSError)) or not writer.recording.failures
                   else writer.recording.failures[0]) from None
    return DcpExport(place, len(model), len(trainable) if saved_optimizer is not None else 0, total)


def _placeholders(tree: object) -> list[torch.Tensor]:
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _placeholders(v)]
    if isinstance(tree, list):
        return [t for v in tree for t in _placeholders(v)]
    return [tree] if isinstance(tree, torch.Tensor) and tree.is_meta else []
