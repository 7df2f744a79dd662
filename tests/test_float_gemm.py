"""The float32 product of many rows (`kernels/csrc/float_gemm.cpp`): every output within float32's bound
for its K products of the exact (float64) value, a row's outputs alike in any batch, at any place in a
panel and on any number of threads, weights read as they lie (a strided slice), the routes taking it
between `float_linear`'s rows and MKL's, and its errors."""

from __future__ import annotations

import pytest
import torch
from float_bounds import gamma
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrl.engine import cpu_routes
from pagedrl.kernels import ops, products
from pagedrl.model.routed import Linear

pytestmark = pytest.mark.isa  # its paths follow the CPU class: `make test-isa` runs it as each lower one


@pytest.fixture(autouse=True, scope="module")
def kernels() -> None:
    assert ops.available()


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 70), out_features=st.integers(1, 40),
       in_features=st.one_of(st.integers(1, 130), st.sampled_from([576, 1536])),
       bias=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_every_output_is_within_float32_s_bound_of_the_exact_sum(rows, out_features, in_features, bias, strided,
                                                                  seed) -> None:
    """Each output is a chain of K fused multiply-adds and the bias: within gamma(K + 1) of sum |x w| + |b|
    of the float64 value. Odd K (the loop's last step alone), weight rows past a tile of 6 (the padded
    tile), rows past a panel of 16, input and weight rows of a wider tensor."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features + (3 if strided else 0), generator=gen)[:, :in_features]
    weight = torch.randn(out_features, in_features + (5 if strided else 0), generator=gen)[:, :in_features]
    b = torch.randn(out_features, generator=gen) if bias else None
    out = ops.float_gemm(x, weight, b)
    exact = x.double() @ weight.double().t() + (b.double() if b is not None else 0.0)
    magnitude = x.double().abs() @ weight.double().abs().t() + (b.double().abs() if b is not None else 0.0)
    assert out.dtype == torch.float32 and out.shape == exact.shape
    assert ((out.double() - exact).abs() <= gamma(in_features + 1) * magnitude).all()


def test_a_row_s_outputs_do_not_depend_on_its_batch_or_the_threads() -> None:
    """Alone, among 33 or among 2100 (more than one block of panels), at any offset in a panel, in a
    panel of 16 or a last one of at most 8 (`half_tile`), on one thread or two: the same bits (each
    output's chain is fixed whatever computes it). K = 1541: two chunks of k and an odd last step."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2100, 1541, generator=gen)
    weight = torch.randn(1541, 1541, generator=gen)
    whole = ops.float_gemm(x, weight, None)
    for first, count in ((0, 1), (7, 33), (2099, 1), (100, 500), (40, 24)):
        assert torch.equal(ops.float_gemm(x[first:first + count], weight, None), whole[first:first + count])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(ops.float_gemm(x, weight, None), whole)
    finally:
        torch.set_num_threads(threads)


def test_no_products_give_the_bias() -> None:
    bias = torch.randn(5)
    assert torch.equal(ops.float_gemm(torch.randn(3, 0), torch.randn(5, 0), bias), bias.expand(3, 5))
    assert torch.equal(ops.float_gemm(torch.randn(3, 0), torch.randn(5, 0), None), torch.zeros(3, 5))
    assert ops.float_gemm(torch.randn(0, 4), torch.randn(5, 4), bias).shape == (0, 5)


def test_wrong_operands_are_refused_with_the_reason() -> None:
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32 x and weight"):
        ops.float_gemm(x.double(), w.double(), None)
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and weight \[N, K\]"):
        ops.float_gemm(x, torch.randn(4, 9), None)
    with pytest.raises(RuntimeError, match="rows must be contiguous"):
        ops.float_gemm(x, torch.randn(8, 4).t(), None)
    with pytest.raises(RuntimeError, match=r"bias \[4\]"):
        ops.float_gemm(x, w, torch.randn(5))


def test_a_float32_step_routes_each_row_count_to_its_kernel() -> None:
    """Up to `MAX_ROWS_FLOAT` rows `float_linear`'s bits, up to `MAX_ROWS_GEMM` (where this CPU class has
    it) `float_gemm`'s, above torch's."""
    torch.manual_seed(0)
    layer = Linear(96, 40)
    few, many = products.MAX_ROWS_FLOAT, max(products.MAX_ROWS_FLOAT, products.MAX_ROWS_GEMM)
    with torch.no_grad():
        for rows in sorted({few, few + 1, many, many + 1}):
            x = torch.randn(1, rows, 96)
            with cpu_routes.routed_step(rows, on=True, products_only=True, float32=True):
                got = layer(x)
            if rows <= few:
                expected = ops.float_linear(x[0], layer.weight, layer.bias)[None]
            elif rows <= many:
                expected = ops.float_gemm(x[0], layer.weight, layer.bias)[None]
            else:
                expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
            assert torch.equal(got, expected), rows
