"""The index of a ucp checkpoint as one typed model, for writing it and for reading it back.

Writers (`ucp convert`, the asynchronous save, `write_tensors`) build an `Index` and store it through
`index_json`; readers (the hook, HMP slice loads, inspect, verify, export) get one from `parse_index`
and never see the JSON. `parse_index(raw, directory)` accepts exactly what docs/FORMAT.md specifies
and turns anything else into one `CorruptCheckpointError` naming the index, the field and the fix:
wrong types, negative or huge numbers, unknown dtypes, a state whose byte range does not fit its dtype
and shape, ranges that start inside the safetensors header, run past their file or overlap another,
and file names that are not plain names of regular files inside the checkpoint folder (a symlink, a
FIFO or `../x` is refused; files are opened with O_NOFOLLOW | O_NONBLOCK and checked with S_ISREG).
"""
from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ucp.errors import CorruptCheckpointError
from ucp.format.crc import CHUNK_BYTES, chunk_bounds
from ucp.format.fields import Fields
from ucp.storage.layer import is_remote, read_ranges
from ucp.storage.locations import Location, ObjectPath
from ucp.version import __version__

DTYPE_SIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
               "int8": 1, "uint8": 1, "bool": 1}
SAFETENSORS_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                      "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
KINDS = ("param", "frozen", "buffer")
FORMAT_NAME = "ucp-atomic"
FORMAT_VERSION = 1
HEADER_LENGTH_BYTES = 8
_FIX = "convert the checkpoint again, or restore the folder from a copy"
MAX_STEP = 1 << 53  # the largest whole number a float64 holds exactly


@dataclass(frozen=True)
class StoredState:
    """One state of one parameter: where its bytes are and what they must checksum to."""

    file: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int
    crc32: int
    splits: tuple[int, int] | None = None  # (dim, count): stored split-major, see ucp.format.splits
    chunk_crc32: tuple[int, ...] | None = None  # of each chunk (ucp.format.crc.chunk_bounds); None in older checkpoints

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ParamEntry:
    name: str
    kind: str  # one of KINDS
    shape: tuple[int, ...]
    states: dict[str, StoredState]
    group: int | None = None  # the optimizer param group it was trained in
    step: float | None = None  # the optimizer step its moments were last updated at
    pattern: dict[str, Any] | None = None  # how the ranks that saved it held it (PatternSpec.to_json); informational
    model_dtype: str | None = None  # the dtype the training model held it in

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.states.values())


@dataclass(frozen=True)
class DataFile:
    name: str
    nbytes: int
    header_end: int  # where the safetensors header ends and tensor data may begin


@dataclass(frozen=True)
class ExtraFile:
    """A small file carried along from the source (a Trainer's config, tokenizer, trainer_state)."""

    name: str
    nbytes: int
    crc32: int


NOT_SAVED_KINDS = ("frozen",)


@dataclass(frozen=True)
class NotSaved:
    """Parameters of the trained model that the checkpoint leaves out on purpose: every `kind` one (frozen:
    DeepSpeed's `save_checkpoint(exclude_frozen_parameters=True)`, as the Trainer saves a PEFT model). A
    loader keeps them as the model has them. `names` are those the source still names (a tied pair's two
    names); DeepSpeed records no name of the others."""

    kind: str  # one of NOT_SAVED_KINDS
    reason: str  # e.g. "exclude_frozen_parameters"
    names: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind}, not saved: {self.reason}"


@dataclass(frozen=True)
class RunRecord:
    """What the index keeps of the training run beside its tensors, as the engine saved it."""

    source: dict[str, Any] = field(default_factory=dict)  # what was converted or saved: framework, degrees, fingerprint
    training: dict[str, Any] = field(default_factory=dict)  # global_steps, global_samples, skipped_steps, loss_scaler
    optimizer: dict[str, Any] | None = None  # type, states, param_groups (hyperparams and member names)
    lr_scheduler: object = None  # the scheduler's state_dict
    client_state: dict[str, Any] = field(default_factory=dict)
    not_saved: NotSaved | None = None  # parameters the source left out on purpose


@dataclass(frozen=True)
class Index:
    version: int
    files: dict[str, DataFile]
    params: dict[str, ParamEntry]
    aliases: dict[str, str]  # a tied weight's second name -> the parameter stored
    chunk_bytes: int = CHUNK_BYTES  # the runs that states' chunk checksums cover
    run: RunRecord = field(default_factory=RunRecord)
    extra_files: dict[str, ExtraFile] = field(default_factory=dict)
    global_split: int | None = 1  # the most pieces a state is stored split into (ucp.format.splits); None: unknown
    created_by: str = f"ucp {__version__}"

    def entry(self, name: str) -> ParamEntry:
        """The entry of parameter `name`, or of the parameter a tied alias `name` is stored as."""
        return self.params[self.aliases.get(name, name)]


def index_json(index: Index) -> dict[str, Any]:
    """The JSON docs/FORMAT.md specifies for `index` (what `parse_index` reads back)."""
    return {
        "format": FORMAT_NAME,
        "format_version": index.version,
        "created_by": index.created_by,
        "source": index.run.source,
        "training": index.run.training,
        "optimizer": index.run.optimizer,
        "lr_scheduler": index.run.lr_scheduler,
        "client_state": _jsonable(index.run.client_state),
        "splits": {} if index.global_split is None else {"global_split": index.global_split},
        "files": {f.name: {"bytes": f.nbytes} for f in sorted(index.files.values(), key=lambda f: f.name)},
        "chunk_bytes": index.chunk_bytes,
        "extra_files": {e.name: {"bytes": e.nbytes, "crc32": e.crc32} for e in index.extra_files.values()},
        "aliases": dict(index.aliases),
        **({"not_saved": _not_saved_json(index.run.not_saved)} if index.run.not_saved is not None else {}),
        "params": {p.name: _param_json(p) for p in index.params.values()},
    }


def _not_saved_json(n: NotSaved) -> dict[str, Any]:
    return {"kind": n.kind, "reason": n.reason, "names": list(n.names)}


def _param_json(p: ParamEntry) -> dict[str, Any]:
    entry: dict[str, Any] = {"kind": p.kind, "shape": list(p.shape)}
    if p.model_dtype is not None:
        entry["model_dtype"] = p.model_dtype
    if p.pattern is not None:
        entry["pattern"] = p.pattern
    entry["states"] = {state: _state_json(s) for state, s in p.states.items()}
    if p.group is not None:
        entry["group"] = p.group
    if p.step is not None:
        entry["step"] = p.step
    return entry


def _state_json(s: StoredState) -> dict[str, Any]:
    out: dict[str, Any] = {"file": s.file, "key": s.key, "dtype": s.dtype, "shape": list(s.shape),
                           "offsets": [s.begin, s.end], "crc32": s.crc32}
    if s.chunk_crc32 is not None:
        out["chunk_crc32"] = list(s.chunk_crc32)
    if s.splits is not None:
        out["splits"] = {"dim": s.splits[0], "count": s.splits[1]}
    return out


def _jsonable(value: dict[str, Any]) -> dict[str, Any]:
    """A client state JSON can hold, or the repr of each value where it cannot."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return {k: repr(v) for k, v in value.items()}


class _Fields(Fields):
    """`Fields` of the index: every message ends with how to get a sound one."""

    def __init__(self, where: str, value: object, path: Location):
        super().__init__(where, value, path, _FIX)


def parse_index(raw: object, directory: Location, index_path: Location | None = None) -> Index:
    """The typed, fully checked index of the checkpoint in `directory` (its data files are stat-ed
    and their header lengths read; no tensor byte is read)."""
    path = index_path if index_path is not None else directory / "ucp_index.json"
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{path}: not a {FORMAT_NAME} index; convert the checkpoint again")
    version = raw.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CorruptCheckpointError(f"{path}: format_version {version!r} is not a version number; the index is "
                                     "damaged, convert the checkpoint again")
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(f"{path}: format version {version} is newer than this ucp reads "
                                     f"({FORMAT_VERSION}); upgrade ucp")
    top = _Fields("index", raw, path)
    chunk_bytes = top.count("chunk_bytes", required=False, limit=1 << 40)
    if chunk_bytes == 0:
        raise _bad(path, "index.chunk_bytes", "must be at least 1")
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    files = {}
    for name, meta in top.get("files", (dict,)).items():
        files[name] = _data_file(directory, path, name, _Fields(f"files[{name!r}]", meta, path).count("bytes"))
    params = {}
    for name, entry in top.get("params", (dict,)).items():
        params[name] = _param(path, name, _Fields(f"params[{name!r}]", entry, path), files, chunk_bytes)
    _no_overlaps(path, params)
    extra_files = {}
    for name, meta in (top.get("extra_files", (dict,), required=False) or {}).items():
        fields = _Fields(f"extra_files[{name!r}]", meta, path)
        if not plain_name(name) or name in files:
            raise _bad(path, f"extra_files[{name!r}]", "is not a plain file name of its own in the folder")
        extra_files[name] = ExtraFile(name, fields.count("bytes"), fields.count("crc32", limit=0xFFFFFFFF))
    splits = top.get("splits", (dict,), required=False)
    global_split = _Fields("index.splits", splits, path).count("global_split", required=False) if splits else None
    aliases = _aliases(top, path, params)
    run = replace(_run_record(top, path), not_saved=_not_saved(top, path, {*params, *aliases}))
    _check_groups(path, params, run.optimizer)
    return Index(version, files, params, aliases, chunk_bytes, run, extra_files, global_split,
                 top.get("created_by", (str,), required=False) or "")


def _check_groups(path: Location, params: dict[str, ParamEntry], optimizer: dict[str, Any] | None) -> None:
    """A parameter's optimizer group is one the index lists, and a group lists only trainable parameters of its
    own (the hook restores each engine group's hyper-parameters and step from them)."""
    groups = (optimizer or {}).get("param_groups") or []
    if not groups:
        return
    for name, entry in params.items():
        if entry.group is not None and entry.group >= len(groups):
            raise _bad(path, f"params[{name!r}].group", f"{entry.group} is not one of the optimizer's "
                       f"{len(groups)} param groups")
    for g, group in enumerate(groups):
        for name in group["params"]:
            member = params.get(name)
            if member is None or member.kind != "param" or member.group != g:
                raise _bad(path, f"index.optimizer.param_groups[{g}].params", f"names {name!r}, which is not a "
                           f"trainable parameter of group {g} in the index")


def _step(path: Location, where: str, value: int | float | None) -> float | None:
    """An optimizer step: a whole number of steps a float holds exactly (DeepSpeed keeps it as a float)."""
    if value is not None and not (math.isfinite(value) and 0 <= value <= MAX_STEP and value == int(value)):
        raise _bad(path, where, f"{value!r} is not a step count (a whole number in [0, 2^53])")
    return value


def _aliases(top: _Fields, path: Location, params: dict[str, ParamEntry]) -> dict[str, str]:
    aliases = top.get("aliases", (dict,), required=False) or {}
    for alias, source in aliases.items():
        if alias in params or not isinstance(source, str) or source not in params:
            raise _bad(path, f"aliases[{alias!r}]", f"must name a stored parameter ({source!r} is none) and not be "
                       "one itself")
    return dict(aliases)


def _not_saved(top: _Fields, path: Location, held: set[str]) -> NotSaved | None:
    raw = top.get("not_saved", (dict,), required=False)
    if raw is None:
        return None
    fields = _Fields("index.not_saved", raw, path)
    kind = fields.get("kind", (str,))
    if kind not in NOT_SAVED_KINDS:
        raise _bad(path, "index.not_saved.kind", f"{kind!r} is not one of {', '.join(NOT_SAVED_KINDS)}")
    names = fields.get("names", (list,))
    if not all(isinstance(n, str) and n not in held for n in names):
        raise _bad(path, "index.not_saved.names", "must list names of parameters the checkpoint does not hold")
    return NotSaved(kind, fields.get("reason", (str,)), tuple(names))


def _run_record(top: _Fields, path: Location) -> RunRecord:
    """The JSON records beside the tensors, checked to have the shapes their readers (hook, inspect) rely on."""
    source, client_state = (top.get(key, (dict,), required=False) or {} for key in ("source", "client_state"))
    lr_scheduler = top.get("lr_scheduler", (dict, type(None)), required=False)
    training = top.get("training", (dict,), required=False) or {}
    fields = _Fields("index.training", training, path)
    for key in ("global_steps", "global_samples", "skipped_steps"):
        fields.count(key, required=False)
    fields.get("loss_scaler", (dict,), required=False)
    optimizer = top.get("optimizer", (dict, type(None)), required=False)
    if optimizer is not None:
        fields = _Fields("index.optimizer", optimizer, path)
        fields.get("type", (str,), required=False)
        if not all(isinstance(s, str) for s in fields.get("states", (list,), required=False) or []):
            raise _bad(path, "index.optimizer.states", "must be a list of state names")
        for g, group in enumerate(fields.get("param_groups", (list,), required=False) or []):
            group = _Fields(f"index.optimizer.param_groups[{g}]", group, path)
            group.get("hyperparams", (dict,))
            if not all(isinstance(n, str) for n in group.get("params", (list,))):
                raise _bad(path, f"{group.where}.params", "must be a list of parameter names")
    return RunRecord(source, training, optimizer, lr_scheduler, client_state)


def _data_file(directory: Location, path: Location, name: str, recorded: int) -> DataFile:
    if not plain_name(name):
        raise _bad(path, f"files[{name!r}]", "is not a plain file name inside the checkpoint folder")
    if is_remote(directory):
        return _data_object(directory / name, name, recorded)
    file_path = directory / name
    try:
        fd = os.open(file_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{file_path}: missing, though the index lists it; {_FIX}") from None
    except OSError as exc:
        raise CorruptCheckpointError(f"{file_path}: cannot be opened as a regular file ({exc.strerror}); a "
                                     f"symlink or special file stands where a data file belongs; {_FIX}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCheckpointError(f"{file_path}: not a regular file; {_FIX}")
        if info.st_size != recorded:
            raise CorruptCheckpointError(f"{file_path}: {info.st_size} bytes, the index records {recorded}; the "
                                         f"file was truncated or changed; {_FIX}")
        head = os.pread(fd, HEADER_LENGTH_BYTES, 0)
    finally:
        os.close(fd)
    if len(head) < HEADER_LENGTH_BYTES:
        raise CorruptCheckpointError(f"{file_path}: too short for a safetensors file; {_FIX}")
    header_end = HEADER_LENGTH_BYTES + struct.unpack("<Q", head)[0]
    if header_end > recorded:
        raise CorruptCheckpointError(f"{file_path}: its safetensors header claims {header_end} bytes of a "
                                     f"{recorded}-byte file; {_FIX}")
    return DataFile(name, recorded, header_end)


def _data_object(file_path: ObjectPath, name: str, recorded: int) -> DataFile:
    """`_data_file` of an object: its size and header length, in one HEAD and one ranged GET."""
    from ucp.storage.layer import size

    found = size(file_path)
    if found is None:
        raise CorruptCheckpointError(f"{file_path}: missing, though the index lists it; {_FIX}")
    if found != recorded:
        raise CorruptCheckpointError(f"{file_path}: {found} bytes, the index records {recorded}; the object was "
                                     f"truncated or changed; {_FIX}")
    if found < HEADER_LENGTH_BYTES:
        raise CorruptCheckpointError(f"{file_path}: too short for a safetensors file; {_FIX}")
    head = bytearray(HEADER_LENGTH_BYTES)
    read_ranges([(file_path, 0, memoryview(head))])
    header_end = HEADER_LENGTH_BYTES + struct.unpack("<Q", head)[0]
    if header_end > recorded:
        raise CorruptCheckpointError(f"{file_path}: its safetensors header claims {header_end} bytes of a "
                                     f"{recorded}-byte file; {_FIX}")
    return DataFile(name, recorded, header_end)


def plain_name(name: object) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")


def _param(path: Location, name: str, entry: _Fields, files: dict[str, DataFile], chunk_bytes: int) -> ParamEntry:
    kind = entry.get("kind", (str,))
    if kind not in KINDS:
        raise _bad(path, f"{entry.where}.kind", f"{kind!r} is not one of {', '.join(KINDS)}")
    shape = _shape(path, f"{entry.where}.shape", entry.get("shape", (list,)))
    group = entry.count("group", required=False)
    step = _step(path, f"{entry.where}.step", entry.get("step", (int, float), required=False))
    pattern = entry.get("pattern", (dict,), required=False)
    if pattern is not None:
        _Fields(f"{entry.where}.pattern", pattern, path).get("pattern", (str,))
    model_dtype = entry.get("model_dtype", (str,), required=False)
    if model_dtype is not None and model_dtype not in DTYPE_SIZES:
        raise _bad(path, f"{entry.where}.model_dtype", f"unknown dtype {model_dtype!r}")
    states = {}
    for state, stored in entry.get("states", (dict,)).items():
        states[state] = _state(path, _Fields(f"{entry.where}.states[{state!r}]", stored, path), shape, files,
                               chunk_bytes)
    return ParamEntry(name, kind, shape, states, group, step, pattern, model_dtype)


def _state(path: Location, fields: _Fields, shape: tuple[int, ...], files: dict[str, DataFile],
           chunk_bytes: int) -> StoredState:
    where = fields.where
    file_name = fields.get("file", (str,))
    if file_name not in files:
        raise _bad(path, f"{where}.file", f"{file_name!r} is not among the index's files")
    dtype = fields.get("dtype", (str,))
    if dtype not in DTYPE_SIZES:
        raise _bad(path, f"{where}.dtype", f"unknown dtype {dtype!r}")
    stored_shape = _shape(path, f"{where}.shape", fields.get("shape", (list,)))
    if stored_shape != shape:
        raise _bad(path, f"{where}.shape", f"{list(stored_shape)} differs from the parameter's {list(shape)}")
    offsets = fields.get("offsets", (list,))
    if len(offsets) != 2 or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets):
        raise _bad(path, f"{where}.offsets", "must be [begin, end], two integers")
    begin, end = offsets
    data = files[file_name]
    if not data.header_end <= begin <= end <= data.nbytes:
        raise _bad(path, f"{where}.offsets", f"[{begin}, {end}) lies outside the tensor data of {file_name} "
                   f"(bytes [{data.header_end}, {data.nbytes}))")
    if end - begin != math.prod(shape) * DTYPE_SIZES[dtype]:
        raise _bad(path, f"{where}.offsets", f"{end - begin} bytes cannot hold {dtype}{list(shape)}")
    crc = fields.count("crc32", limit=0xFFFFFFFF)
    splits = None
    if "splits" in fields.value:
        split = _Fields(f"{where}.splits", fields.value["splits"], path)
        dim, count = split.count("dim"), split.count("count")
        if dim >= max(len(shape), 1) or count < 1:
            raise _bad(path, f"{where}.splits", f"dim {dim}, count {count} do not split shape {list(shape)}")
        splits = (dim, count)
    chunks = fields.get("chunk_crc32", (list,), required=False)
    if chunks is not None:
        expected = len(chunk_bounds(begin, end, chunk_bytes))
        if len(chunks) != expected or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 0xFFFFFFFF
                                              for c in chunks):
            raise _bad(path, f"{where}.chunk_crc32", f"must be {expected} CRC-32 values, one per chunk")
        chunks = tuple(chunks)
    return StoredState(file_name, fields.get("key", (str,)), dtype, shape, begin, end, crc, splits, chunks)


def _shape(path: Location, where: str, value: list[Any]) -> tuple[int, ...]:
    if len(value) > 64 or not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d < 1 << 48
                                  for d in value):
        raise _bad(path, where, f"{value!r} is not a shape (up to 64 sizes, each in [0, 2^48))")
    return tuple(value)


def stored_shape(shape: Sequence[int], split: tuple[int, int] | None) -> tuple[int, ...]:
    """The shape a state's safetensors header gives: flat when split-major differs from row-major."""
    if split is None or split[0] == 0 or split[1] == 1:
        return tuple(shape)
    return (math.prod(shape),)


def header_problems(path: Location, data: DataFile, states: list[StoredState]) -> list[str]:
    """Where the safetensors header of data file `path` disagrees with what the index says it holds."""
    try:
        head = bytearray(data.header_end)
        read_ranges([(path, 0, memoryview(head))])
        header = json.loads(head[HEADER_LENGTH_BYTES:])
    except (OSError, ValueError, RecursionError, CorruptCheckpointError) as exc:
        return [f"{path}: its safetensors header cannot be read ({exc})"]
    if not isinstance(header, dict):
        return [f"{path}: its safetensors header is not a JSON object"]
    problems = []
    keys = set()
    for s in states:
        keys.add(s.key)
        expected = {"dtype": SAFETENSORS_DTYPES[s.dtype], "shape": list(stored_shape(s.shape, s.splits)),
                    "data_offsets": [s.begin - data.header_end, s.end - data.header_end]}
        found = header.get(s.key)
        if found != expected:
            problems.append(f"{path}: header entry {s.key} is {found!r}, the index says {expected}")
    extra = sorted(k for k in header if k != "__metadata__" and k not in keys)
    if extra:
        problems.append(f"{path}: header holds {len(extra)} tensor(s) the index does not list, e.g. {extra[0]}")
    return problems


def _no_overlaps(path: Location, params: dict[str, ParamEntry]) -> None:
    by_file: dict[str, list[tuple[int, int, str]]] = {}
    for name, entry in params.items():
        for state, stored in entry.states.items():
            if stored.nbytes:
                by_file.setdefault(stored.file, []).append((stored.begin, stored.end, f"{name}:{state}"))
    for file_name, ranges in by_file.items():
        ranges.sort()
        for (_, end, first), (begin, _, second) in zip(ranges, ranges[1:]):
            if begin < end:
                raise CorruptCheckpointError(f"{path}: {first} and {second} overlap in {file_name}; {_FIX}")


def _bad(path: Location, where: str, problem: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {where} {problem}; {_FIX}")
