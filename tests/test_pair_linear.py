"""The k-pairs product of a bf16 engine's projections (`engine/csrc/pair_linear.cpp`): every output the
float32 sum of its products rounded once (against float64), a row's outputs alike in any batch, the
layout's edges (features past a panel of 32, rows past a tile of 12, a block of 96) and its errors."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cpu_kernels import needs_bf16_dot

from pagedrl.engine import cpu_kernels


@pytest.fixture(autouse=True, scope="module")
def kernels() -> None:
    assert cpu_kernels.available()


def pair_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    ops = torch.ops.pagedrl_cpu
    return ops.pair_linear(x, ops.pack_pairs(weight), weight.shape[0], bias)


@settings(max_examples=40, deadline=None)
@given(rows=st.one_of(st.integers(1, 40), st.sampled_from([95, 96, 97, 200])), out_features=st.integers(1, 100),
       pairs=st.one_of(st.integers(1, 100), st.sampled_from([288, 768])), bias=st.booleans(),
       strided=st.booleans(), seed=st.integers(0, 2**16))
def test_pair_linear_is_the_float32_sum_rounded_once(rows, out_features, pairs, bias, strided, seed) -> None:
    """Within half a bf16 step of the exact (float64) value plus float32's accumulation error, for any
    row count (tiles of 12 and their tail, blocks of 96), any feature count (panels of 32 and a
    partial last one), input rows strided (a slice of a wider tensor)."""
    needs_bf16_dot()
    gen = torch.Generator().manual_seed(seed)
    in_features = 2 * pairs
    wide = torch.randn(rows, in_features + (6 if strided else 0), generator=gen).bfloat16()
    x = wide[:, :in_features]
    weight = torch.randn(out_features, in_features, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    out = pair_linear(x, weight, b)
    exact = x.double() @ weight.double().t() + (b.double() if bias else 0.0)
    magnitude = x.double().abs() @ weight.double().abs().t()
    bound = exact.abs() * 2.0**-8 + magnitude * in_features * 2.0**-24 + 1e-30
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    assert ((out.double() - exact).abs() <= bound).all()


def test_pair_linear_computes_a_row_alike_in_any_batch() -> None:
    """A row's outputs do not depend on the rows beside it: alone, among 32, among 600 (blocks of
    96 rows, panels walked either way round), or on one thread instead of two."""
    needs_bf16_dot()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(600, 576, generator=gen).bfloat16()
    weight = torch.randn(1000, 576, generator=gen).bfloat16()
    whole = pair_linear(x, weight, None)
    by_32 = torch.cat([pair_linear(x[i:i + 32], weight, None) for i in range(0, 600, 32)])
    assert torch.equal(whole, by_32)
    for row in (0, 95, 96, 599):
        assert torch.equal(whole[row:row + 1], pair_linear(x[row:row + 1], weight, None))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(whole, pair_linear(x, weight, None))
    finally:
        torch.set_num_threads(threads)


def test_pair_linear_names_what_does_not_fit() -> None:
    needs_bf16_dot()
    ops = torch.ops.pagedrl_cpu
    packed = ops.pack_pairs(torch.randn(40, 64).bfloat16())
    assert packed.shape == (2, 32, 32, 2)
    with pytest.raises(RuntimeError, match="does not fit a packed weight"):
        ops.pair_linear(torch.randn(3, 66).bfloat16(), packed, 40, None)
    with pytest.raises(RuntimeError, match="does not fit a packed weight"):
        ops.pair_linear(torch.randn(3, 64).bfloat16(), packed, 70, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.pair_linear(torch.randn(3, 64).bfloat16(), packed, 40, torch.randn(41).bfloat16())
    with pytest.raises(RuntimeError, match="bf16"):
        ops.pair_linear(torch.randn(3, 64), packed, 40, None)
