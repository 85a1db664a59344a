"""The keys `--format deepspeed` writes beside `param`, decided from `universal_checkpoint_info` as
`ds_to_universal` (DeepSpeed 0.19, `merge_tp_slices`) decides them; checked against its output in
tests/integration/test_format_deepspeed.py."""
from __future__ import annotations

import pytest

from ucp.convert.deepspeed_keys import declared_patterns, spec_keys, universal_keys
from ucp.converters.torch_zip import Opaque
from ucp.patterns import Pattern, PatternSpec


def pickled_subparam_shape(fields: dict) -> Opaque:
    """A SubparamShape as the allow-list reader gives it: an inert record of its pickled fields."""
    record = Opaque()
    record.__setstate__(fields)
    return record


COLUMN = PatternSpec(Pattern.SHARD_V, (8, 4), dim=0)
ROW = PatternSpec(Pattern.SHARD_H, (4, 8), dim=1)
FUSED = PatternSpec(Pattern.SHARD_NC, (12, 4), dim=0, sub_widths=((2, 2), (2, 2), (4, 4)))
INFO = {
    "affine_map": {"version": 1, "params": {r"^mapped$": {}}},
    "tp_replicated_parameter_patterns": [r"^norm$"],
    "parameter_to_average_patterns": [r"^scale$"],
    "parameter_with_row_parallelism_patterns": [r"^row$"],
    "parameter_with_2_sub_params_cat_dim_0": [r"^pair$"],
    "parameter_with_sub_params": [pickled_subparam_shape({"patterns": [r"^qkv$"], "shape": ((4, 4, 4), 4),
                                                          "partition_dim": 0})],
    "vocabulary_parameter_patterns": [r"^embed$", r"^mapped$"],
    "original_vocab_size": 8,
}


@pytest.mark.parametrize("name, spec, keys", [
    ("mapped", COLUMN, {"vocab_tensor": True}),  # an affine map entry: no category key, the vocabulary one stays
    ("norm", COLUMN, {}),
    ("scale", COLUMN, {}),
    ("row", ROW, {"cat_dim": 1}),
    ("column", COLUMN, {"cat_dim": 0}),  # in no list: column-parallel
    ("pair", COLUMN, {"cat_dim": 0, "param_n_sub_params": 2}),
    ("embed", COLUMN, {"cat_dim": 0, "vocab_tensor": True}),
])
def test_keys_follow_the_declared_lists(name, spec, keys):
    assert universal_keys(name, declared_patterns(INFO), spec) == keys


def test_fused_sub_parameters_get_their_shape_only():
    keys = universal_keys("qkv", declared_patterns(INFO), FUSED)
    assert list(keys) == ["sub_param_shape"]
    assert (keys["sub_param_shape"].shape, keys["sub_param_shape"].partition_dim) == (((4, 4, 8), 4), 0)


def test_without_universal_checkpoint_info_the_recognized_split_decides():
    assert declared_patterns(None) is None
    assert universal_keys("row", None, ROW) == spec_keys(ROW) == {"cat_dim": 1}
    assert universal_keys("x", None, PatternSpec(Pattern.REPLICATE, (4,))) == {"cat_dim": 0}
    # Negative control: the same parameter, declared row-parallel, is told apart from an undeclared one.
    assert universal_keys("row", declared_patterns({}), ROW) == {"cat_dim": 0}
