"""How one state of one parameter is spread over the ranks that saved it.

The seven patterns are those of Universal Checkpointing (ATC'25). A `PatternSpec` is the
pattern plus exactly the geometry that Union needs to rebuild the full tensor.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Pattern(str, enum.Enum):
    UNIQUE = "unique"          # held by one rank only (a PP stage's layer, an expert)
    REPLICATE = "replicate"    # identical copies on several ranks
    PARTIAL = "partial"        # copies whose average is the value
    SHARD_V = "shard_v"        # split along dim 0 (ZeRO flat partitions are Shard-V of the flat tensor)
    SHARD_H = "shard_h"        # split along dim 1 (row-parallel linears)
    SHARD_HY = "shard_hy"      # split more than one way: outer shard whose pieces are themselves sharded
    SHARD_NC = "shard_nc"      # each rank holds non-contiguous sub-blocks (fused QKV, gate/up)


@dataclass(frozen=True)
class PatternSpec:
    """A pattern with the geometry Union needs.

    shape:       the logical (unpadded) shape of the full tensor.
    dim:         concatenation dim for SHARD_V/SHARD_H (always 0 / 1) and SHARD_NC / SHARD_HY outer dim.
    flat:        pieces are 1-D runs of the row-major flattened tensor (ZeRO partitions).
    padded_size: for flat shards, the padded flat length the pieces tile; for dim shards, the padded
                 length of `dim` (vocab padding). StripPad cuts back to `shape`.
    sub_widths:  SHARD_NC only: for every sub-parameter, the width each rank holds along `dim`
                 (sub_widths[s][r]); rank r's piece is its blocks of every sub-parameter, in order.
    inner:       SHARD_HY: the pattern of the pieces that make up each outer shard. Any other
                 pattern may nest too: a REPLICATE or UNIQUE whose copies are each held as
                 `inner` (a pipeline-tied weight that ZeRO partitioned on every stage).
    shard_shapes: with `inner`: the shape of each outer piece once its inner pieces are joined.
    """

    pattern: Pattern
    shape: tuple[int, ...]
    dim: int | None = None
    flat: bool = False
    padded_size: int | None = None
    sub_widths: tuple[tuple[int, ...], ...] | None = None
    inner: PatternSpec | None = None
    shard_shapes: tuple[tuple[int, ...], ...] | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def to_json(self) -> dict:
        out: dict = {"pattern": self.pattern.value}
        if self.dim is not None:
            out["dim"] = self.dim
        if self.flat:
            out["flat"] = True
        if self.padded_size is not None:
            out["padded_size"] = self.padded_size
        if self.sub_widths is not None:
            out["sub_widths"] = [list(w) for w in self.sub_widths]
        if self.inner is not None:
            out["inner"] = self.inner.to_json()
        return out
