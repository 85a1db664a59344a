"""The index a conversion or an asynchronous save commits (docs/FORMAT.md): built from records of what was
stored and where each tensor landed.

A conversion makes its records from its plan (`records_of`); an asynchronous save makes them from the
live engine. Either way the index comes out of `build_index` alone, and is read back through
`ucp.format.index.parse_index` alone.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from ucp.convert.plan import ConversionPlan, ParamPlan
from ucp.errors import UcpError
from ucp.format.crc import CHUNK_BYTES
from ucp.format.folder import FORMAT_NAME, FORMAT_VERSION, tensor_key
from ucp.patterns.types import PatternSpec
from ucp.version import __version__


@dataclass(frozen=True)
class ParamRecord:
    """What the index says of one parameter, besides where its states' bytes are."""

    name: str
    kind: str
    shape: tuple[int, ...]
    pattern: PatternSpec  # how the ranks that saved it held it
    dtypes: dict[str, str]  # state -> the dtype it is stored in
    model_dtype: str = "float32"
    group: int | None = None
    step: float | None = None
    splits: tuple[int, int] | None = None  # (dim, count): stored split-major

    @classmethod
    def of(cls, p: ParamPlan) -> ParamRecord:
        return cls(p.name, p.kind, p.shape, next(iter(p.states.values())).spec,
                   {state: source.dtype for state, source in p.states.items()}, p.model_dtype, p.group, p.step,
                   p.splits)


@dataclass(frozen=True)
class CheckpointRecord:
    """What the index says of the checkpoint as a whole."""

    source: dict
    training: dict
    optimizer: dict | None
    lr_scheduler: object
    client_state: dict
    aliases: dict[str, str]  # a tied weight's second name -> the parameter stored

    @classmethod
    def of(cls, plan: ConversionPlan) -> CheckpointRecord:
        return cls(plan.source, plan.training, plan.optimizer, plan.lr_scheduler, plan.client_state,
                   dict(plan.aliases))


def records_of(plan: ConversionPlan) -> tuple[CheckpointRecord, list[ParamRecord]]:
    return CheckpointRecord.of(plan), [ParamRecord.of(p) for p in plan.params]


def build_index(checkpoint: CheckpointRecord, params: list[ParamRecord], fingerprint: str, results: list[dict],
                extra: dict[str, dict] | None = None) -> dict:
    """The index of a checkpoint of `params`, stored as `results` (one per data file) say, with the `extra`
    files copied."""
    where = {key: (r["file"], *span) for r in results for key, span in r["tensors"].items()}
    entries = {}
    for p in params:
        states = {}
        for state, dtype in p.dtypes.items():
            file_name, begin, end, crc, chunks = where[tensor_key(p.name, state)]
            states[state] = {"file": file_name, "key": tensor_key(p.name, state), "dtype": dtype,
                             "shape": list(p.shape), "offsets": [begin, end], "crc32": crc,
                             "chunk_crc32": list(chunks)}
            if p.splits is not None:
                states[state]["splits"] = {"dim": p.splits[0], "count": p.splits[1]}
        entries[p.name] = param_entry(p, states)
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "created_by": f"ucp {__version__}",
        "source": {**checkpoint.source, "fingerprint": fingerprint},
        "training": checkpoint.training,
        "optimizer": checkpoint.optimizer,
        "lr_scheduler": checkpoint.lr_scheduler,
        "client_state": _jsonable(checkpoint.client_state),
        "splits": {"global_split": max((p.splits[1] for p in params if p.splits), default=1)},
        "files": {r["file"]: {"bytes": r["bytes"]} for r in sorted(results, key=lambda r: r["file"])},
        "chunk_bytes": _one_chunk_size(results),
        "extra_files": extra or {},
        "aliases": dict(checkpoint.aliases),
        "params": entries,
    }


def _one_chunk_size(results: list[dict]) -> int:
    sizes = {r["chunk_bytes"] for r in results}
    if len(sizes) > 1:
        raise UcpError(f"data files written with different chunk sizes {sorted(sizes)}; convert again")
    return sizes.pop() if sizes else CHUNK_BYTES


def param_entry(p: ParamRecord, states: dict[str, dict]) -> dict:
    """A parameter's index entry (docs/FORMAT.md), with `states` its states' entries."""
    entry = {"kind": p.kind, "shape": list(p.shape), "model_dtype": p.model_dtype, "pattern": p.pattern.to_json(),
             "states": states}
    if p.group is not None:
        entry["group"] = p.group
    if p.step is not None:
        entry["step"] = p.step
    return entry


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return {k: repr(v) for k, v in value.items()}
