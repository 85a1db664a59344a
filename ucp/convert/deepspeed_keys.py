"""The keys beside `param` in a `zero/<name>/<state>.pt` of DeepSpeed's universal layout, decided as
`ds_to_universal` (DeepSpeed 0.19, `merge_tp_slices`) decides them.

`ds_to_universal` reads the source's `universal_checkpoint_info` per parameter: a parameter its
`affine_map` describes gets no key (the loader takes the geometry from the live parameter's own
AutoTP metadata); otherwise the pattern lists decide — replicated and averaged parameters no key,
a fused pair `cat_dim` 0 with `param_n_sub_params` 2, fused sub-parameters `sub_param_shape`,
anything else `cat_dim` (1 when row-parallel, else 0) — and a vocabulary parameter adds
`vocab_tensor`. A source without `universal_checkpoint_info` (which `ds_to_universal` converts
with an injected empty one) is described by the split ucp recognized (`spec_keys`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ucp.converters.deepspeed.lists import REPLICATED, ROW_PARALLEL, SUB_PARAMS, TO_AVERAGE, TWO_SUB_PARAMS, VOCABULARY
from ucp.converters.torch_zip import Opaque
from ucp.patterns import Pattern, PatternSpec

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"


@dataclass(frozen=True)
class DeclaredPatterns:
    """The name patterns of a source's `universal_checkpoint_info`, by what they declare (plain, picklable)."""

    affine: tuple[str, ...] = ()
    replicated: tuple[str, ...] = ()
    averaged: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    two_sub_params: tuple[str, ...] = ()
    sub_params: tuple[str, ...] = ()
    vocabulary: tuple[str, ...] = ()


def declared_patterns(uc_info: object) -> DeclaredPatterns | None:
    """The patterns of a model-states file's `universal_checkpoint_info` (None where it records none)."""
    if not isinstance(uc_info, dict):
        return None

    def strings(key: str) -> tuple[str, ...]:
        value = uc_info.get(key)
        return tuple(p for p in value if isinstance(p, str)) if isinstance(value, (list, tuple)) else ()

    sub_params = []
    for entry in uc_info.get(SUB_PARAMS) or []:
        fields = entry.state if isinstance(entry, Opaque) else entry  # a pickled SubparamShape, or its dict
        patterns = fields.get("patterns") if isinstance(fields, dict) else None
        sub_params += [p for p in patterns or [] if isinstance(p, str)]
    amap = uc_info.get("affine_map")
    params = amap.get("params") if isinstance(amap, dict) else None
    return DeclaredPatterns(tuple(params) if isinstance(params, dict) else (), strings(REPLICATED),
                            strings(TO_AVERAGE), strings(ROW_PARALLEL), strings(TWO_SUB_PARAMS), tuple(sub_params),
                            strings(VOCABULARY))


def universal_keys(name: str, declared: DeclaredPatterns | None, spec: PatternSpec) -> dict:
    """The keys `ds_to_universal` writes beside `param` for trainable parameter `name` (see the module doc)."""
    if declared is None:
        return spec_keys(spec)

    def listed(patterns: tuple[str, ...]) -> bool:
        return any(re.match(p, name) for p in patterns)  # re.match, as ds_to_universal applies them

    keys: dict = {}
    if listed(declared.affine) or listed(declared.replicated) or listed(declared.averaged):
        pass
    elif listed(declared.two_sub_params):
        keys = {"cat_dim": 0, "param_n_sub_params": 2}
    elif listed(declared.sub_params) and spec.sub_widths is not None and spec.dim is not None:
        keys = {"sub_param_shape": sub_param_shape(spec.shape, spec.dim, spec.sub_widths)}
    else:
        keys = {"cat_dim": 1 if listed(declared.row) else 0}
    if listed(declared.vocabulary):
        keys["vocab_tensor"] = True
    return keys


def spec_keys(spec: PatternSpec) -> dict:
    """The keys with which a full tensor's recognized split tells stock `load_universal` how to cut it for a
    TP rank: `cat_dim` (the split dim), `vocab_tensor` (padding to restore), and for fused parameters
    `param_n_sub_params` (two equal halves) or `sub_param_shape` (sub-parameter sizes along a dim)."""
    keys: dict = {"cat_dim": 0}
    if spec.flat or spec.dim is None:
        return keys
    keys["cat_dim"] = spec.dim
    if spec.pattern is Pattern.SHARD_NC and spec.sub_widths is not None:  # recognize gives shard_nc its widths
        sizes = tuple(sum(w) for w in spec.sub_widths)
        if len(sizes) == 2 and sizes[0] == sizes[1]:
            keys["param_n_sub_params"] = 2
        else:
            keys["sub_param_shape"] = sub_param_shape(spec.shape, spec.dim, spec.sub_widths)
    elif spec.padded_size is not None and spec.dim == 0:
        keys["vocab_tensor"] = True
    return keys


def sub_param_shape(shape: tuple[int, ...], dim: int, sub_widths: tuple[tuple[int, ...], ...]) -> object:
    """DeepSpeed's `SubparamShape` of fused sub-parameters: their sizes along `dim` (no patterns: the loader
    reads the shape and dim only)."""
    from deepspeed.checkpoint.universal_checkpoint import SubparamShape

    sizes = tuple(sum(w) for w in sub_widths)
    return SubparamShape(patterns=[], shape=tuple(sizes if d == dim else s for d, s in enumerate(shape)),
                         partition_dim=dim)
