"""Whether each rank file of a DeepSpeed checkpoint is the file of the rank its name gives.

DeepSpeed 0.19 records no rank id inside a rank file: the data-parallel rank is in the file name only
(`zero_pp_rank_{D}_...`), and `partition_count` and `zero_stage` are the same in every rank's file. A rank
file replaced by a copy of (or a link to) another rank's, or two rank files swapped, still parse, and a
converter that trusted the names would join the wrong partitions. What a checkpoint does record, and is
checked here before any plan is made from it:

* every rank file is a file of its own (not a link to another rank's) with bytes of its own (not a copy:
  the zip directory's CRC-32s of every entry, so nothing is read);
* ZeRO-1/2 (and the bf16 optimizer): where each rank's partition sits in the param group's flat buffer.
  DeepSpeed flattens a group, pads it to a multiple of the data-parallel degree and cuts it into equal
  partitions, so rank r's file must hold a partition of the common size with the padding that rank r's
  partition has (`group_paddings`), and a parameter split between ranks must end its piece at the end of
  one partition and go on at the start of the next (`param_slice_mappings`), every element once;
* ZeRO-1/2: the module weights beside the fp32 masters. `mp_rank_{MM}_model_states.pt` holds the model's
  full (bf16, fp16 or fp32) weights, which are the masters cast to the model's dtype, so the first and last
  element of every piece of a split parameter must match the module at the piece's place (a few element
  reads per rank). This tells apart ranks whose slice mappings are alike (a parameter spanning whole
  partitions).

What cannot be told apart is listed in docs/RELIABILITY.md ("Rank files that lie").
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ucp.converters.torch_zip import LazyTensor, archive_digest, read_array
from ucp.errors import CorruptCheckpointError
from ucp.format.dtypes import FLOATS, cast

FIX = ("a rank file was replaced by another rank's (copied, linked or swapped) or comes from another run; copy "
       "every rank's own file of this save from the training job")


@dataclass
class GroupPartition:
    """What one rank file records of its partition of one param group."""

    stored: int  # elements of the flat fp32 partition in the file
    padding: int | None  # `group_paddings`: elements of this rank's partition past the group's end (None: unrecorded)
    strips_padding: bool  # ZeRO-1/2 store the partition without its padding; the bf16 optimizer keeps it
    alignment: int = 0  # `param_alignment_paddings`: elements between parameters inside the flat buffer
    pieces: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (start in the partition, numel)

    @property
    def size(self) -> int | None:
        """The partition's elements, padding included (None where the padding is not recorded)."""
        if not self.strips_padding:
            return self.stored
        return None if self.padding is None else self.stored + self.padding


def check_distinct(paths: Sequence[Path], compare_bytes: bool = True) -> None:
    """Refuse two rank files that are one file (a link or a hard link) or, with `compare_bytes`, hold the same
    bytes (a copy), judged from the zip directories' CRC-32s and sizes of every entry."""
    seen: dict[tuple[int, int], Path] = {}
    digests: dict[tuple, Path] = {}
    for path in paths:
        st = os.stat(path)
        first = seen.setdefault((st.st_dev, st.st_ino), path)
        if first != path:
            raise CorruptCheckpointError(f"{path}: is the same file as {first.name} (a link), but each rank writes "
                                         f"its own; {FIX}")
        digest = archive_digest(path) if compare_bytes else None
        if digest is not None:
            first = digests.setdefault(digest, path)
            if first != path:
                raise CorruptCheckpointError(f"{path}: holds the same bytes as {first.name}, but ranks hold "
                                             f"different partitions; {FIX}")


def check_partition_layout(paths: Sequence[Path], groups: Sequence[Sequence[GroupPartition]],
                           shapes: Sequence[dict[str, tuple[int, ...]]], skip: AbstractSet[int] = frozenset()) -> None:
    """Refuse rank files (`paths`, in rank order) whose partitions are not where their ranks' lie in the flat
    buffers: `groups[r][g]` is rank r's partition of param group g, whose parameters have `shapes[g]` (the
    model file's `param_shapes`). Groups in `skip` (MoE expert groups, partitioned over a smaller group of
    ranks) are not checked."""
    for g, group in enumerate(shapes):
        if g in skip or any(g >= len(rank) for rank in groups):
            continue
        parts = [rank[g] for rank in groups]
        numels = {name: math.prod(int(d) for d in shape) for name, shape in group.items()}
        _check_sizes(paths, parts, g, sum(numels.values()))
        _check_pieces(paths, parts, g, numels)


def _check_sizes(paths: Sequence[Path], parts: list[GroupPartition], g: int, numel: int) -> None:
    sizes = [p.size for p in parts if p.size is not None]
    if len(sizes) < len(parts):
        return
    size, dp = sizes[0], len(parts)
    for path, part, found in zip(paths, parts, sizes):
        if found != size:
            raise CorruptCheckpointError(f"{path}: holds a partition of {found} elements of param group {g}, "
                                         f"{paths[0].name} one of {size}, but DeepSpeed cuts a group into equal "
                                         f"partitions; {FIX}")
    padded = numel + parts[0].alignment
    for r, (path, part) in enumerate(zip(paths, parts)):
        spread = max(0, min((r + 1) * size, dp * size) - max(r * size, padded))  # padding inside rank r's partition
        last_only = dp * size - padded if r == dp - 1 else 0  # older DeepSpeed and the bf16 optimizer: all on the last
        if part.padding not in (spread, last_only):
            raise CorruptCheckpointError(f"{path}: records {part.padding} elements of padding in param group {g}, "
                                         f"but rank {r}'s partition of a group of {padded} elements on {dp} ranks "
                                         f"holds {spread}; {FIX}")


def _check_pieces(paths: Sequence[Path], parts: list[GroupPartition], g: int, numels: dict[str, int]) -> None:
    held: dict[str, list[tuple[int, int, int]]] = {}  # name -> (rank, start, numel), in rank order
    for r, (path, part) in enumerate(zip(paths, parts)):
        spans = sorted((start, start + n, name) for name, (start, n) in part.pieces.items())
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
            if begin < end:
                raise CorruptCheckpointError(f"{path}: '{first}' and '{second}' overlap in its partition of param "
                                             f"group {g}; {FIX}")
        if spans and (spans[0][0] < 0 or spans[-1][1] > part.stored):
            raise CorruptCheckpointError(f"{path}: places a parameter outside its partition of param group {g} "
                                         f"({part.stored} elements); {FIX}")
        for name, (start, n) in part.pieces.items():
            held.setdefault(name, []).append((r, start, n))
    for name, pieces in held.items():
        if sum(n for *_, n in pieces) != numels.get(name, -1):
            raise CorruptCheckpointError(f"{paths[pieces[0][0]]}: the rank files of param group {g} hold "
                                         f"{sum(n for *_, n in pieces)} elements of '{name}', which has "
                                         f"{numels.get(name)}; {FIX}")
        for (r, start, n), (following, begin, _) in zip(pieces, pieces[1:]):
            if following != r + 1 or start + n != parts[r].stored or begin != 0:
                raise CorruptCheckpointError(
                    f"{paths[following]}: holds a piece of '{name}' at element {begin} of its partition, after the "
                    f"piece the file of rank {r} holds at [{start}, {start + n}) of {parts[r].stored}, but a "
                    f"parameter goes on from the end of one rank's partition to the start of the next; {FIX}")


def check_masters_match_module(paths: Sequence[Path], masters: Sequence[Sequence[LazyTensor]],
                               groups: Sequence[Sequence[GroupPartition]], module: dict, model_path: Path,
                               skip: AbstractSet[int] = frozenset()) -> None:
    """ZeRO-1/2: the first and last element of every piece of a parameter split between ranks, in the fp32
    partitions `masters[r][g]` of the rank files `paths`, cast to the model's dtype, must be the module's
    weights at that place. Parameters the module does not hold whole (pipeline stages keep theirs in layer
    files, ZeRO-3 placeholders) are not checked."""
    pieces: dict[str, list[tuple[int, int, int, int]]] = {}  # name -> (rank, group, start, numel), rank order
    for r, rank in enumerate(groups):
        for g, part in enumerate(rank):
            if g not in skip:
                for name, (start, n) in part.pieces.items():
                    pieces.setdefault(name, []).append((r, g, start, n))
    for name, held in pieces.items():
        weight = module.get(name)
        numel = sum(n for *_, n in held)
        if (len(held) < 2 or not isinstance(weight, LazyTensor) or weight.numel != numel
                or not weight.is_contiguous() or str(weight.dtype) not in FLOATS):
            continue
        offset = 0
        for r, g, start, n in held:
            for element in {0, n - 1} if n else ():
                master = read_array(masters[r][g], start + element, 1)
                if np.isnan(master).any():
                    continue  # a NaN master says nothing about its place
                found = read_array(weight, offset + element, 1)
                if not np.array_equal(cast(master, "float32", str(weight.dtype)), found):
                    raise CorruptCheckpointError(
                        f"{paths[r]}: its fp32 master of '{name}' at element {offset + element} does not match the "
                        f"module weight {model_path.name} holds there (cast to {weight.dtype}), though the module "
                        f"holds the masters as trained; {FIX}")
            offset += n
