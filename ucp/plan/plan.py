"""What a conversion moves: parameters, their states, and where each state's fragments lie.

A converter turns a framework's checkpoint into a `ConversionPlan` by reading metadata only; the
executor then materialises every state with Extract → Union → StripPad. The plan is plain frozen
data, so it pickles to worker processes (or Ray tasks) cheaply.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ucp.format.index import DTYPE_SIZES, NotSaved
from ucp.patterns.recognize import FragmentInfo
from ucp.patterns.types import PatternSpec

# Parameter kinds, as stored in the index.
TRAINABLE = "param"
FROZEN = "frozen"
BUFFER = "buffer"

# The state holding a buffer's value (buffers keep their own dtype).
BUFFER_STATE = "value"
WEIGHT_STATE = "fp32"


@dataclass(frozen=True)
class Piece:
    """A contiguous run of `numel` elements of `dtype` starting at `byte_offset` in file `path`."""

    path: str
    byte_offset: int
    numel: int
    dtype: str


@dataclass(frozen=True)
class Fragment:
    info: FragmentInfo
    piece: Piece


@dataclass(frozen=True)
class StateSource:
    """One state of one parameter: how its fragments combine and the dtype it is stored in.

    `groups` is set when the spec nests (`spec.inner`: a TP shard or a pipeline stage's copy that
    ZeRO partitioned further): consecutive runs of `fragments`, `groups[i]` long, make up outer
    piece i. The fragments stay one flat tuple so that readers need not know about nesting.
    """

    spec: PatternSpec
    fragments: tuple[Fragment, ...]
    dtype: str = "float32"
    groups: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.spec.numel * _itemsize(self.dtype)

    def arrange(self, pieces: list) -> list:
        """`pieces` (one per fragment, in order) as Union takes them: one list per outer piece when nested."""
        if self.groups is None:
            return pieces
        if sum(self.groups) != len(pieces):
            raise ValueError(f"{len(pieces)} pieces for groups of {list(self.groups)} fragments")
        out, start = [], 0
        for size in self.groups:
            out.append(pieces[start:start + size])
            start += size
        return out


@dataclass(frozen=True)
class ParamPlan:
    name: str
    shape: tuple[int, ...]
    kind: str
    states: dict[str, StateSource]
    group: int | None = None
    step: float | None = None
    model_dtype: str = "float32"
    splits: tuple[int, int] | None = None  # (dim, count): states stored split-major, see ucp.format.splits

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.states.values())


@dataclass
class ConversionPlan:
    params: list[ParamPlan]
    source: dict
    optimizer: dict | None
    training: dict = field(default_factory=dict)
    lr_scheduler: object = None
    client_state: dict = field(default_factory=dict)
    source_files: list[str] = field(default_factory=list)
    # Small files beside the tag folder that travel into the checkpoint (name -> source path), and
    # those left behind (name -> why); see `ucp.converters.trainer_folders`.
    extra_files: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)
    # alias -> source: a tied weight's second name (e.g. lm_head.weight -> embed_tokens.weight), stored once
    aliases: dict[str, str] = field(default_factory=dict)
    # parameters the source left out on purpose (frozen ones under exclude_frozen_parameters)
    not_saved: NotSaved | None = None

    def param(self, name: str) -> ParamPlan:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)


def _itemsize(dtype: str) -> int:
    return DTYPE_SIZES[dtype]
