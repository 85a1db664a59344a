"""The index a conversion or an asynchronous save commits (docs/FORMAT.md), built as the typed
`ucp.format.index.Index` from what each parameter is and where each of its states landed.

A conversion describes its parameters from its plan (`records_of`); an asynchronous save describes them
from the live engine. Either way the index comes out of `build_index` alone, is stored through
`ucp.format.index.index_json` and read back through `ucp.format.index.parse_index`.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ucp.errors import UcpError
from ucp.format.crc import CHUNK_BYTES
from ucp.format.folder import tensor_key
from ucp.format.index import FORMAT_VERSION, DataFile, ExtraFile, Index, ParamEntry, RunRecord, StoredState
from ucp.format.safetensors_stream import StoredTensor
from ucp.patterns.types import PatternSpec
from ucp.plan.plan import ConversionPlan, ParamPlan


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

    def entry(self, states: dict[str, StoredState]) -> ParamEntry:
        """This parameter's index entry, with `states` where its states are stored."""
        return ParamEntry(self.name, self.kind, self.shape, states, self.group, self.step, self.pattern.to_json(),
                          self.model_dtype)


@dataclass(frozen=True)
class WrittenFile:
    """One data file as its writer reports it: its size and where each tensor landed."""

    name: str
    nbytes: int
    chunk_bytes: int
    tensors: dict[str, StoredTensor]  # key -> where its bytes landed, and their checksums


def records_of(plan: ConversionPlan) -> tuple[RunRecord, dict[str, str], list[ParamRecord]]:
    run = RunRecord(plan.source, plan.training, plan.optimizer, plan.lr_scheduler, plan.client_state,
                    plan.not_saved)
    return run, dict(plan.aliases), [ParamRecord.of(p) for p in plan.params]


def build_index(run: RunRecord, aliases: dict[str, str], params: list[ParamRecord], fingerprint: str,
                written: list[WrittenFile], extra: dict[str, ExtraFile] | None = None) -> Index:
    """The index of a checkpoint of `params`, stored as `written` says, with the `extra` files copied."""
    where = {key: (f.name, t) for f in written for key, t in f.tensors.items()}
    entries = {}
    for p in params:
        states = {}
        for state, dtype in p.dtypes.items():
            file_name, t = where[tensor_key(p.name, state)]
            states[state] = StoredState(file_name, t.key, dtype, p.shape, t.begin, t.end, t.crc32, p.splits,
                                        tuple(t.chunk_crc32))
        entries[p.name] = p.entry(states)
    files = {f.name: DataFile(f.name, f.nbytes, min((t.begin for t in f.tensors.values()), default=f.nbytes))
             for f in sorted(written, key=lambda f: f.name)}  # ucp's writers start tensor data at the first tensor
    return Index(FORMAT_VERSION, files, entries, dict(aliases), _one_chunk_size(written),
                 replace(run, source={**run.source, "fingerprint": fingerprint}), dict(extra or {}),
                 max((p.splits[1] for p in params if p.splits), default=1))


def _one_chunk_size(written: list[WrittenFile]) -> int:
    sizes = {f.chunk_bytes for f in written}
    if len(sizes) > 1:
        raise UcpError(f"data files written with different chunk sizes {sorted(sizes)}; convert again")
    return sizes.pop() if sizes else CHUNK_BYTES
