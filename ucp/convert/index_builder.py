"""The index a conversion or an asynchronous save commits: built from the plan of what was stored and
where each tensor landed (docs/FORMAT.md)."""
from __future__ import annotations

import json

from ucp.convert.plan import ConversionPlan, ParamPlan
from ucp.errors import UcpError
from ucp.format.crc import CHUNK_BYTES
from ucp.format.folder import FORMAT_NAME, FORMAT_VERSION, tensor_key
from ucp.version import __version__


def build_index(plan: ConversionPlan, fingerprint: str, results: list[dict],
                extra: dict[str, dict] | None = None) -> dict:
    """The index of a checkpoint of `plan`'s tensors, stored as `results` say, with the `extra` files copied."""
    where = {key: (r["file"], *span) for r in results for key, span in r["tensors"].items()}
    params = {}
    for p in plan.params:
        states = {}
        for state, source in p.states.items():
            file_name, begin, end, crc, chunks = where[tensor_key(p.name, state)]
            states[state] = {"file": file_name, "key": tensor_key(p.name, state), "dtype": source.dtype,
                             "shape": list(p.shape), "offsets": [begin, end], "crc32": crc,
                             "chunk_crc32": list(chunks)}
            if p.splits is not None:
                states[state]["splits"] = {"dim": p.splits[0], "count": p.splits[1]}
        params[p.name] = param_entry(p, states)
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "created_by": f"ucp {__version__}",
        "source": {**plan.source, "fingerprint": fingerprint},
        "training": plan.training,
        "optimizer": plan.optimizer,
        "lr_scheduler": plan.lr_scheduler,
        "client_state": _jsonable(plan.client_state),
        "splits": {"global_split": max((p.splits[1] for p in plan.params if p.splits), default=1)},
        "files": {r["file"]: {"bytes": r["bytes"]} for r in sorted(results, key=lambda r: r["file"])},
        "chunk_bytes": _one_chunk_size(results),
        "extra_files": extra or {},
        "aliases": dict(plan.aliases),
        "params": params,
    }


def _one_chunk_size(results: list[dict]) -> int:
    sizes = {r["chunk_bytes"] for r in results}
    if len(sizes) > 1:
        raise UcpError(f"data files written with different chunk sizes {sorted(sizes)}; convert again")
    return sizes.pop() if sizes else CHUNK_BYTES


def param_entry(p: ParamPlan, states: dict[str, dict]) -> dict:
    """A parameter's index entry (docs/FORMAT.md), with `states` its states' entries."""
    entry = {"kind": p.kind, "shape": list(p.shape), "model_dtype": p.model_dtype,
             "pattern": next(iter(p.states.values())).spec.to_json(), "states": states}
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
