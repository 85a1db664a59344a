"""Export a checkpoint as a `save_pretrained` folder that `AutoModelForCausalLM.from_pretrained` loads.

Every shard's safetensors header is computed from shapes alone and written first, then the tensors
are streamed into it in order, one at a time, read from the checkpoint (a worker thread reads the
next while one is written), so memory stays about one tensor whatever the model's size. Tied copies
(`lm_head.weight` under `tie_word_embeddings`) are stored once, as `save_pretrained` does; the rest
is checked against the architecture first, where transformers is installed.
"""
from __future__ import annotations

import json
import os
from collections import deque
from collections.abc import Generator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from ucp.checkpoint import Checkpoint, open_checkpoint
from ucp.errors import ExportError
from ucp.export.model_config import CONFIG_NAME, ModelConfig, check_tensors, model_keys, require_config
from ucp.export.staging import parse_size, staged_output
from ucp.format.safetensors_stream import TORCH_DTYPES, StreamingWriter, TensorSlot
from ucp.plan.plan import BUFFER, BUFFER_STATE, WEIGHT_STATE
from ucp.progress import progress_bar
from ucp.storage.locations import Location, location

DTYPES = ("float32", "bfloat16", "float16")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
METADATA = {"format": "pt"}  # what transformers' safetensors loader requires


@dataclass(frozen=True)
class ExportTensor:
    name: str
    state: str     # the checkpoint state it is read from: "fp32", or "value" for a buffer
    slot: TensorSlot


@dataclass(frozen=True)
class HfExport:
    output: Location
    files: list[str]
    tensors: int
    bytes: int
    dropped: list[str]   # tied copies left out


def shard_name(i: int, n: int) -> str:
    return SINGLE_FILE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def plan_tensors(ckpt: Checkpoint, dtype: str, dropped: set[str]) -> list[ExportTensor]:
    """Every parameter and buffer not in `dropped`, in checkpoint order: weights cast to `dtype`,
    integer buffers kept in their own dtype."""
    out = []
    for name in ckpt.names:
        if name in dropped:
            continue
        info = ckpt.info(name)
        state = BUFFER_STATE if info.kind == BUFFER else WEIGHT_STATE
        own = ckpt.dtype(name, state)
        target = dtype if TORCH_DTYPES[own].is_floating_point else own
        out.append(ExportTensor(name, state, TensorSlot(name, target, info.shape)))
    return out


def assign_shards(tensors: list[ExportTensor], max_bytes: int) -> list[list[ExportTensor]]:
    """Consecutive tensors packed into shards of at most `max_bytes` (a larger tensor gets a shard of its own)."""
    shards: list[list[ExportTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.slot.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.slot.nbytes
    return shards


def to_hf(input: str | os.PathLike[str], output: str | os.PathLike[str], *, dtype: str = "float32",
          max_shard_size: int | str = "5GB", config: str | os.PathLike[str] | None = None, workers: int = 1,
          tag: str | None = None, progress: bool = True) -> HfExport:
    """Write `output` as a transformers-ready folder from the ucp or DeepSpeed checkpoint `input`."""
    place = location(output)  # a URL no installed filesystem serves is refused before anything is read
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype}: choose one of {', '.join(DTYPES)}")
    ckpt = open_checkpoint(input, tag)
    model_config = require_config(ckpt, config)
    keys = model_keys(model_config)
    dropped = {n for n in keys.tied if n in ckpt.names}
    tensors = plan_tensors(ckpt, dtype, dropped)
    check_tensors(ckpt.path, {t.name: t.slot.shape for t in tensors}, keys, model_config)
    shards = assign_shards(tensors, parse_size(max_shard_size))
    files = [shard_name(i, len(shards)) for i in range(len(shards))]
    total = sum(t.slot.nbytes for t in tensors)
    with staged_output(place, CONFIG_NAME) as staging:
        _write_config(staging, model_config, dtype)
        with progress_bar(total, "export", progress) as bar, closing(read_ahead(ckpt, tensors, workers)) as loaded:
            for name, shard in zip(files, shards):
                write_shard(staging / name, shard, loaded, bar)
        if len(shards) > 1:
            _write_json(staging / INDEX_FILE, {"metadata": {"total_size": total},
                                               "weight_map": {t.name: f for f, s in zip(files, shards) for t in s}})
    return HfExport(place, files, len(tensors), total, sorted(dropped))


def read_ahead(ckpt: Checkpoint, tensors: list[ExportTensor], workers: int) -> Generator[torch.Tensor, None, None]:
    """The tensors, in order, each read and cast by a pool of `workers` threads at most `workers` ahead."""
    with ThreadPoolExecutor(max(1, workers)) as pool:
        def load(t: ExportTensor) -> torch.Tensor:
            return ckpt.tensor(t.name, t.state).to(TORCH_DTYPES[t.slot.dtype])

        pending = deque(pool.submit(load, t) for t in tensors[:max(1, workers)])
        ahead = iter(tensors[max(1, workers):])
        while pending:
            tensor = pending.popleft().result()
            following = next(ahead, None)
            if following is not None:
                pending.append(pool.submit(load, following))
            yield tensor


def write_shard(path: Path, shard: list[ExportTensor], loaded: Iterator[torch.Tensor], bar: tqdm) -> None:
    writer = StreamingWriter(str(path), [t.slot for t in shard], METADATA)
    try:
        for t in shard:
            tensor = next(loaded)
            writer.write(t.name, tensor)
            bar.update(t.slot.nbytes)
            del tensor  # before the next one is taken: one tensor at a time
        writer.close()
    except OSError as exc:
        writer.abort()
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def _write_config(staging: Path, config: ModelConfig, dtype: str) -> None:
    values = dict(config.values)
    values["dtype"] = dtype  # the dtype of the stored weights, which from_pretrained loads by default
    if "torch_dtype" in values:  # transformers 4.x's name for it
        values["torch_dtype"] = dtype
    _write_json(staging / CONFIG_NAME, values)
    for name, data in config.companions.items():
        with open(staging / name, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())


def _write_json(path: Path, value: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
