"""The row-wise kernels' float32 forms (`kernels/csrc/rowwise.cpp`: RMSNorm, SiLU(gate) * up, the rotary
embedding) against float64 references, within float32's worst case for the operations each makes: a
float32 engine's steps and its decode program run them in place of the decoder's eager code."""

from __future__ import annotations

import pytest
import torch
from float_bounds import gamma
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrl.kernels import ops
from pagedrl.model.rope import apply_rope, rope_cos_sin, rope_inv_freq

pytestmark = pytest.mark.isa  # built for the CPU class: `make test-isa` runs it as each lower one

U = 2.0**-24  # float32's unit roundoff


@pytest.fixture(autouse=True, scope="module")
def kernels() -> None:
    assert ops.available()


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), dim=st.sampled_from([8, 64, 576, 100]), seed=st.integers(0, 2**16))
def test_rms_norm_within_float32_s_bound(rows, dim, seed) -> None:
    """The sum of D squares (positive terms, any order) is within gamma(D) of exact; its mean, the
    root and the reciprocal add a rounding each, the normalized value and the weight's product one
    more each: within gamma(D) / 2 + 6u relative, taken as gamma(D + 8)."""
    gen = torch.Generator().manual_seed(seed)
    weight = 1 + 0.3 * torch.randn(dim, generator=gen)
    x = 3 * torch.randn(rows, dim, generator=gen)
    got = torch.ops.pagedrl_cpu.rms_norm(x, weight, 1e-5)
    xd = x.double()
    exact = weight.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    assert got.dtype == torch.float32 and got.shape == x.shape
    assert ((got.double() - exact).abs() <= gamma(dim + 8) * exact.abs() + 1e-30).all()
    with pytest.raises(RuntimeError, match="must be contiguous bf16"):  # one dtype for both, named
        torch.ops.pagedrl_cpu.rms_norm(x, weight.bfloat16(), 1e-5)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**16))
def test_silu_mul_within_float32_s_bound(n, seed) -> None:
    """exp within 2e-7 (about 2u), 1 + e, the division, the product with the gate and the one with up:
    within 8u relative of the exact value, whatever the gate's size (-90 and 90 included). Below -87 the
    exponential is taken at -87 (float32's smallest normal is e^-87.3): |gate * up| x 1.7e-38 more."""
    gen = torch.Generator().manual_seed(seed)
    gate = 4 * torch.randn(n, generator=gen)
    gate[:3] = torch.tensor([0.0, -90.0, 90.0])[: min(3, n)]
    up = torch.randn(n, generator=gen)
    got = torch.ops.pagedrl_cpu.silu_mul(gate, up)
    g = gate.double()
    exact = g * torch.sigmoid(g) * up.double()
    assert got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= 8 * U * exact.abs() + 1.7e-38 * (g * up.double()).abs()).all()


@pytest.mark.parametrize("heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_rope_within_float32_s_bound(heads, head_dim) -> None:
    """Two products and their sum: within gamma(2) of the terms' magnitudes."""
    torch.manual_seed(0)
    tokens = 37
    positions = torch.randint(0, 5000, (1, tokens))
    cos, sin = rope_cos_sin(positions, rope_inv_freq(head_dim, 10000.0, None), torch.float32)
    q = torch.randn(1, tokens, heads[0], head_dim)
    k = torch.randn(1, tokens, heads[1], head_dim)
    got_q, got_k = torch.ops.pagedrl_cpu.rope(q, k, cos, sin)
    for x, got in ((q, got_q), (k, got_k)):
        exact = apply_rope(x.double(), cos.double(), sin.double())
        xd, half = x.double(), head_dim // 2
        swapped = torch.cat((xd[..., half:], xd[..., :half]), dim=-1)  # rotate_half without its sign
        magnitude = (xd * cos.double()[:, :, None]).abs() + (swapped * sin.double()[:, :, None]).abs()
        assert got.dtype == torch.float32 and got.shape == x.shape
        assert ((got.double() - exact).abs() <= gamma(2) * magnitude + 1e-30).all()
