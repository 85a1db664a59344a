"""The recognizer: which PatternSpec fragment metadata (shapes, flat offsets, ranks) implies, and the
AmbiguousPatternError it raises, naming the parameter, when the metadata cannot decide."""
from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucp.errors import AmbiguousPatternError, UcpError
from ucp.patterns import FragmentInfo, Hints, OuterPiece, Pattern, PatternSpec, recognize, recognize_nested

SETTINGS = settings(max_examples=80, deadline=None)

NAME = "model.layers.3.mlp.dense_h_to_4h.weight"
dims = st.integers(1, 7)
shapes = st.lists(dims, min_size=1, max_size=3).map(tuple)


def ambiguous(*match: str):
    """pytest.raises for AmbiguousPatternError whose message starts with the parameter's name."""
    return pytest.raises(AmbiguousPatternError, match=r"^" + r".*".join(
        [NAME.replace(".", r"\.")] + list(match)))


def flat_frags(numel: int, n: int):
    chunk = -(-numel // n)
    return [FragmentInfo(r, (chunk,), offset=r * chunk) for r in range(n)], chunk


# ----------------------------------------------------------------------------- properties

@SETTINGS
@given(shape=shapes, n=st.integers(1, 5), rnd=st.randoms(use_true_random=False))
def test_flat_partitions_any_input_order(shape, n, rnd):
    frags, chunk = flat_frags(math.prod(shape), n)
    rnd.shuffle(frags)
    spec = recognize(NAME, shape, frags)
    assert spec == PatternSpec(Pattern.UNIQUE if n == 1 else Pattern.SHARD_V, shape, flat=True,
                               padded_size=chunk * n)
    assert spec.numel == math.prod(shape)


@SETTINGS
@given(shape=shapes, n=st.integers(2, 5), data=st.data())
def test_flat_gap_overlap_or_missing_always_raises(shape, n, data):
    numel = math.prod(shape)
    frags, chunk = flat_frags(numel, n)
    kind = data.draw(st.sampled_from(["gap", "overlap", "drop"]))
    r = data.draw(st.integers(1, n - 1))
    if kind == "drop":
        if r * chunk >= numel:  # dropping a rank that holds only padding loses nothing
            return
        frags = frags[:r] + frags[r + 1:]
    else:
        shift = data.draw(st.integers(1, 3)) * (1 if kind == "gap" else -1)
        if kind == "overlap" and chunk + shift < 0:
            return
        frags = [FragmentInfo(f.rank, f.shape, f.offset + (shift if f.rank >= r else 0)) for f in frags]
        if all(f.offset == 0 and f.numel == numel for f in frags):
            return  # every rank holds all of it at offset 0: that is a replica, correctly
    with ambiguous():
        recognize(NAME, shape, frags)


@SETTINGS
@given(data=st.data())
def test_dim_shards_recognized_from_shapes(data):
    ndim = data.draw(st.integers(1, 3))
    dim = data.draw(st.integers(0, ndim - 1))
    widths = data.draw(st.lists(st.integers(1, 4), min_size=2, max_size=5))
    shape = [data.draw(dims) for _ in range(ndim)]
    shape[dim] = sum(widths)
    frags = []
    for r, w in enumerate(widths):
        s = list(shape)
        s[dim] = w
        frags.append(FragmentInfo(r, tuple(s)))
    if dim >= 2:
        with ambiguous("dim 2"):
            recognize(NAME, shape, frags)
        return
    spec = recognize(NAME, shape, frags)
    assert spec == PatternSpec(Pattern.SHARD_V if dim == 0 else Pattern.SHARD_H, tuple(shape), dim=dim)
    # one rank missing: coverage is short, never silently accepted
    drop = data.draw(st.integers(0, len(widths) - 1))
    with ambiguous():
        recognize(NAME, shape, frags[:drop] + frags[drop + 1:])
    # one piece too wide: overlap, never silently accepted
    grown = list(frags[drop].shape)
    grown[dim] += 1
    with ambiguous():
        recognize(NAME, shape, frags[:drop] + [FragmentInfo(drop, tuple(grown))] + frags[drop + 1:])


@SETTINGS
@given(shape=shapes, n=st.integers(1, 5))
def test_identical_shapes_are_replicas_or_unique(shape, n):
    spec = recognize(NAME, shape, [FragmentInfo(r, shape) for r in range(n)])
    assert spec == PatternSpec(Pattern.UNIQUE if n == 1 else Pattern.REPLICATE, shape)
    partial = recognize(NAME, shape, [FragmentInfo(r, shape) for r in range(n)], Hints(pattern=Pattern.PARTIAL))
    assert partial == PatternSpec(Pattern.PARTIAL, shape)


# ----------------------------------------------------------------------------- decided cases

def test_flat_replicas():
    frags = [FragmentInfo(r, (12,), offset=0) for r in range(3)]
    assert recognize(NAME, (3, 4), frags) == PatternSpec(Pattern.REPLICATE, (3, 4), flat=True)


def test_single_flat_fragment_with_padding_is_unique():
    spec = recognize(NAME, (2, 5), [FragmentInfo(0, (16,), offset=0)])
    assert spec == PatternSpec(Pattern.UNIQUE, (2, 5), flat=True, padded_size=16)


def test_zero12_fragments_of_a_param_in_the_middle_of_a_group():
    # a 10-element param that starts 3 elements before rank 1's partition ends (partition = 8):
    # rank 1 holds its first 3 elements, rank 2 the other 7; rank 0 holds none of it
    frags = [FragmentInfo(1, (3,), offset=0), FragmentInfo(2, (7,), offset=3)]
    assert recognize(NAME, (2, 5), frags) == PatternSpec(Pattern.SHARD_V, (2, 5), flat=True, padded_size=10)


def test_vocab_padding_needs_and_accepts_the_hint():
    frags = [FragmentInfo(0, (8, 4)), FragmentInfo(1, (8, 4))]
    with ambiguous("do not determine"):
        recognize(NAME, (13, 4), frags)
    spec = recognize(NAME, (13, 4), frags, Hints(pattern=Pattern.SHARD_V, padded_dim_size=16))
    assert spec == PatternSpec(Pattern.SHARD_V, (13, 4), dim=0, padded_size=16)
    with ambiguous("sum to 16"):
        recognize(NAME, (13, 4), frags, Hints(pattern=Pattern.SHARD_V))
    with ambiguous("sum to 16"):
        recognize(NAME, (13, 4), frags, Hints(pattern=Pattern.SHARD_V, padded_dim_size=15))
    with ambiguous("sum to 16 along dim 0, not 17"):
        recognize(NAME, (17, 4), frags, Hints(pattern=Pattern.SHARD_V, padded_dim_size=16))


def test_shard_h_hint():
    frags = [FragmentInfo(0, (4, 3)), FragmentInfo(1, (4, 2))]
    assert recognize(NAME, (4, 5), frags, Hints(pattern=Pattern.SHARD_H)) == \
        PatternSpec(Pattern.SHARD_H, (4, 5), dim=1)
    with ambiguous("shard_v", "sum to 8"):
        recognize(NAME, (4, 5), frags, Hints(pattern=Pattern.SHARD_V))  # wrong dim declared


def test_shard_nc_hint():
    widths = ((4, 4), (1, 1), (1, 1))  # fused QKV, GQA: q wider than k and v on every rank
    frags = [FragmentInfo(0, (6, 8)), FragmentInfo(1, (6, 8))]
    # the shapes alone read as a plain Shard-V, which would interleave q/k/v wrongly: a hint is needed
    assert recognize(NAME, (12, 8), frags).pattern is Pattern.SHARD_V
    spec = recognize(NAME, (12, 8), frags, Hints(pattern=Pattern.SHARD_NC, dim=0, sub_widths=widths))
    assert spec == PatternSpec(Pattern.SHARD_NC, (12, 8), dim=0, sub_widths=widths)
    assert spec.to_json() == {"pattern": "shard_nc", "dim": 0, "sub_widths": [[4, 4], [1, 1], [1, 1]]}
    with ambiguous("shard_nc needs"):
        recognize(NAME, (12, 8), frags, Hints(pattern=Pattern.SHARD_NC, dim=0))
    with ambiguous("shard_nc needs"):
        recognize(NAME, (12, 8), frags, Hints(pattern=Pattern.SHARD_NC, sub_widths=widths))
    with ambiguous("widths", "do not fill its pieces"):  # rank 0 holds 6 rows, these widths 5
        recognize(NAME, (12, 8), frags, Hints(pattern=Pattern.SHARD_NC, dim=0, sub_widths=((3, 5), (1, 1), (1, 1))))


def test_hints_without_pattern_fall_back_to_shapes():
    frags = [FragmentInfo(0, (2, 3)), FragmentInfo(1, (2, 3))]
    assert recognize(NAME, (4, 3), frags, Hints()) == PatternSpec(Pattern.SHARD_V, (4, 3), dim=0)


def test_to_json():
    spec = PatternSpec(Pattern.SHARD_HY, (4, 6), dim=1, shard_shapes=((4, 3), (4, 3)),
                       inner=PatternSpec(Pattern.SHARD_V, (4, 3), flat=True, padded_size=12))
    assert spec.to_json() == {"pattern": "shard_hy", "dim": 1, "inner": {
        "pattern": "shard_v", "flat": True, "padded_size": 12}}
    assert PatternSpec(Pattern.UNIQUE, (2,)).to_json() == {"pattern": "unique"}


# ----------------------------------------------------------------------------- errors name the parameter

def test_error_is_a_ucp_error():
    assert issubclass(AmbiguousPatternError, UcpError)


def test_no_fragments():
    with ambiguous("no rank holds"):
        recognize(NAME, (4,), [])


def test_flat_gap():
    frags = [FragmentInfo(0, (4,), offset=0), FragmentInfo(1, (4,), offset=5)]
    with ambiguous("gap or overlap at element 4", "rank 1 starts at 5"):
        recognize(NAME, (8,), frags)


def test_flat_overlap():
    frags = [FragmentInfo(0, (4,), offset=0), FragmentInfo(1, (4,), offset=3)]
    with ambiguous("gap or overlap at element 4", "rank 1 starts at 3"):
        recognize(NAME, (7,), frags)


def test_flat_missing_first_rank():
    with ambiguous("gap or overlap at element 0"):
        recognize(NAME, (8,), [FragmentInfo(1, (4,), offset=4)])


def test_flat_missing_middle_rank():
    frags = [FragmentInfo(0, (3,), offset=0), FragmentInfo(2, (3,), offset=6)]
    with ambiguous("gap"):
        recognize(NAME, (9,), frags)


def test_flat_missing_coverage():
    frags = [FragmentInfo(0, (4,), offset=0), FragmentInfo(1, (4,), offset=4)]
    with ambiguous("cover 8 of 10 elements"):
        recognize(NAME, (2, 5), frags)


def test_flat_ranks_out_of_order():
    frags = [FragmentInfo(0, (4,), offset=4), FragmentInfo(1, (4,), offset=0)]
    with ambiguous("not in rank order"):
        recognize(NAME, (8,), frags)


def test_mixed_flat_and_shaped():
    with ambiguous("mixes flat and shaped", "--pattern"):
        recognize(NAME, (8,), [FragmentInfo(0, (4,), offset=0), FragmentInfo(1, (4,))])


def test_single_fragment_of_the_wrong_shape():
    with ambiguous(r"only fragment has shape \(4, 3\)", r"\(4, 6\)"):
        recognize(NAME, (4, 6), [FragmentInfo(0, (4, 3))])


def test_undecidable_shapes():
    with ambiguous("do not determine"):  # pieces disagree on the other dim
        recognize(NAME, (4, 6), [FragmentInfo(0, (2, 6)), FragmentInfo(1, (2, 3))])
    with ambiguous("do not determine"):  # rank-count mismatch (1-D pieces of a 2-D parameter)
        recognize(NAME, (4, 6), [FragmentInfo(0, (12,)), FragmentInfo(1, (12,))])
    with ambiguous("do not determine"):  # shaped pieces that cover too much, no padding hint
        recognize(NAME, (4, 6), [FragmentInfo(0, (3, 6)), FragmentInfo(1, (3, 6))])
    with ambiguous("do not determine"):  # missing coverage
        recognize(NAME, (4, 6), [FragmentInfo(0, (2, 6)), FragmentInfo(1, (1, 6))])


def test_split_along_dim_2_needs_a_declaration():
    frags = [FragmentInfo(0, (2, 3, 1)), FragmentInfo(1, (2, 3, 3))]
    with ambiguous("split along dim 2", "universal_checkpoint_info"):
        recognize(NAME, (2, 3, 4), frags)
    # a single-sub-parameter Shard-NC hint is how such a split is declared
    spec = recognize(NAME, (2, 3, 4), frags, Hints(pattern=Pattern.SHARD_NC, dim=2, sub_widths=((1, 3),)))
    assert spec == PatternSpec(Pattern.SHARD_NC, (2, 3, 4), dim=2, sub_widths=((1, 3),))


def test_declared_replicate_with_mismatched_shapes_names_ranks():
    frags = [FragmentInfo(0, (4, 6)), FragmentInfo(1, (4, 3)), FragmentInfo(2, (2, 6))]
    for pattern in (Pattern.REPLICATE, Pattern.PARTIAL, Pattern.UNIQUE):
        with ambiguous(f"declared {pattern.value}", r"ranks \[1, 2\]"):
            recognize(NAME, (4, 6), frags, Hints(pattern=pattern))


def test_shard_hy_hint_is_not_enough():
    frags = [FragmentInfo(0, (6,), offset=0), FragmentInfo(1, (6,), offset=6)]
    with ambiguous("hint shard_hy is not enough", "--pattern"):
        recognize(NAME, (4, 3), frags, Hints(pattern=Pattern.SHARD_HY, dim=0))


@pytest.mark.parametrize("seed", range(5))
def test_errors_always_name_the_parameter(seed):
    """Random garbage metadata either yields a spec or an error that names the parameter."""
    rnd = random.Random(seed)
    for _ in range(200):
        shape = tuple(rnd.randint(1, 5) for _ in range(rnd.randint(1, 3)))
        n = rnd.randint(0, 4)
        flat = rnd.random() < 0.5
        frags = [FragmentInfo(r, (rnd.randint(0, 8),), offset=rnd.randint(0, 8)) if flat else
                 FragmentInfo(r, tuple(rnd.randint(1, 5) for _ in range(len(shape)))) for r in range(n)]
        try:
            recognize(NAME, shape, frags)
        except AmbiguousPatternError as exc:
            assert str(exc).startswith(NAME + ":")


# ----------------------------------------------------------------------------- nested layouts

def _zero12(numel: int, n: int):
    """ZeRO-1/2 fragments of one parameter over n ranks: consecutive runs, no padding of their own."""
    cuts = [numel * r // n for r in range(n + 1)]
    return tuple(FragmentInfo(r, (cuts[r + 1] - cuts[r],), offset=cuts[r]) for r in range(n))


def test_nested_tp_shards_partitioned_by_zero_are_shard_hy():
    """Uneven vocabulary split over 2 TP ranks, each shard ZeRO-partitioned over 2 DP ranks."""
    pieces = [OuterPiece(0, (19, 16), _zero12(19 * 16, 2)), OuterPiece(1, (18, 16), _zero12(18 * 16, 2))]
    spec = recognize_nested(NAME, (37, 16), pieces)
    assert (spec.pattern, spec.dim, spec.shard_shapes) == (Pattern.SHARD_HY, 0, ((19, 16), (18, 16)))
    assert spec.inner.pattern is Pattern.SHARD_V and spec.inner.flat
    row = recognize_nested(NAME, (16, 24), [OuterPiece(r, (16, 12), _zero12(192, 3)) for r in range(2)],
                           Hints(pattern=Pattern.SHARD_H))
    assert (row.pattern, row.dim) == (Pattern.SHARD_HY, 1)


def test_nested_pieces_cut_differently_by_zero_are_one_flat_split():
    """One TP shard inside a single DP rank's partition, the other straddling two: both flat splits."""
    pieces = [OuterPiece(0, (8, 16), _zero12(128, 1)), OuterPiece(1, (8, 16), _zero12(128, 2))]
    spec = recognize_nested(NAME, (16, 16), pieces)
    assert spec.pattern is Pattern.SHARD_HY and spec.inner.pattern is Pattern.SHARD_V and spec.inner.flat


def test_nested_replicate_keeps_its_name_and_nests_inner():
    """A pipeline-tied weight: the same full tensor on two stages, each copy ZeRO-partitioned."""
    pieces = [OuterPiece(s, (11, 6), _zero12(66, 2)) for s in range(2)]
    spec = recognize_nested(NAME, (11, 6), pieces, Hints(pattern=Pattern.REPLICATE))
    assert spec.pattern is Pattern.REPLICATE and spec.inner.pattern is Pattern.SHARD_V
    assert spec.shard_shapes == ((11, 6), (11, 6))
    assert spec.to_json()["inner"]["pattern"] == "shard_v"


def test_nested_fused_shards_partitioned_by_zero_keep_shard_nc():
    """Fused QKV over 2 TP ranks ([q 4 | k 1 | v 1] rows each), each shard ZeRO-partitioned over 2 DP ranks."""
    widths = ((4, 4), (1, 1), (1, 1))
    pieces = [OuterPiece(r, (6, 8), _zero12(48, 2)) for r in range(2)]
    spec = recognize_nested(NAME, (12, 8), pieces, Hints(pattern=Pattern.SHARD_NC, dim=0, sub_widths=widths))
    assert (spec.pattern, spec.dim, spec.sub_widths, spec.shard_shapes) == (Pattern.SHARD_NC, 0, widths,
                                                                            ((6, 8), (6, 8)))
    assert spec.inner.pattern is Pattern.SHARD_V and spec.inner.flat


def test_nested_pieces_held_differently_name_the_parameter():
    copies = (FragmentInfo(0, (24,), offset=0), FragmentInfo(1, (24,), offset=0))
    pieces = [OuterPiece(0, (4, 6), _zero12(24, 2)), OuterPiece(1, (4, 6), copies)]
    with ambiguous("held in different ways"):
        recognize_nested(NAME, (8, 6), pieces)


def test_nested_without_pieces_names_the_parameter():
    with ambiguous("no rank holds"):
        recognize_nested(NAME, (8, 6), [])
