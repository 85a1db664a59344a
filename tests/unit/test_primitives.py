"""Round trips and error cases for Extract / Union / StripPad (ucp.plan.primitives).

Every property test builds the shards of a random tensor the way a framework lays them out
(ZeRO-1/2, ZeRO-3, TP dim shards with uneven widths and vocab padding, fused sub-parameters,
TP x ZeRO hybrids, replicas, partial sums), lets the recognizer decide the pattern from the
fragment metadata (with Hints where only a declaration can settle it), and checks that
recognize -> extract -> union -> strip_pad gives back the original bit for bit, dtype included.
Padding is filled with NaN so that any padding leaking into the result breaks the comparison.
Negative controls feed deliberately wrong specs and require a raise or a different tensor.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucp.errors import AmbiguousPatternError, UcpError
from ucp.patterns import FragmentInfo, Hints, Pattern, PatternSpec, recognize
from ucp.plan.primitives import ReplicaMismatchError, strip_pad, union

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NEG_SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
PAD = float("nan")

dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**31 - 1)
ranks = st.integers(1, 5)
dims = st.integers(1, 6)
shapes = st.lists(dims, min_size=1, max_size=3).map(tuple)


def extract(source: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """Extract on an in-memory tensor: the box `offsets`/`lengths` of `source` as a new contiguous tensor
    (what `assemble.read_fragment` reads from a rank file), to build fragments for Union."""
    if len(offsets) != source.dim() or len(lengths) != source.dim():
        raise ValueError(f"box of rank {len(offsets)} does not match a tensor of rank {source.dim()}")
    if any(start < 0 for start in offsets):
        # narrow() would count a negative start from the end and silently cut the wrong box.
        raise ValueError(f"box offsets {tuple(offsets)} must not be negative")
    piece = source
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        piece = piece.narrow(dim, start, length)
    return piece.clone(memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- helpers

def rand(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g).to(dtype)


def distinct(shape, seed) -> torch.Tensor:
    """fp32 tensor whose entries are all different (so any misplaced element is visible)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    return (torch.randperm(n, generator=g).to(torch.float32) + 1).reshape(tuple(shape))


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert tuple(got.shape) == tuple(want.shape)
    assert torch.equal(got, want)
    view = _INT_VIEW.get(want.dtype)
    if view is not None and want.dim() > 0:
        assert torch.equal(got.contiguous().view(view), want.contiguous().view(view))


def rebuild(spec: PatternSpec, pieces, **kw) -> torch.Tensor:
    return strip_pad(union(spec, pieces, name="p", **kw), spec)


def assert_not_rebuilt(fn, want: torch.Tensor) -> None:
    """Negative control: a wrong spec must raise or give a tensor other than `want`."""
    try:
        got = fn()
    except (UcpError, ValueError, RuntimeError, IndexError):
        return
    assert not (tuple(got.shape) == tuple(want.shape) and torch.equal(got, want)), \
        "a deliberately wrong spec reproduced the tensor"


def zero3_shards(t: torch.Tensor, n: int):
    """ZeRO-3 (also one ZeRO-1/2 group holding a single param): flatten, pad to a multiple of n, split."""
    flat = t.reshape(-1)
    chunk = -(-flat.numel() // n)
    padded = torch.cat([flat, torch.full((chunk * n - flat.numel(),), PAD, dtype=t.dtype)])
    # each rank's partition is a rank-local tensor; the fragment is its whole box
    parts = [padded[r * chunk:(r + 1) * chunk].clone() for r in range(n)]
    pieces = [extract(p, (0,), (chunk,)) for p in parts]
    frags = [FragmentInfo(r, (chunk,), offset=r * chunk) for r in range(n)]
    return pieces, frags


def dim_split(t: torch.Tensor, dim: int, widths):
    """Shards of `t` along `dim` with the given widths, cut with Extract."""
    pieces, start = [], 0
    for w in widths:
        offsets = [0] * t.dim()
        lengths = list(t.shape)
        offsets[dim], lengths[dim] = start, w
        pieces.append(extract(t, offsets, lengths))
        start += w
    return pieces


def compositions(total_min=1, n_max=5, w_max=4):
    return st.lists(st.integers(total_min, w_max), min_size=1, max_size=n_max)


# ----------------------------------------------------------------------------- round trips

@SETTINGS
@given(shape=shapes, n=ranks, dtype=dtypes, seed=seeds)
def test_zero3_roundtrip(shape, n, dtype, seed):
    t = rand(shape, dtype, seed)
    pieces, frags = zero3_shards(t, n)
    spec = recognize("p", shape, frags)
    chunk = pieces[0].numel()
    assert spec.flat and spec.padded_size == chunk * n
    assert spec.pattern is (Pattern.UNIQUE if n == 1 else Pattern.SHARD_V)
    assert_bitwise(rebuild(spec, pieces), t)


@SETTINGS
@given(param_shapes=st.lists(shapes, min_size=1, max_size=4), n=ranks, dtype=dtypes, seed=seeds,
       shuffle=st.randoms(use_true_random=False))
def test_zero12_group_roundtrip(param_shapes, n, dtype, seed, shuffle):
    """ZeRO-1/2: all params of a group flattened together, padded once, split into n partitions.

    Each param's fragments are Extracted from the rank partitions they overlap (no padding inside);
    fragment order given to the recognizer is shuffled, union gets them in rank order.
    """
    params = [rand(s, dtype, seed + i) for i, s in enumerate(param_shapes)]
    flat = torch.cat([p.reshape(-1) for p in params])
    chunk = -(-flat.numel() // n)
    flat = torch.cat([flat, torch.full((chunk * n - flat.numel(),), PAD, dtype=dtype)])
    partitions = [flat[r * chunk:(r + 1) * chunk].clone() for r in range(n)]
    start = 0
    for p in params:
        end = start + p.numel()
        pieces, frags = [], []
        for r in range(n):
            lo, hi = max(start, r * chunk), min(end, (r + 1) * chunk)
            if hi > lo:
                pieces.append(extract(partitions[r], (lo - r * chunk,), (hi - lo,)))
                frags.append(FragmentInfo(r, (hi - lo,), offset=lo - start))
        shuffled = list(frags)
        shuffle.shuffle(shuffled)
        spec = recognize("p", p.shape, shuffled)
        assert spec.flat and spec.padded_size == p.numel()
        assert spec.pattern is (Pattern.UNIQUE if len(frags) == 1 else Pattern.SHARD_V)
        assert_bitwise(rebuild(spec, pieces), p)
        start = end


@SETTINGS
@given(data=st.data(), dtype=dtypes, seed=seeds)
def test_dim_shard_uneven_roundtrip(data, dtype, seed):
    """Shard-V / Shard-H with uneven widths, recognized from shapes alone."""
    ndim = data.draw(st.integers(1, 3), label="ndim")
    dim = data.draw(st.integers(0, min(ndim, 2) - 1), label="dim")
    widths = data.draw(compositions(), label="widths")
    shape = [data.draw(dims) for _ in range(ndim)]
    shape[dim] = sum(widths)
    shape = tuple(shape)
    t = rand(shape, dtype, seed)
    pieces = dim_split(t, dim, widths)
    spec = recognize("p", shape, [FragmentInfo(r, tuple(x.shape)) for r, x in enumerate(pieces)])
    if len(widths) == 1:
        assert spec.pattern is Pattern.UNIQUE
    else:
        assert spec.pattern is (Pattern.SHARD_V if dim == 0 else Pattern.SHARD_H)
        assert spec.dim == dim and not spec.flat
    assert_bitwise(rebuild(spec, pieces), t)


@SETTINGS
@given(vocab=st.integers(1, 13), rest=st.lists(dims, max_size=2), n=ranks, extra=st.integers(0, 2),
       dtype=dtypes, seed=seeds)
def test_vocab_padded_shard_v_roundtrip(vocab, rest, n, extra, dtype, seed):
    """Embedding rows padded to a multiple of the TP degree, then split equally on dim 0."""
    shape = (vocab, *rest)
    t = rand(shape, dtype, seed)
    padded_rows = (-(-vocab // n) + extra) * n
    padded = torch.cat([t, torch.full((padded_rows - vocab, *rest), PAD, dtype=dtype)])
    pieces = dim_split(padded, 0, [padded_rows // n] * n)
    frags = [FragmentInfo(r, tuple(x.shape)) for r, x in enumerate(pieces)]
    spec = recognize("p", shape, frags, Hints(pattern=Pattern.SHARD_V, padded_dim_size=padded_rows))
    assert spec.pattern is Pattern.SHARD_V and spec.dim == 0
    assert spec.padded_size == (padded_rows if padded_rows > vocab else None)
    assert_bitwise(rebuild(spec, pieces), t)
    if padded_rows > vocab and padded_rows // n != vocab:
        # Without the hint the shapes do not say it. (When each padded shard is exactly `vocab` rows,
        # the pieces look like replicas, which is what an unhinted recognizer must assume.)
        with pytest.raises(AmbiguousPatternError, match="^p:"):
            recognize("p", shape, frags)


@st.composite
def nc_layouts(draw):
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    n = draw(ranks)
    k = draw(st.integers(1, 3))
    sub_widths = tuple(tuple(draw(st.integers(1, 3)) for _ in range(n)) for _ in range(k))
    shape = [draw(dims) for _ in range(ndim)]
    shape[dim] = sum(map(sum, sub_widths))
    return tuple(shape), dim, sub_widths


def nc_shards(t: torch.Tensor, dim: int, sub_widths):
    """Rank r holds, in order, its block of every sub-parameter (fused QKV under GQA, gate/up)."""
    n = len(sub_widths[0])
    pieces = []
    for r in range(n):
        blocks, sub_start = [], 0
        for widths in sub_widths:
            offsets = [0] * t.dim()
            lengths = list(t.shape)
            offsets[dim], lengths[dim] = sub_start + sum(widths[:r]), widths[r]
            blocks.append(extract(t, offsets, lengths))
            sub_start += sum(widths)
        pieces.append(torch.cat(blocks, dim=dim))
    return pieces


@SETTINGS
@given(layout=nc_layouts(), dtype=dtypes, seed=seeds)
def test_shard_nc_roundtrip(layout, dtype, seed):
    shape, dim, sub_widths = layout
    t = rand(shape, dtype, seed)
    pieces = nc_shards(t, dim, sub_widths)
    frags = [FragmentInfo(r, tuple(x.shape)) for r, x in enumerate(pieces)]
    spec = recognize("p", shape, frags, Hints(pattern=Pattern.SHARD_NC, dim=dim, sub_widths=sub_widths))
    assert spec.pattern is Pattern.SHARD_NC and spec.dim == dim and spec.sub_widths == sub_widths
    assert_bitwise(rebuild(spec, pieces), t)


@st.composite
def hy_layouts(draw):
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    tp_widths = draw(compositions(n_max=4))
    dp = draw(st.integers(1, 4))
    shape = [draw(dims) for _ in range(ndim)]
    shape[dim] = sum(tp_widths)
    vocab_pad = draw(st.integers(0, 3)) if dim == 0 else 0
    inner = draw(st.sampled_from(["zero", "replicate"]))
    return tuple(shape), dim, tp_widths, dp, vocab_pad, inner


@SETTINGS
@given(layout=hy_layouts(), dtype=dtypes, seed=seeds)
def test_shard_hy_roundtrip(layout, dtype, seed):
    """TP shards along `dim` (last one optionally vocab-padded), each ZeRO-partitioned over dp ranks
    (flattened, padded, split) or replicated over dp ranks."""
    shape, dim, tp_widths, dp, vocab_pad, inner_kind = layout
    t = rand(shape, dtype, seed)
    source = t
    if vocab_pad:
        pad_shape = list(shape)
        pad_shape[0] = vocab_pad
        source = torch.cat([t, torch.full(pad_shape, PAD, dtype=dtype)])
        tp_widths = tp_widths[:-1] + [tp_widths[-1] + vocab_pad]
    shards = dim_split(source, dim, tp_widths)
    pieces, inner_specs = [], []
    for shard in shards:
        if inner_kind == "zero":
            inner_pieces, frags = zero3_shards(shard, dp)
        else:
            inner_pieces = [shard.clone() for _ in range(dp)]
            frags = [FragmentInfo(r, tuple(shard.shape)) for r in range(dp)]
        inner_specs.append(recognize("p", shard.shape, frags))
        pieces.append(inner_pieces)
    expect = {("zero", True): Pattern.UNIQUE, ("zero", False): Pattern.SHARD_V,
              ("replicate", True): Pattern.UNIQUE, ("replicate", False): Pattern.REPLICATE}
    assert {s.pattern for s in inner_specs} == {expect[inner_kind, dp == 1]}
    spec = PatternSpec(Pattern.SHARD_HY, shape, dim=dim, inner=inner_specs[0],
                       shard_shapes=tuple(tuple(s.shape) for s in shards))
    out = union(spec, pieces, strict=True, name="p")
    assert out.shape[dim] == source.shape[dim]
    assert_bitwise(strip_pad(out, spec), t)


@SETTINGS
@given(shape=shapes, n=st.integers(2, 5), dtype=dtypes, seed=seeds, flat=st.booleans())
def test_replicate_roundtrip(shape, n, dtype, seed, flat):
    t = rand(shape, dtype, seed)
    if flat:
        pieces = [t.reshape(-1).clone() for _ in range(n)]
        frags = [FragmentInfo(r, (t.numel(),), offset=0) for r in range(n)]
    else:
        pieces = [t.clone() for _ in range(n)]
        frags = [FragmentInfo(r, shape) for r in range(n)]
    spec = recognize("p", shape, frags)
    assert spec.pattern is Pattern.REPLICATE and spec.flat == flat
    assert_bitwise(rebuild(spec, pieces, strict=True), t)
    assert_bitwise(rebuild(spec, pieces, strict=False), t)


@SETTINGS
@given(shape=shapes, seed=seeds, dtype=dtypes)
def test_unique_roundtrip(shape, seed, dtype):
    t = rand(shape, dtype, seed)
    spec = recognize("p", shape, [FragmentInfo(3, shape)])
    assert spec.pattern is Pattern.UNIQUE
    assert_bitwise(rebuild(spec, [t.clone()]), t)


@SETTINGS
@given(shape=shapes, n=ranks, dtype=dtypes, seed=seeds)
def test_partial_roundtrip_exact(shape, n, dtype, seed):
    """Pieces are small integers; the last is n*t - sum(others). Every partial sum is an integer of
    magnitude <= 8*n + 8*(n-1) + 8*n < 256, exact in bf16/fp16/fp32, and (n*t)/n is exactly t because
    IEEE division is correctly rounded and t is representable. Hence torch.equal holds exactly."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(-8, 9, shape, generator=g).to(dtype)
    others = [torch.randint(-8, 9, shape, generator=g).to(dtype) for _ in range(n - 1)]
    last = (n * t.double() - sum((o.double() for o in others), torch.zeros(shape, dtype=torch.float64)))
    pieces = others + [last.to(dtype)]
    assert torch.equal(pieces[-1].double(), last)  # the construction itself is exact
    spec = recognize("p", shape, [FragmentInfo(r, shape) for r in range(n)], Hints(pattern=Pattern.PARTIAL))
    assert spec.pattern is Pattern.PARTIAL
    assert_bitwise(rebuild(spec, pieces), t)


@SETTINGS
@given(shape=shapes, n=ranks, dtype=dtypes, seed=seeds)
def test_partial_matches_deepspeed_bit_for_bit(shape, n, dtype, seed):
    pieces = [rand(shape, dtype, seed + r) for r in range(n)]
    pieces[0].view(-1)[0] = -0.0  # sum() starts from int 0, and 0 + -0.0 is +0.0
    ds = sum(pieces) / len(pieces)  # deepspeed/checkpoint/ds_to_universal.py merge_tp_slices
    before = [p.clone() for p in pieces]
    got = union(PatternSpec(Pattern.PARTIAL, shape), pieces, name="p")
    assert_bitwise(got, ds)
    for p, b in zip(pieces, before):  # the inputs are left alone
        assert_bitwise(p, b)


# ----------------------------------------------------------------------------- negative controls

@NEG_SETTINGS
@given(data=st.data(), seed=seeds)
def test_negative_dim_shard_wrong_dim_order_or_missing(data, seed):
    ndim = data.draw(st.integers(2, 3))
    dim = data.draw(st.integers(0, 1))
    widths = data.draw(st.lists(st.integers(1, 4), min_size=2, max_size=5))
    shape = [data.draw(dims) for _ in range(ndim)]
    shape[dim] = sum(widths)
    t = distinct(shape, seed)
    pieces = dim_split(t, dim, widths)
    good = recognize("p", tuple(shape), [FragmentInfo(r, tuple(x.shape)) for r, x in enumerate(pieces)])
    assert_bitwise(rebuild(good, pieces), t)
    other = 1 - dim
    wrong_dim = PatternSpec(Pattern.SHARD_H if other else Pattern.SHARD_V, tuple(shape), dim=other)
    assert_not_rebuilt(lambda: rebuild(wrong_dim, pieces), t)
    assert_not_rebuilt(lambda: rebuild(good, pieces[::-1]), t)
    drop = data.draw(st.integers(0, len(pieces) - 1))
    kept = pieces[:drop] + pieces[drop + 1:]
    with pytest.raises(AmbiguousPatternError, match="^p:"):
        recognize("p", tuple(shape), [FragmentInfo(r, tuple(x.shape)) for r, x in enumerate(kept)])
    assert_not_rebuilt(lambda: rebuild(good, kept), t)


@NEG_SETTINGS
@given(shape=shapes, n=st.integers(2, 5), seed=seeds, data=st.data())
def test_negative_zero3_wrong_order_or_missing(shape, n, seed, data):
    t = distinct(shape, seed)
    pieces, frags = zero3_shards(t, n)
    spec = recognize("p", shape, frags)
    # ranks that hold real elements; swapping two of them must be caught
    real = [r for r in range(n) if r * pieces[0].numel() < t.numel()]
    if len(real) >= 2:
        swapped = [pieces[1], pieces[0], *pieces[2:]]
        assert_not_rebuilt(lambda: rebuild(spec, swapped), t)
        bad = [FragmentInfo(0, frags[0].shape, offset=frags[1].offset),
               FragmentInfo(1, frags[1].shape, offset=0), *frags[2:]]
        with pytest.raises(AmbiguousPatternError, match="^p:.*rank order"):
            recognize("p", shape, bad)
    drop = data.draw(st.sampled_from(real))
    kept = [f for f in frags if f.rank != drop]
    with pytest.raises(AmbiguousPatternError, match="^p:"):
        recognize("p", shape, kept)
    assert_not_rebuilt(lambda: rebuild(spec, [p for r, p in enumerate(pieces) if r != drop]), t)


@NEG_SETTINGS
@given(layout=nc_layouts(), seed=seeds, data=st.data())
def test_negative_shard_nc_wrong_widths(layout, seed, data):
    shape, dim, sub_widths = layout
    n, k = len(sub_widths[0]), len(sub_widths)
    t = distinct(shape, seed)
    pieces = nc_shards(t, dim, sub_widths)
    if n >= 2 and k >= 2:
        # treating fused blocks as one contiguous shard interleaves them wrongly
        plain = PatternSpec(Pattern.SHARD_NC, shape, dim=dim, sub_widths=(tuple(x.shape[dim] for x in pieces),))
        assert_not_rebuilt(lambda: rebuild(plain, pieces), t)
        assert_not_rebuilt(lambda: rebuild(PatternSpec(Pattern.SHARD_NC, shape, dim=dim,
                                                       sub_widths=sub_widths), pieces[::-1]), t)
    # One unit of rank r's width moves to the next sub-parameter: every rank still covers its piece,
    # so only the element placement can expose it (needs n >= 2: with one rank every split is the
    # identity). With one sub-parameter, rank r's widths no longer cover its piece.
    s = data.draw(st.integers(0, k - 1))
    r = data.draw(st.integers(0, n - 1))
    widths = [list(w) for w in sub_widths]
    widths[s][r] += 1
    if k >= 2:
        widths[(s + 1) % k][r] -= 1  # widths are >= 1, so this stays >= 0
    if k == 1 or n >= 2:
        wrong = PatternSpec(Pattern.SHARD_NC, shape, dim=dim, sub_widths=tuple(map(tuple, widths)))
        assert_not_rebuilt(lambda: rebuild(wrong, pieces), t)
    if n >= 2 and len(shape) >= 2:
        other = dim + 1 if dim + 1 < len(shape) else dim - 1
        wrong_dim = PatternSpec(Pattern.SHARD_NC, shape, dim=other, sub_widths=sub_widths)
        assert_not_rebuilt(lambda: rebuild(wrong_dim, pieces), t)


@NEG_SETTINGS
@given(layout=hy_layouts(), seed=seeds)
def test_negative_shard_hy_wrong_order(layout, seed):
    shape, dim, tp_widths, dp, _, _ = layout
    t = distinct(shape, seed)
    shards = dim_split(t, dim, tp_widths)
    pieces = [zero3_shards(s, dp)[0] for s in shards]
    inner = recognize("p", shards[0].shape, zero3_shards(shards[0], dp)[1])
    spec = PatternSpec(Pattern.SHARD_HY, shape, dim=dim, inner=inner,
                       shard_shapes=tuple(tuple(s.shape) for s in shards))
    assert_bitwise(rebuild(spec, pieces), t)
    if dp >= 2:
        first = [pieces[0][1], pieces[0][0], *pieces[0][2:]]
        assert_not_rebuilt(lambda: rebuild(spec, [first, *pieces[1:]]), t)
    if len(shards) >= 2:
        assert_not_rebuilt(lambda: rebuild(spec, pieces[::-1]), t)
        assert_not_rebuilt(lambda: rebuild(spec, pieces[1:]), t)
    if len(shards) >= 2 and len(shape) >= 2:
        wrong_dim = PatternSpec(Pattern.SHARD_HY, shape, dim=(dim + 1) % len(shape), inner=inner,
                                shard_shapes=spec.shard_shapes)
        assert_not_rebuilt(lambda: rebuild(wrong_dim, pieces), t)


def test_negative_partial_is_not_replicate():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 6.0])
    want = torch.tensor([2.0, 4.0])
    assert_bitwise(union(PatternSpec(Pattern.PARTIAL, (2,)), [a, b]), want)
    assert_not_rebuilt(lambda: union(PatternSpec(Pattern.REPLICATE, (2,)), [a, b]), want)
    assert_not_rebuilt(lambda: union(PatternSpec(Pattern.PARTIAL, (2,)), [a]), want)


# ----------------------------------------------------------------------------- Extract

@SETTINGS
@given(shape=shapes, seed=seeds, data=st.data(), dtype=dtypes)
def test_extract_matches_slicing(shape, seed, data, dtype):
    t = rand(shape, dtype, seed)
    offsets = [data.draw(st.integers(0, s - 1)) for s in shape]
    lengths = [data.draw(st.integers(0, s - o)) for s, o in zip(shape, offsets)]
    got = extract(t, offsets, lengths)
    want = t[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    assert_bitwise(got, want)
    assert got.is_contiguous()
    if got.numel():
        got.view(-1)[0] = 42.0  # a copy, not a view into the rank's tensor
        assert torch.equal(t, rand(shape, dtype, seed))


def test_extract_of_transposed_source_is_contiguous():
    src = torch.arange(12.0).reshape(3, 4).t()
    got = extract(src, (0, 0), (4, 3))
    assert got.is_contiguous() and torch.equal(got, src)


def test_extract_rejects_bad_boxes():
    t = torch.arange(10.0).reshape(2, 5)
    with pytest.raises(ValueError, match="rank"):
        extract(t, (0,), (1,))
    with pytest.raises(ValueError, match="rank"):
        extract(t, (0, 0), (1,))
    with pytest.raises(ValueError, match="negative"):
        extract(t, (0, -2), (1, 2))  # narrow() alone would wrap around to the last columns
    with pytest.raises((ValueError, RuntimeError)):
        extract(t, (0, 4), (1, 2))  # runs past the end


# ----------------------------------------------------------------------------- Union / StripPad errors

def test_replicate_strict_mismatch_names_parameter_and_rank():
    base = torch.arange(6.0).reshape(2, 3)
    other = base.clone()
    other[1, 2] += 1
    pieces = [base, base.clone(), other, base.clone()]
    spec = PatternSpec(Pattern.REPLICATE, (2, 3))
    with pytest.raises(ReplicaMismatchError, match=r"^layers\.0\.w: .*rank 2\b") as info:
        union(spec, pieces, strict=True, name="layers.0.w")
    assert isinstance(info.value, UcpError)
    assert union(spec, pieces, name="layers.0.w") is base  # non-strict: rank 0's copy, unchecked
    out = union(spec, [other, base], name="x")
    assert torch.equal(out, other)


def test_replicate_strict_shape_mismatch_raises():
    spec = PatternSpec(Pattern.REPLICATE, (2,))
    with pytest.raises(ReplicaMismatchError, match=r"^w: .*rank 1\b"):
        union(spec, [torch.zeros(2), torch.zeros(3)], strict=True, name="w")


def test_replicate_strict_accepts_identical_nan_copies():
    a = torch.tensor([float("nan"), 1.0, float("inf")])
    assert union(PatternSpec(Pattern.REPLICATE, (3,)), [a, a.clone()], strict=True, name="w") is a
    b = torch.tensor([1.0, float("nan"), float("inf")])
    with pytest.raises(ReplicaMismatchError, match="rank 1"):
        union(PatternSpec(Pattern.REPLICATE, (3,)), [a, b], strict=True, name="w")


def test_partial_negative_zero_matches_deepspeed():
    for n in (1, 2, 3):
        for dtype in DTYPES:
            pieces = [torch.tensor([-0.0, -1.5, 2.0], dtype=dtype) for _ in range(n)]
            assert_bitwise(union(PatternSpec(Pattern.PARTIAL, (3,)), pieces), sum(pieces) / len(pieces))


def test_union_argument_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="^w: no fragments"):
        union(PatternSpec(Pattern.SHARD_V, (2, 3), dim=0), [], name="w")
    with pytest.raises(ValueError, match="^w: a unique"):
        union(PatternSpec(Pattern.UNIQUE, (2, 3)), [x, x], name="w")
    with pytest.raises(ValueError, match="^w: .*needs a dim"):
        union(PatternSpec(Pattern.SHARD_H, (2, 6)), [x, x], name="w")
    with pytest.raises(ValueError, match="^w: shard_nc needs"):
        union(PatternSpec(Pattern.SHARD_NC, (4, 3), dim=0), [x, x], name="w")
    with pytest.raises(ValueError, match="^w: 3 widths for 2 ranks"):
        union(PatternSpec(Pattern.SHARD_NC, (4, 3), dim=0, sub_widths=((1, 1, 0),)), [x, x], name="w")
    with pytest.raises(ValueError, match="^w: rank 1 holds 2"):
        union(PatternSpec(Pattern.SHARD_NC, (3, 3), dim=0, sub_widths=((1, 1), (1, 0))), [x, x], name="w")
    with pytest.raises(ValueError, match="^w: shard_hy needs"):
        union(PatternSpec(Pattern.SHARD_HY, (4, 3), dim=0), [[x], [x]], name="w")
    inner = PatternSpec(Pattern.UNIQUE, (2, 3))
    with pytest.raises(ValueError, match="^w: 1 shard shapes for 2"):
        union(PatternSpec(Pattern.SHARD_HY, (4, 3), dim=0, inner=inner, shard_shapes=((2, 3),)),
              [[x], [x]], name="w")


def test_strip_pad_cases():
    flat = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, PAD, PAD])
    spec = PatternSpec(Pattern.SHARD_V, (2, 3), flat=True, padded_size=8)
    assert_bitwise(strip_pad(flat, spec), torch.arange(1.0, 7.0).reshape(2, 3))
    with pytest.raises(ValueError, match="cannot fill"):
        strip_pad(flat[:5], spec)
    rows = torch.arange(12.0).reshape(4, 3)
    out = strip_pad(rows, PatternSpec(Pattern.SHARD_V, (3, 3), dim=0, padded_size=4))
    assert_bitwise(out, rows[:3])
    assert out.is_contiguous()
    with pytest.raises(ValueError, match="dim 1"):
        strip_pad(rows, PatternSpec(Pattern.SHARD_V, (4, 5), dim=0))
    exact = torch.arange(6.0)
    assert_bitwise(strip_pad(exact, PatternSpec(Pattern.REPLICATE, (2, 3))), exact.reshape(2, 3))


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_pattern_keeps_dtype(dtype):
    t = torch.arange(24.0).reshape(4, 6).to(dtype)
    cases = [
        (PatternSpec(Pattern.UNIQUE, (4, 6)), [t]),
        (PatternSpec(Pattern.REPLICATE, (4, 6)), [t, t.clone()]),
        (PatternSpec(Pattern.PARTIAL, (4, 6)), [t, t.clone()]),
        (PatternSpec(Pattern.SHARD_V, (4, 6), dim=0), list(t.split([1, 3], 0))),
        (PatternSpec(Pattern.SHARD_H, (4, 6), dim=1), list(t.split([4, 2], 1))),
        (PatternSpec(Pattern.SHARD_V, (4, 6), flat=True, padded_size=24), list(t.reshape(-1).split(12))),
        (PatternSpec(Pattern.SHARD_NC, (4, 6), dim=1, sub_widths=((2, 1), (2, 1))),
         [torch.cat([t[:, 0:2], t[:, 3:5]], 1), torch.cat([t[:, 2:3], t[:, 5:6]], 1)]),
        (PatternSpec(Pattern.SHARD_HY, (4, 6), dim=0, shard_shapes=((2, 6), (2, 6)),
                     inner=PatternSpec(Pattern.SHARD_V, (2, 6), flat=True, padded_size=12)),
         [list(t[:2].reshape(-1).split(6)), list(t[2:].reshape(-1).split(6))]),
    ]
    for spec, pieces in cases:
        out = rebuild(spec, pieces, strict=True)
        assert_bitwise(out, t)


@SETTINGS
@given(shape=shapes, copies=st.integers(2, 4), dp=st.integers(1, 4), dtype=dtypes, seed=seeds)
def test_nested_replicate_roundtrip(shape, copies, dp, dtype, seed):
    """A tied weight on several pipeline stages, each stage's copy ZeRO-partitioned over dp ranks."""
    from ucp.patterns import OuterPiece, recognize_nested

    t = rand(shape, dtype, seed)
    pieces, outer = [], []
    for stage in range(copies):
        inner_pieces, frags = zero3_shards(t, dp)
        pieces.append(inner_pieces)
        outer.append(OuterPiece(stage, tuple(shape), tuple(frags)))
    spec = recognize_nested("p", shape, outer, Hints(pattern=Pattern.REPLICATE))
    assert spec.pattern is Pattern.REPLICATE and spec.inner is not None
    assert_bitwise(rebuild(spec, pieces, strict=True), t)
    # Negative control: one stage's copy differs in one element; --strict must refuse it.
    pieces[-1] = [p.clone() for p in pieces[-1]]
    pieces[-1][0].view(-1)[0] = pieces[-1][0].view(-1)[0] + 1
    with pytest.raises(ReplicaMismatchError):
        rebuild(spec, pieces, strict=True)


def test_nested_shard_nc_roundtrip():
    """Fused QKV ([q 4 | k 2 | v 2] rows per TP rank) over 2 TP ranks, each shard ZeRO-partitioned over 2 DP ranks."""
    from ucp.patterns import OuterPiece, recognize_nested

    t = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
    q, k, v = t[:8].chunk(2), t[8:12].chunk(2), t[12:].chunk(2)
    shards = [torch.cat([q[r], k[r], v[r]]) for r in range(2)]
    pieces = [list(s.reshape(-1).split(12)) for s in shards]
    outer = [OuterPiece(r, (8, 3), (FragmentInfo(0, (12,), 0), FragmentInfo(1, (12,), 12))) for r in range(2)]
    widths = ((4, 4), (2, 2), (2, 2))
    spec = recognize_nested("qkv", (16, 3), outer, Hints(pattern=Pattern.SHARD_NC, dim=0, sub_widths=widths))
    assert_bitwise(rebuild(spec, pieces, strict=True), t)
    # Negative control: the same shards read as a plain split along dim 0 interleave q, k and v wrongly.
    plain = dataclasses.replace(spec, pattern=Pattern.SHARD_HY, sub_widths=None)
    assert not torch.equal(rebuild(plain, pieces, strict=True), t)
