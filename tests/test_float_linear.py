"""The float32 product of a decode step's few rows (`kernels/csrc/float_linear.cpp`): every output within
float32's bound for its K products of the exact (float64) value, a row's outputs alike in any batch,
weights read as they lie (a strided slice), the float32 engine's routes taking it for small steps
only, and its errors."""

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


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.pagedrl_cpu.float_linear(x, weight, bias)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 40), out_features=st.integers(1, 70),
       in_features=st.one_of(st.integers(1, 200), st.sampled_from([8, 16, 576, 1536])),
       bias=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_every_output_is_within_float32_s_bound_of_the_exact_sum(rows, out_features, in_features, bias, strided,
                                                                  seed) -> None:
    """Each output is K fused multiply-adds in lanes, a tree over the lanes and the bias: in any order
    of those roundings within gamma(K + 1) of sum |x w| + |b| of the float64 value (one more rounding
    for the bias). Every tail of K past the lanes, every weight-row count past a tile, odd rows."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen)
    wide = torch.randn(out_features, in_features + (5 if strided else 0), generator=gen)
    weight = wide[:, :in_features]
    b = torch.randn(out_features, generator=gen) if bias else None
    out = float_linear(x, weight, b)
    exact = x.double() @ weight.double().t() + (b.double() if b is not None else 0.0)
    magnitude = x.double().abs() @ weight.double().abs().t() + (b.double().abs() if b is not None else 0.0)
    assert out.dtype == torch.float32 and out.shape == exact.shape
    assert ((out.double() - exact).abs() <= gamma(in_features + 1) * magnitude).all()


def test_a_row_s_outputs_do_not_depend_on_its_batch() -> None:
    """Alone, among 2, among 33 or among 600, and at any offset: the same bits (each output's
    operations are fixed whatever the tile and the thread that computes it)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(600, 576, generator=gen)
    weight = torch.randn(1539, 576, generator=gen)
    whole = float_linear(x, weight, None)
    for first, count in ((0, 1), (0, 2), (7, 33), (599, 1), (100, 500)):
        assert torch.equal(float_linear(x[first:first + count], weight, None), whole[first:first + count])


def test_wrong_operands_are_refused_with_the_reason() -> None:
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="float32 x and weight"):
        float_linear(x.double(), w.double(), None)
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and weight \[N, K\]"):
        float_linear(x, torch.randn(4, 9), None)
    with pytest.raises(RuntimeError, match="rows must be contiguous"):
        float_linear(x, torch.randn(8, 4).t(), None)
    with pytest.raises(RuntimeError, match=r"bias \[4\]"):
        float_linear(x, w, torch.randn(5))


def test_a_float32_step_routes_few_rows_to_the_kernel_and_the_rest_to_torch() -> None:
    """Up to `MAX_ROWS_FLOAT` rows without a gradient: the kernel's bits (more rows: `test_float_gemm`);
    a recorded gradient or a bf16 projection: torch's."""
    torch.manual_seed(0)
    layer = Linear(96, 40)
    most = products.MAX_ROWS_FLOAT
    with torch.no_grad():
        for rows in (1, most):
            x = torch.randn(1, rows, 96)
            with cpu_routes.routed_step(rows, on=True, products_only=True, float32=True):
                got = layer(x)
            kernel = float_linear(x[0], layer.weight, layer.bias)[None]
            torch_s = torch.nn.functional.linear(x, layer.weight, layer.bias)
            assert torch.equal(got, kernel)
            torch.testing.assert_close(kernel, torch_s, rtol=0, atol=gamma(97) * float((x.abs() @ layer.weight.abs().t()
                                                                                    + layer.bias.abs()).max()))
        assert products.float_rows(torch.randn(2, 96).bfloat16(), layer.weight.bfloat16(), None) is None
    x = torch.randn(2, 96, requires_grad=True)
    with cpu_routes.routed_step(2, on=True, products_only=True, float32=True):
        layer(x).sum().backward()  # torch's product: it has a backward
    assert x.grad is not None
