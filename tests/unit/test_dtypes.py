"""The numpy path computes bit for bit what torch computes: casts (bfloat16 held as raw words), Union's mean of
partial copies, and --strict's replica comparison."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ucp.format.dtypes import as_values, cast, from_torch, to_torch
from ucp.patterns.types import Pattern, PatternSpec
from ucp.plan.primitives import ReplicaMismatchError, union

DTYPES = ("float32", "bfloat16", "float16", "float64")


def awkward(n: int, seed: int) -> torch.Tensor:
    """fp32 values with the cases casts get wrong: NaNs of both signs, ±0, ±inf, ties, huge and tiny values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-40, 38, n).clamp(max=3e38)
    x[:8] = torch.tensor([float("nan"), -float("nan"), 0.0, -0.0, float("inf"), -float("inf"), 3.4e38, 1e-45])
    x[8:16] = torch.tensor([1.00390625, 1.01171875, -1.00390625, 65504.0, 65520.0, 2.0 ** -24, 2.0 ** -25, 1.5])
    return x


def words(t: torch.Tensor) -> np.ndarray:
    return from_torch(t.contiguous())[0].view(np.uint8)


@pytest.mark.parametrize("target", DTYPES)
@pytest.mark.parametrize("n", [17, 33, 100_003])
def test_casts_from_float32_match_torch(target, n):
    x = awkward(n, n)
    assert np.array_equal(cast(x.numpy(), "float32", target).view(np.uint8),
                          words(x.to(getattr(torch, target))))


@pytest.mark.parametrize("source", ("bfloat16", "float16"))
def test_upcasts_match_torch(source):
    t = awkward(10_001, 3).to(getattr(torch, source))
    held, name = from_torch(t)
    assert name == source
    assert np.array_equal(cast(held, source, "float32").view(np.uint8), words(t.float()))
    assert torch.equal(to_torch(held, source).view(torch.int16), t.view(torch.int16))  # and back, shared


def test_negative_control_truncation_is_not_torchs_rounding():
    x = awkward(10_001, 5).numpy()
    truncated = (x.view(np.uint32) >> 16).astype(np.uint16)
    assert not np.array_equal(truncated, cast(x, "float32", "bfloat16"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_mean_of_partial_copies_matches_torch(dtype):
    pieces = [awkward(4099, seed).to(getattr(torch, dtype)) for seed in (1, 2, 3)]
    spec = PatternSpec(Pattern.PARTIAL, (4099,))
    want = union(spec, pieces)
    got = union(spec, [from_torch(p)[0] for p in pieces], dtype=dtype)
    assert np.array_equal(got.view(np.uint8), words(want))


def test_strict_replicas_compare_by_value_as_torch_does():
    a = torch.tensor([1.0, float("nan"), 0.0]).to(torch.bfloat16)
    same_value = torch.tensor([1.0, float("nan"), -0.0]).to(torch.bfloat16)  # -0.0 == 0.0, NaN in place
    other = torch.tensor([1.0, 2.0, 0.0]).to(torch.bfloat16)
    spec = PatternSpec(Pattern.REPLICATE, (3,))
    for x, y in ((a, same_value), (a, other)):
        held = [from_torch(x)[0], from_torch(y)[0]]
        try:
            union(spec, [x, y], strict=True)
            torch_ok = True
        except ReplicaMismatchError:
            torch_ok = False
        try:
            union(spec, held, strict=True, dtype="bfloat16")
            numpy_ok = True
        except ReplicaMismatchError:
            numpy_ok = False
        assert numpy_ok == torch_ok
    assert as_values(from_torch(a)[0], "bfloat16")[0] == 1.0
