"""Write ucp checkpoints from in-memory tensors through ucp's own writer (no DeepSpeed run needed),
copies of a checkpoint with an edited index (bad input for loaders), and the comparison of two
checkpoints tensor for tensor (an asynchronous save against `ucp convert` of the same step).

The checkpoints are written by `ucp.convert.tensors.write_tensors`: the conversion's own writer,
split-major transform and index builder.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

import ucp
from ucp.convert.split_policy import SplitPolicy
from ucp.convert.tensors import write_tensors
from ucp.deepspeed.memory.manifest import Manifest, write_manifest
from ucp.format.folder import INDEX_NAME, commit_index, read_index, tensor_key
from ucp.format.index import ParamEntry, index_json
from ucp.format.safetensors_stream import StreamingWriter, TensorSlot

ADAM_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def write_checkpoint(out: Path, tensors: dict[str, dict[str, torch.Tensor]], policy: SplitPolicy | None = None,
                     chunk_bytes: int = 4) -> Path:
    """A ucp checkpoint at `out` holding tensors[name][state] (fp32) of one AdamW param group at step 1, cut by
    `policy` when given (`ucp.convert.tensors.write_tensors`).

    Chunk checksums cover one fp32 element each by default, so a partial read is checked without
    widening and these tests see exactly the reads their layouts call for (test_chunk_checksums.py
    covers the widening)."""
    states = [s for s in next(iter(tensors.values())) if s != "fp32"]
    optimizer = {"type": "AdamW", "states": states,
                 "param_groups": [{"hyperparams": {"lr": 0.1}, "params": list(tensors)}]}
    as_fp32 = {name: {state: t.detach().to(torch.float32) for state, t in st.items()} for name, st in tensors.items()}
    return write_tensors(out, as_fp32, optimizer=optimizer, step=1.0, splits=policy, chunk_bytes=chunk_bytes)


def saved_at(folder: Path, step: int) -> Path:
    """A small ucp checkpoint at `folder` whose index records optimizer step `step`, as a training save's does."""
    write_checkpoint(folder, {"w": {"fp32": torch.arange(4.0), "exp_avg": torch.ones(4)}})
    index = read_index(folder)
    commit_index(folder, replace(index, run=replace(index.run, training={**index.run.training, "global_steps": step})))
    return folder


def memory_copy(folder: Path, step: int, job: str) -> Path:
    """A memory tier's node copy at `folder` (`saved_at`, and the manifest a save writes beside it), saved by job
    `job` with one saving rank, whose pieces it holds."""
    index = read_index(saved_at(folder, step))
    files = tuple((f.name, f.nbytes, f.header_end) for f in index.files.values())
    write_manifest(folder, Manifest(folder.name, step, index.run.source["fingerprint"], job, 1,
                                    {0: tuple((name, header, size) for name, size, header in files)}, files))
    return folder


def with_edited_index(path: Path, copy: Path, edit: Callable[[dict], None]) -> Path:
    """A copy of the ucp checkpoint at `path` at `copy`, its index changed in place by `edit`."""
    shutil.copytree(path, copy)
    index = json.loads((copy / "ucp_index.json").read_text())
    edit(index)
    (copy / "ucp_index.json").write_text(json.dumps(index))
    return copy


def with_added_param(path: Path, copy: Path, name: str, like: str, states: dict[str, torch.Tensor],
                     edit: Callable[[dict], None] | None = None) -> Path:
    """A copy of the ucp checkpoint at `path` at `copy` that also holds parameter `name`: an entry like
    `like`'s, its `states` stored in a data file of their own (through ucp's writer), then `edit`."""
    shutil.copytree(path, copy)
    index = json.loads((copy / "ucp_index.json").read_text())
    file_name = "data-added.safetensors"
    slots = [TensorSlot(tensor_key(name, state), str(t.dtype).removeprefix("torch."), tuple(t.shape))
             for state, t in states.items()]
    writer = StreamingWriter(str(copy / file_name), slots)
    entry = dict(index["params"][like], states={})
    for slot, t in zip(slots, states.values()):
        stored = writer.write(slot.key, t.contiguous())
        entry["states"][slot.key.rsplit(":", 1)[1]] = {"file": file_name, "key": slot.key, "dtype": slot.dtype,
                                                       "shape": list(slot.shape), "offsets": [stored.begin, stored.end],
                                                       "crc32": stored.crc32}
    writer.close()
    index["files"][file_name] = {"bytes": writer.size}
    index["params"][name] = entry
    if edit is not None:
        edit(index)
    (copy / "ucp_index.json").write_text(json.dumps(index))
    return copy


def _entry(e: ParamEntry) -> tuple:
    # ZeRO-3 files keep each parameter's tail padding, which the live ranks' runs exclude, so the
    # informational pattern's `padded_size` may differ; what the pattern is may not.
    return (e.kind, e.shape, e.group, e.step, e.model_dtype, list(e.states),
            {k: v for k, v in (e.pattern or {}).items() if k != "padded_size"})


def stored_bytes(path, names=None) -> int:
    """The bytes of every state of `names` (all parameters by default) in the ucp checkpoint at `path`."""
    params = ucp.open_checkpoint(path).index.params
    return sum(params[name].nbytes for name in (names or params))


def assert_index_round_trips(ckpt) -> None:
    """The typed index a reader gets holds all of the JSON its writer committed: stored again, it is that JSON."""
    assert index_json(ckpt.index) == json.loads((ckpt.path / INDEX_NAME).read_text())


def assert_same_checkpoint(saved, converted):
    """Every state of every parameter torch.equal, and the same metadata, but for where it came from."""
    assert_index_round_trips(saved)
    assert_index_round_trips(converted)
    assert saved.names == converted.names
    for name in converted.names:
        a, b = saved.index.params[name], converted.index.params[name]
        assert _entry(a) == _entry(b), name
        for state in b.states:
            x, y = saved.tensor(name, state), converted.tensor(name, state)
            assert x.dtype == y.dtype and torch.equal(x, y), (name, state)
    for key in ("training", "optimizer", "lr_scheduler", "client_state"):
        assert getattr(saved.index.run, key) == getattr(converted.index.run, key), key
    assert saved.index.global_split == converted.index.global_split, "global_split"
    assert saved.index.aliases == converted.index.aliases, "aliases"
