"""What a DeepSpeed checkpoint declares about its tensor-parallel layout, as recognizer hints.

DeepSpeed AutoTP (0.19) writes `universal_checkpoint_info` version 0.4 into every
`mp_rank_{MM}_model_states.pt`. Its `affine_map` describes, per parameter (keyed by a regex of
its name), the full `logical_shape` and, for each TP rank, the `shard_shape` it holds and the
`pieces` of the full tensor in it: `shape`, `source` (offset, strides) in the full tensor, `dest`
(offset, strides) in the shard, the `locations` (ranks) holding that block, and an optional `scale`.

`declared_layout` reads one parameter's entry as a full shape plus `Hints`: one piece per rank,
the full tensor everywhere → Replicate; one block per rank, the blocks tiling the full tensor
along dim 0 / 1 in rank order → Shard-V / Shard-H (a shard longer than its block is vocabulary
padding). A map that places several blocks on a rank (a fused parameter) or scales its blocks is
refused by name rather than read approximately. `declared_blocks` reads the same maps (and
refuses the same ones) as the box of the full tensor each TP rank holds, for the load hook.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ucp.errors import CorruptCheckpointError, UnsupportedLayoutError
from ucp.format.boxes import Box
from ucp.patterns import Hints, Pattern

AFFINE_MAP_VERSION = 1  # the newest `affine_map.version` this reader knows


def affine_params(uc_info: dict | None, source: str) -> dict[str, dict]:
    """The `affine_map` entries of `uc_info` (regex of a parameter name -> entry), or {}."""
    amap = (uc_info or {}).get("affine_map") or {}
    version = int(amap.get("version", AFFINE_MAP_VERSION))
    if version > AFFINE_MAP_VERSION:
        raise UnsupportedLayoutError(f"{source}: its affine_map is version {version}; this ucp reads version "
                                     f"{AFFINE_MAP_VERSION} and older, upgrade ucp to convert it")
    return dict(amap.get("params") or {})


def declared_layout(name: str, entries: dict[str, dict]) -> tuple[tuple[int, ...], Hints] | None:
    """The full shape and hints the affine map declares for `name`, or None when it has no entry."""
    entry = _entry_of(name, entries)
    if entry is None:
        return None
    logical = tuple(int(s) for s in entry["logical_shape"])
    ranks = _ranks(entry)
    pieces = [r["pieces"] for r in ranks]
    if any(p.get("scale", 1.0) != 1.0 for rank in pieces for p in rank):
        raise UnsupportedLayoutError(f"{name}: its affine map stores scaled blocks (a pre-divided bias); ucp does "
                                     "not rebuild scaled shards yet")
    if any(len(rank) != 1 for rank in pieces):
        raise UnsupportedLayoutError(f"{name}: its affine map places {[len(r) for r in pieces]} blocks on the TP "
                                     "ranks (a fused parameter); ucp does not rebuild such maps yet")
    blocks = [rank[0] for rank in pieces]
    strides = _row_major(logical)
    if all(tuple(b["shape"]) == logical and b["source"][0] == 0 for b in blocks):
        return logical, Hints(pattern=Pattern.REPLICATE)
    dims = {d for b in blocks for d, (got, full) in enumerate(zip(b["shape"], logical)) if got != full}
    if len(dims) != 1 or any(list(b["source"][1]) != strides for b in blocks):
        raise UnsupportedLayoutError(f"{name}: its affine map splits it along dims {sorted(dims)} with strided "
                                     "blocks; ucp rebuilds splits along one dim only")
    dim = dims.pop()
    if dim > 1:
        raise UnsupportedLayoutError(f"{name}: its affine map splits it along dim {dim}; ucp rebuilds splits "
                                     "along dim 0 or 1 only")
    cursor = 0
    for rank, (block, shard) in enumerate(zip(blocks, ranks)):
        if block["source"][0] != cursor * strides[dim] or block["dest"][0] != 0:
            raise UnsupportedLayoutError(f"{name}: TP rank {rank}'s block starts at element {block['source'][0]}, "
                                         "not where the previous rank's ends; ucp rebuilds blocks in rank order only")
        if rank < len(blocks) - 1 and int(shard["shard_shape"][dim]) != int(block["shape"][dim]):
            raise UnsupportedLayoutError(f"{name}: TP rank {rank} pads its shard in the middle of the tensor; ucp "
                                         "strips padding at the end (the last rank's) only")
        cursor += int(block["shape"][dim])
    if cursor != logical[dim]:
        raise CorruptCheckpointError(f"{name}: its affine map's blocks cover {cursor} of {logical[dim]} entries "
                                     f"along dim {dim}")
    held = sum(int(shard["shard_shape"][dim]) for shard in ranks)
    return logical, Hints(pattern=Pattern.SHARD_V if dim == 0 else Pattern.SHARD_H,
                          padded_dim_size=held if held > logical[dim] else None)


@dataclass(frozen=True)
class RankBlock:
    """What one TP rank holds of a parameter: `box` of the full tensor, in a shard of `shard_shape`
    (longer than the box along the split dim where the rank pads it, e.g. a padded vocabulary)."""

    box: Box
    shard_shape: tuple[int, ...]


def declared_blocks(name: str, entries: dict[str, dict]) -> tuple[tuple[int, ...], list[RankBlock]] | None:
    """The full shape of `name` and, per TP rank in rank order, the block its affine map places there;
    None when the map has no entry for it. Accepts exactly the maps `declared_layout` accepts."""
    declared = declared_layout(name, entries)
    if declared is None:
        return None
    logical, hints = declared
    full = tuple((0, n) for n in logical)
    blocks = []
    entry = _entry_of(name, entries)
    for shard in _ranks(entry) if entry is not None else []:  # declared_layout found the entry
        piece, box = shard["pieces"][0], full
        if hints.pattern is not Pattern.REPLICATE:
            dim = 0 if hints.pattern is Pattern.SHARD_V else 1
            lo = int(piece["source"][0]) // _row_major(logical)[dim]
            box = full[:dim] + ((lo, lo + int(piece["shape"][dim])),) + full[dim + 1:]
        blocks.append(RankBlock(box, tuple(int(s) for s in shard["shard_shape"])))
    return logical, blocks


def _entry_of(name: str, entries: dict[str, dict]) -> dict | None:
    matched = [key for key in entries if re.match(key, name)]
    if len(matched) > 1:
        raise CorruptCheckpointError(f"{name}: several affine_map entries match it ({matched}); the checkpoint's "
                                     "universal_checkpoint_info is inconsistent")
    return entries[matched[0]] if matched else None


def _ranks(entry: dict) -> list[dict]:
    """The entry's per-rank records in rank order (keys are ints in a live map, strings once saved as JSON)."""
    return [entry["ranks"][r] for r in sorted(entry["ranks"], key=int)]


def _row_major(shape: tuple[int, ...]) -> list[int]:
    return [math.prod(shape[d + 1:]) for d in range(len(shape))]
