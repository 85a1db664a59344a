"""What a Megatron-DeepSpeed checkpoint declares about its tensor-parallel layout, as recognizer hints.

Megatron-DeepSpeed writes `universal_checkpoint_info` with regex lists (DeepSpeed's
`checkpoint/constants.py` names the keys) instead of an affine map:

* `tp_replicated_parameter_patterns`          every TP rank holds the whole tensor → Replicate
* `parameter_to_average_patterns`             copies that drift apart; their mean is the value → Partial
* `parameter_with_row_parallelism_patterns`   split along dim 1 → Shard-H
* `parameter_with_2_sub_params_cat_dim_0`     fused pair (SwiGLU gate/up): each rank holds its half of
                                              either, one after the other → Shard-NC, equal halves
* `parameter_with_sub_params`                 fused sub-parameters (QKV) as a `SubparamShape` (their sizes
                                              along `partition_dim`), with the width each rank holds of
                                              each in `sub_param_shard_widths` (version 0.4) → Shard-NC
* `vocabulary_parameter_patterns`             split along dim 0 and padded to `padded_vocab_size`; the
                                              full tensor has `original_vocab_size` rows → Shard-V + StripPad

A trainable parameter in none of the lists is split along dim 0 (Shard-V): that is what the lists
mean, the convention both DeepSpeed's converter and Megatron-DeepSpeed's loader follow. The lists
say nothing of buffers and frozen parameters they do not name; those are left to their shards. A parameter that two
lists claim, or whose declaration does not fit its shards, is refused by name: DeepSpeed's converter
would silently take the first list in its own order.
"""
from __future__ import annotations

import re
from collections.abc import Callable

from ucp.converters.deepspeed.declared import affine_params, declared_layout
from ucp.errors import AmbiguousPatternError, CorruptCheckpointError
from ucp.patterns import Hints, Pattern

REPLICATED = "tp_replicated_parameter_patterns"
TO_AVERAGE = "parameter_to_average_patterns"
ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
TWO_SUB_PARAMS = "parameter_with_2_sub_params_cat_dim_0"
SUB_PARAMS = "parameter_with_sub_params"
SUB_PARAM_WIDTHS = "sub_param_shard_widths"
VOCABULARY = "vocabulary_parameter_patterns"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"
_LISTS = (REPLICATED, TO_AVERAGE, ROW_PARALLEL, TWO_SUB_PARAMS, SUB_PARAMS, VOCABULARY)

Shape = tuple[int, ...]
Declared = Callable[[str, list[Shape]], "tuple[Shape, Hints] | None"]


def checkpoint_layouts(uc_info: dict | None, source: str, trainable: set[str]) -> Declared:
    """What `uc_info` declares per parameter, in the order DeepSpeed's `ds_to_universal` reads it: the
    parameter's `affine_map` entry (AutoTP of DeepSpeed 0.19), else the pattern lists (Megatron-DeepSpeed,
    and AutoTP of DeepSpeed versions without affine maps), else nothing (None: left to the shards)."""
    entries = affine_params(uc_info, source)
    lists = uc_info if declares_lists(uc_info) else None

    def declared(name: str, shapes: list[Shape]) -> tuple[Shape, Hints] | None:
        mapped = declared_layout(name, entries)
        if mapped is not None or lists is None:
            return mapped
        return list_layout(name, shapes, lists, name in trainable)

    return declared


def declares_lists(uc_info: dict | None) -> bool:
    """Whether `uc_info` declares the layout by pattern lists (Megatron-DeepSpeed style)."""
    return any(key in (uc_info or {}) for key in _LISTS)


def list_layout(name: str, shapes: list[Shape], uc_info: dict, trainable: bool = True) -> tuple[Shape, Hints] | None:
    """The full shape and hints that `uc_info`'s lists declare for `name`, whose TP shards have `shapes`;
    None for a buffer or frozen parameter (`trainable` False) that no list names."""
    fix = (f"correct the model's universal_checkpoint_info, or pass --pattern '{name}=<pattern>' to say how its "
           "TP shards join")
    claims = [key for key in (REPLICATED, TO_AVERAGE, ROW_PARALLEL, TWO_SUB_PARAMS) if _matches(uc_info.get(key), name)]
    sub_params = _sub_params(name, uc_info)
    claims += [SUB_PARAMS] if sub_params is not None else []
    vocabulary = _matches(uc_info.get(VOCABULARY), name)
    if len(claims) > 1 or (vocabulary and claims):
        listed = ", ".join(claims + [VOCABULARY] * vocabulary)
        raise AmbiguousPatternError(f"{name}: universal_checkpoint_info lists it under {listed}, which contradict "
                                    f"each other; {fix}")
    kind = claims[0] if claims else None
    if kind in (REPLICATED, TO_AVERAGE):
        if len(set(shapes)) > 1:
            raise AmbiguousPatternError(f"{name}: declared in {kind} but its TP shards have shapes {shapes}; {fix}")
        return shapes[0], Hints(pattern=Pattern.REPLICATE if kind == REPLICATED else Pattern.PARTIAL)
    if kind == ROW_PARALLEL:
        return _joined(name, shapes, 1, fix), Hints(pattern=Pattern.SHARD_H)
    if kind == TWO_SUB_PARAMS:
        if any(len(s) == 0 or s[0] % 2 for s in shapes):
            raise AmbiguousPatternError(f"{name}: declared in {kind} but its TP shards {shapes} do not halve along "
                                        f"dim 0; {fix}")
        halves = tuple(s[0] // 2 for s in shapes)
        return _joined(name, shapes, 0, fix), Hints(pattern=Pattern.SHARD_NC, dim=0, sub_widths=(halves, halves))
    if kind == SUB_PARAMS and sub_params is not None:
        pattern, entry = sub_params
        return _fused(name, shapes, pattern, entry, uc_info, fix)
    if not vocabulary and not trainable:
        return None
    full = _joined(name, shapes, 0, fix)
    if not vocabulary:
        return full, Hints(pattern=Pattern.SHARD_V)
    if ORIGINAL_VOCAB_SIZE not in uc_info:
        raise CorruptCheckpointError(f"{name}: declared in {VOCABULARY} but universal_checkpoint_info records no "
                                     f"{ORIGINAL_VOCAB_SIZE}, so its padding cannot be told from its rows; {fix}")
    rows = int(uc_info[ORIGINAL_VOCAB_SIZE])
    if rows > full[0]:
        raise CorruptCheckpointError(f"{name}: {ORIGINAL_VOCAB_SIZE} is {rows} but its TP shards hold only "
                                     f"{full[0]} rows")
    return (rows, *full[1:]), Hints(pattern=Pattern.SHARD_V, padded_dim_size=full[0] if full[0] > rows else None)


def _matches(patterns, name: str) -> bool:
    # re.match, as DeepSpeed's converter applies these lists: anchored at the start only.
    return any(re.match(p, name) for p in patterns or [])


def _sub_params(name: str, uc_info: dict) -> tuple[str, dict] | None:
    """(matching pattern, SubparamShape as a dict) of `name` in `parameter_with_sub_params`, or None."""
    for entry in uc_info.get(SUB_PARAMS) or []:
        entry = entry if isinstance(entry, dict) else vars(entry)
        for pattern in entry.get("patterns") or []:
            if re.match(pattern, name):
                return pattern, entry
    return None


def _joined(name: str, shapes: list[Shape], dim: int, fix: str) -> Shape:
    """The full shape of shards `shapes` concatenated along `dim`."""
    first = shapes[0]
    if any(len(s) <= dim or len(s) != len(first) or s[:dim] + s[dim + 1:] != first[:dim] + first[dim + 1:]
           for s in shapes):
        raise AmbiguousPatternError(f"{name}: its TP shards of shapes {shapes} do not join along dim {dim} as "
                                    f"declared; {fix}")
    return (*first[:dim], sum(s[dim] for s in shapes), *first[dim + 1:])


def _fused(name: str, shapes: list[Shape], pattern: str, entry: dict, uc_info: dict, fix: str) -> tuple[Shape, Hints]:
    """Shard-NC of a `SubparamShape`: its sizes along `partition_dim`, each rank's width of each."""
    dim, declared = int(entry["partition_dim"]), entry["shape"][int(entry["partition_dim"])]
    full = _joined(name, shapes, dim, fix)
    tp = len(shapes)
    if isinstance(declared, (list, tuple)):
        sizes = [int(s) for s in declared]
    else:  # before version 0.4: the number of equal sub-parameters
        if int(declared) <= 0 or full[dim] % int(declared):
            raise AmbiguousPatternError(f"{name}: declares {declared} equal sub-parameters along dim {dim}, which do "
                                        f"not divide its {full[dim]} entries; {fix}")
        sizes = [full[dim] // int(declared)] * int(declared)
    recorded = (uc_info.get(SUB_PARAM_WIDTHS) or {}).get(pattern)
    if recorded is not None:
        widths = tuple(tuple(int(w) for w in per_rank) for per_rank in recorded)
    elif all(size % tp == 0 for size in sizes):
        widths = tuple((size // tp,) * tp for size in sizes)
    else:
        raise AmbiguousPatternError(f"{name}: its sub-parameters of sizes {sizes} do not split evenly over {tp} TP "
                                    f"ranks and universal_checkpoint_info records no {SUB_PARAM_WIDTHS} for it; {fix}")
    held = [sum(w[r] for w in widths) for r in range(tp)]
    if (len(widths) != len(sizes) or any(len(w) != tp or sum(w) != size for w, size in zip(widths, sizes))
            or held != [s[dim] for s in shapes]):
        raise CorruptCheckpointError(f"{name}: its declared sub-parameter widths {[list(w) for w in widths]} (sizes "
                                     f"{sizes}) do not fit its TP shards {shapes} along dim {dim}")
    return full, Hints(pattern=Pattern.SHARD_NC, dim=dim, sub_widths=widths)
