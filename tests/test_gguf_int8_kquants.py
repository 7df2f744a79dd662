"""K-quant products (Q4_K, Q5_K, Q6_K) on 8-bit activations, as llama.cpp computes them
(`kernels/csrc/gguf_int8_kquants.h`): the activation blocks of 256 against llama.cpp's
`quantize_row_q8_K_ref` computed here in numpy float32, the hand reading of the weight blocks against
`gguf.quants.dequantize`, every product against the same formula summed in float64 by hand (integer sums
exact), a row's result the same bits whatever the rows beside it, and the refusals."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrl.kernels import ops
from tests.test_gguf_int8 import assert_the_hand_sum
from tests.test_gguf_linear import random_blocks

pytestmark = pytest.mark.isa  # the integer sums follow the CPU class (AVX512BW, AVX2, none)

TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
EPS = np.finfo(np.float32).eps


@pytest.fixture(autouse=True, scope="module")
def kernels() -> None:
    assert ops.available()


def super_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's `quantize_row_q8_K_ref` in float32 as it computes: per 256 values `max` the first value
    of the largest magnitude, iscale = -127 / max, q = min(127, round-half-even(iscale * x)), d = 1 / iscale,
    and each 16 values' sum; a block of zeros: d = 0, q = 0."""
    rows = np.asarray(x, np.float32).reshape(-1, 256)
    q = np.zeros(rows.shape, np.int8)
    d = np.zeros(len(rows), np.float32)
    for i, row in enumerate(rows):
        top = row[np.argmax(np.abs(row))]  # argmax: the first of equals
        if top == 0:
            continue
        iscale = np.float32(-127) / top
        q[i] = np.minimum(127, np.rint(iscale * row)).astype(np.int8)
        d[i] = np.float32(1) / iscale
    sums = q.reshape(len(rows), 16, 16).sum(-1, dtype=np.int32).astype(np.int16)
    m = x.shape[0]
    return q.reshape(m, -1), d.reshape(m, -1), sums.reshape(m, -1)


def k_parts(raw: np.ndarray, qtype: Q, k: int) -> tuple[np.ndarray, ...]:
    """A K-quant weight read as integers: unsigned values u [N, k], a scale and an offset per 16 values
    [N, k / 16] (Q4_K / Q5_K: the 6-bit scale and minimum of their 32; Q6_K: its int8 scale and 32 times
    it), and the block's d and dm [N, k / 256] (float64)."""
    n, blocks = raw.shape[0], k // 256
    b = raw.reshape(n, blocks, -1).astype(np.int64)
    half = lambda at: raw.reshape(n, blocks, -1)[:, :, at:at + 2].copy().view(np.float16)[..., 0].astype(np.float64)  # noqa: E731
    if qtype == Q.Q6_K:
        ql, qh, sc = b[..., :128], b[..., 128:192], raw.reshape(n, blocks, -1)[..., 192:208].view(np.int8).astype(np.int64)
        u = np.empty((n, blocks, 256), np.int64)
        for h in range(2):
            for s in range(4):
                lo = (ql[..., 64 * h + 32 * (s % 2):64 * h + 32 * (s % 2) + 32] >> (4 * (s // 2))) & 15
                hi = (qh[..., 32 * h:32 * h + 32] >> (2 * s)) & 3
                u[..., 128 * h + 32 * s:128 * h + 32 * s + 32] = lo | (hi << 4)
        d = half(208)
        return u.reshape(n, k), sc.reshape(n, -1), 32 * sc.reshape(n, -1), d, d
    s = b[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 2) & 0x30)], axis=-1)
    qs = b[..., 48:] if qtype == Q.Q5_K else b[..., 16:]
    u = np.empty((n, blocks, 256), np.int64)
    for c in range(4):
        for h in range(2):
            v = (qs[..., 32 * c:32 * c + 32] >> (4 * h)) & 15
            if qtype == Q.Q5_K:
                v |= ((b[..., 16:48] >> (2 * c + h)) & 1) << 4
            u[..., 64 * c + 32 * h:64 * c + 32 * h + 32] = v
    per16 = lambda v: np.repeat(v, 2, axis=-1).reshape(n, -1)  # noqa: E731
    return u.reshape(n, k), per16(sc), per16(mn), half(0), half(2)


def by_hand(x: np.ndarray, raw: np.ndarray, qtype: Q, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The product in float64 (each block's integer sums exact), and the magnitudes a float32 sum of it
    adds (what rounding can be off by, in units of float32's epsilon per term)."""
    k = x.shape[1]
    q, d, sums = super_blocks(x)
    u, scale, offset, dw, dm = k_parts(raw, qtype, k)
    groups = lambda v: v.astype(np.int64).reshape(len(v), -1, 16)  # noqa: E731
    si = np.einsum("mgi,ngi,ng->mng", groups(q), groups(u), scale).reshape(len(x), len(raw), -1, 16).sum(-1)
    size = np.einsum("mgi,ngi,ng->mng", np.abs(groups(q)), groups(u), np.abs(scale))
    so = np.einsum("mg,ng->mng", sums.astype(np.int64), offset).reshape(len(x), len(raw), -1, 16).sum(-1)
    size_o = np.einsum("mg,ng->mng", np.abs(sums.astype(np.int64)), np.abs(offset))
    size = (size + size_o).reshape(len(x), len(raw), -1, 16).sum(-1)
    dx = d.astype(np.float64)[:, None]
    out = (dw[None] * dx * si - dm[None] * dx * so).sum(-1) + (0 if bias is None else bias.astype(np.float64))
    bound = (np.abs(np.maximum(np.abs(dw), np.abs(dm))[None] * dx) * size).sum(-1)
    return out, bound + (0 if bias is None else np.abs(bias))


def activation_rows(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Rows of assorted scales, a block of zeros, and a block whose largest magnitude comes twice with
    both signs (the first one's sign is the scale's) and whose values sit on rounding ties."""
    x = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1.0, 30.0], size=(rows, 1))).astype(np.float32)
    x[0, :256] = 0
    if rows > 1:  # max = -127: iscale = 1, so the halves round to even
        x[-1, :256] = np.float32([-127, 127] + [v + 0.5 for v in range(-127, 127)])
    return x


def test_activation_blocks_follow_llama_cpp_s_rule() -> None:
    rng = np.random.default_rng(3)
    x = activation_rows(rng, 5, 512)
    q, d, sums = (t.numpy() for t in ops.gguf_quantize_activations_k(torch.from_numpy(x)))
    want_q, want_d, want_sums = super_blocks(x)
    assert (q == want_q).all() and (d == want_d).all() and (sums == want_sums).all()
    assert (q[0, :256] == 0).all() and d[0, 0] == 0  # a zero block: scale 0, values 0
    assert d[-1, 0] == 1.0  # the first of the two largest is negative: iscale = -127 / -127
    assert list(q[-1, :8]) == [-127, 127, -126, -126, -124, -124, -122, -122]  # halves to even


@pytest.mark.parametrize("qtype", TYPES)
def test_the_hand_reading_of_the_blocks_is_gguf_s(qtype) -> None:
    """The integers and scales the hand sums read (`k_parts`) make gguf's own dequantized values."""
    raw = random_blocks(qtype, 5, 2, np.random.default_rng(int(qtype)), edges=False)
    u, scale, offset, d, dm = k_parts(raw, qtype, 512)
    per_value = lambda v: np.repeat(v, 16, axis=-1)  # noqa: E731
    per_block = lambda v: np.repeat(v, 256, axis=-1)  # noqa: E731
    values = per_block(d) * per_value(scale) * u - per_block(dm) * per_value(offset)
    want = gguf.quants.dequantize(raw, qtype).reshape(5, 512).astype(np.float64)
    assert np.allclose(values, want, rtol=4 * EPS, atol=0)


@settings(max_examples=50, deadline=None)
@given(qtype=st.sampled_from(TYPES), rows=st.integers(1, 40), out_features=st.integers(1, 9),
       blocks=st.integers(1, 3), bias=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_the_product_is_the_formula_summed_by_hand(qtype, rows, out_features, blocks, bias, seed) -> None:
    rng = np.random.default_rng(seed)
    k = 256 * blocks
    raw = random_blocks(qtype, out_features, blocks, rng, edges=False)
    x = activation_rows(rng, rows, k)
    b = rng.standard_normal(out_features).astype(np.float32) if bias else None
    assert_the_hand_sum(x, raw, qtype, b, by_hand, blocks)


@settings(max_examples=15, deadline=None)
@given(rows=st.integers(64, 80), seed=st.integers(0, 2**32 - 1))
def test_a_row_is_the_same_bits_whatever_rows_share_the_call(rows, seed) -> None:
    """A row's outputs do not depend on the rows beside it, within each of the two paths: below 4 rows
    (the row-by-row product on every CPU class) a row gives the numbers it gets alone; from 32 rows (lane
    groups on every class) the numbers it gets among any other 32 or more. And a call of several weights
    (K-quants beside blocks of 32) gives each weight's own call."""
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(activation_rows(rng, rows, 512))
    qtypes = [Q.Q4_K, Q.Q8_0, Q.Q6_K, Q.Q5_K]
    weights = [torch.from_numpy(random_blocks(q, 24, 512 // gguf.GGML_QUANT_SIZES[q][0], rng, edges=False))
               for q in qtypes]
    many = ops.gguf_linear_int8_many(x, weights, [int(q) for q in qtypes], 512, [None] * 4)
    for got, w, q in zip(many, weights, qtypes, strict=True):
        assert torch.equal(got, ops.gguf_linear_int8(x, w, int(q), 512, None))
        if q in TYPES:
            product = lambda rows, w=w, q=q: ops.gguf_linear_int8(rows, w, int(q), 512, None)  # noqa: E731
            assert torch.equal(got[:32], product(x[:32])) and torch.equal(got[-33:], product(x[-33:]))
            alone = torch.cat([product(x[i:i + 1]) for i in range(3)])
            assert torch.equal(product(x[:3]), alone) and torch.equal(product(x[1:3]), alone[1:])


def test_the_product_is_close_to_the_float_product() -> None:
    """8-bit activations over 256 values cost accuracy within their rounding (about 1/127 of a block's
    largest value per value)."""
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((4, 1536)).astype(np.float32))
    for qtype in TYPES:
        raw = torch.from_numpy(random_blocks(qtype, 64, 6, rng, edges=False))
        exact = x @ ops.gguf_dequantize(raw, int(qtype), 1536).T
        got = ops.gguf_linear_int8(x, raw, int(qtype), 1536, None)
        assert 0 < (got - exact).norm() / exact.norm() < 0.02


def test_wrong_operands_are_refused_with_the_reason() -> None:
    with pytest.raises(RuntimeError, match=r"Q4_K rows hold blocks of 256 values; K = 288 is not a multiple of 256"):
        ops.gguf_linear_int8(torch.zeros(2, 288), torch.zeros(3, 162, dtype=torch.uint8), int(Q.Q4_K), 288, None)
    with pytest.raises(RuntimeError, match=r"rows of K = 512 values take 420 bytes, got 416"):
        ops.gguf_linear_int8(torch.zeros(2, 512), torch.zeros(3, 416, dtype=torch.uint8), int(Q.Q6_K), 512, None)
    with pytest.raises(RuntimeError, match=r"GGML type 11 has no int8 activation product; supported: .*Q6_K \(14\)"):
        ops.gguf_linear_int8(torch.zeros(2, 256), torch.zeros(3, 110, dtype=torch.uint8), 11, 256, None)
    with pytest.raises(RuntimeError, match=r"K a multiple of 256"):
        ops.gguf_quantize_activations_k(torch.zeros(2, 96))


@pytest.mark.parametrize("qtype", TYPES)
def test_extreme_blocks_and_activations(qtype) -> None:
    """The largest integer sums a block can hold (every value at its top, Q6_K scales at -128 and 127,
    activations at ±127) stay exact; a NaN activation counts 0 (llama.cpp's rounding gives it 0) and a
    block too small for its scale (largest magnitude 1e-38) is a block of zeros, on every CPU class."""
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    raw = np.full((3, 2, size), 0xFF, np.uint8)
    half = np.array([0.01], np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        raw[0, :, 192:208], raw[1, :, 192:208] = 0x80, 0x7F  # scales -128 and 127, every value 63
        raw[2, :, 192:208], raw[2, :, :192] = 0x80, 0  # every value 0: -32 * -128
        raw[:, :, 208:210] = half
    else:
        raw[:, :, 0:2], raw[:, :, 2:4] = half, half
        raw[2, :, 16:] = 0  # values 0: only the minimums
    raw = raw.reshape(3, -1)
    x = np.tile(np.float32([-1, 1]), (4, 256))  # q = -127, +127 in turn (iscale = -127 / -1)
    x[1] = -1
    x[2, 3] = np.nan
    x[3, :256] = 1e-38
    x = np.tile(x, (10, 1))  # 40 rows: the lane groups too
    got = ops.gguf_linear_int8(torch.from_numpy(x), torch.from_numpy(raw), int(qtype), 512, None).numpy()
    q, d, _ = (t.numpy() for t in ops.gguf_quantize_activations_k(torch.from_numpy(x)))
    assert q[2, 3] == 0 and q[2, 2] == -127 and (q[3, :256] == 0).all() and d[3, 0] == 0
    x[2::4, 3] = 0  # what the NaN counts as
    x[3::4, :256] = 0
    want, scale = by_hand(x, raw, qtype, None)
    assert np.isfinite(got).all()
    assert (np.abs(got - want) <= 4 * EPS * 4 * scale + np.finfo(np.float32).tiny).all()
