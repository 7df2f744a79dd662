"""GGUF products with 8-bit activations, as llama.cpp computes them (`kernels/csrc/gguf_int8_dot.cpp`):
the activation blocks against llama.cpp's x86 quantization rule computed here in numpy float32, and every
product against the same formula summed in float64 by hand (integer block sums exact, the scales the
halves the blocks store), on random blocks and rows; and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrl.kernels import ops
from tests.test_gguf_linear import random_blocks

pytestmark = pytest.mark.isa  # the integer dot product follows the CPU class (VNNI, AVX2, none)

TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)
OFFSETS = {Q.Q4_0: 8, Q.Q5_0: 16}  # the integer taken off each stored value


@pytest.fixture(autouse=True, scope="module")
def kernels() -> None:
    assert ops.available()


def activation_blocks(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """llama.cpp's x86 `quantize_row_q8_0` / `quantize_row_q8_1`, in float32 as it computes: per 32
    values amax, d = amax / 127, q = round-half-even(x * (127 / amax)), d and s = d * sum(q) as halves."""
    x = np.asarray(x, np.float32).reshape(x.shape[0], -1, 32)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    d = amax / np.float32(127)
    with np.errstate(divide="ignore"):
        inverse = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.rint(x * inverse).astype(np.int8)
    s = d[..., 0] * q.sum(-1, dtype=np.int32).astype(np.float32)
    widen = lambda v: v.astype(np.float16).astype(np.float32)  # noqa: E731
    return q.reshape(x.shape[0], -1), widen(d[..., 0]), widen(s)


def weight_parts(raw: np.ndarray, qtype: Q, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A weight's blocks read as integers: values [N, k] (int64; Q4_0's already less 8, Q5_0's less 16), dw
    and mw [N, k / 32]. Q5_0 / Q5_1: bit i of the block's 32-bit `qh` is value i's fifth."""
    n, blocks = raw.shape[0], k // 32
    b = raw.reshape(n, blocks, -1)
    half = lambda at: b[:, :, at:at + 2].copy().view(np.float16)[..., 0].astype(np.float64)  # noqa: E731
    if qtype == Q.Q8_0:
        return b[:, :, 2:].view(np.int8).astype(np.int64).reshape(n, k), half(0), np.zeros((n, blocks))
    head = 2 if qtype in (Q.Q4_0, Q.Q5_0) else 4  # past the scale (and the minimum)
    fifth = qtype in (Q.Q5_0, Q.Q5_1)
    q = b[:, :, head + 4 * fifth:]
    values = np.concatenate([q & 15, q >> 4], axis=-1).astype(np.int64)
    if fifth:
        qh = b[:, :, head:head + 4].copy().view(np.uint32)[..., 0].astype(np.int64)
        values |= ((qh[..., None] >> np.arange(32)) & 1) << 4
    values -= OFFSETS.get(qtype, 0)
    minimum = half(2) if qtype in (Q.Q4_1, Q.Q5_1) else np.zeros((n, blocks))
    return values.reshape(n, k), half(0), minimum


def by_hand(x: np.ndarray, raw: np.ndarray, qtype: Q, bias: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The product in float64 (each block's integer sum exact), and a bound on the magnitudes a float32 sum
    of it adds (what rounding can be off by, in units of float32's epsilon per term): a block's integer sum
    reaches float32 as partial sums of a few products each, so its products' magnitudes, not the sum's,
    bound the scaled partials (Q4_0's offset 8 * sum(q) among them)."""
    k = x.shape[1]
    q, d, s = activation_blocks(x)
    w, dw, mw = weight_parts(raw, qtype, k)
    rows = lambda v: v.astype(np.int64).reshape(len(v), -1, 32)  # noqa: E731
    sums = np.einsum("mbi,nbi->mnb", rows(q), rows(w))
    sizes = np.einsum("mbi,nbi->mnb", np.abs(rows(q)), np.abs(rows(w)) + OFFSETS.get(qtype, 0))
    scale = np.abs(dw[None] * d[:, None].astype(np.float64))
    minimum = mw[None] * s[:, None].astype(np.float64)
    out = (dw[None] * d[:, None] * sums + minimum).sum(-1) + (0 if bias is None else bias.astype(np.float64))
    return out, (scale * sizes + np.abs(minimum)).sum(-1) + (0 if bias is None else np.abs(bias))


def activation_rows(rng: np.random.Generator, rows: int, k: int) -> np.ndarray:
    """Rows of assorted scales, with a block of zeros and a block whose values sit on rounding ties."""
    x = (rng.standard_normal((rows, k)) * rng.choice([1e-3, 1.0, 30.0], size=(rows, 1))).astype(np.float32)
    x[0, :32] = 0
    if k >= 64:  # amax 127: x * 1 exactly, so the halves round to even
        x[-1, 32:64] = np.float32([127, -127] + [v + 0.5 for v in range(-15, 15)])
    return x


@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(TYPES), rows=st.integers(1, 27), out_features=st.integers(1, 13),
       blocks=st.integers(1, 6), bias=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_the_product_is_the_formula_summed_by_hand(qtype, rows, out_features, blocks, bias, seed) -> None:
    rng = np.random.default_rng(seed)
    k = 32 * blocks
    raw = random_blocks(qtype, out_features, blocks, rng, edges=False)
    if qtype == Q.Q8_0:  # -128, the one byte whose magnitude needs the ninth bit
        raw.reshape(out_features, blocks, -1)[0, 0, 2] = 0x80
    x = activation_rows(rng, rows, k)
    b = rng.standard_normal(out_features).astype(np.float32) if bias else None
    assert_the_hand_sum(x, raw, qtype, b, by_hand, blocks)


def assert_the_hand_sum(x: np.ndarray, raw: np.ndarray, qtype: Q, b: np.ndarray | None, hand, blocks: int) -> None:  # noqa: ANN001
    """`gguf_linear_int8` of `x` and the weight `raw` within float32 rounding of `hand`'s float64 sum: 4 ulps
    of the magnitudes it adds, per block and for the last two additions."""
    got = ops.gguf_linear_int8(torch.from_numpy(x), torch.from_numpy(raw), int(qtype), x.shape[1],
                               None if b is None else torch.from_numpy(b)).numpy()
    want, scale = hand(x, raw, qtype, b)
    assert got.shape == (x.shape[0], raw.shape[0])
    bound = 4 * np.finfo(np.float32).eps * (blocks + 2) * scale + np.finfo(np.float32).tiny
    assert (np.abs(got - want) <= bound).all(), np.abs(got - want).max()


@settings(max_examples=25, deadline=None)
@given(qtypes=st.lists(st.sampled_from(TYPES), min_size=1, max_size=3), rows=st.integers(0, 20),
       out_features=st.lists(st.integers(1, 40), min_size=3, max_size=3), seed=st.integers(0, 2**32 - 1))
def test_several_weights_in_one_call_are_each_weight_s_own_call(qtypes, rows, out_features, seed) -> None:
    """`gguf_linear_int8_many` (a layer's q, k and v in one call) gives each weight's own call bit for bit,
    whatever the types, row counts (one row: the prefetch into the next weight) and biases."""
    rng = np.random.default_rng(seed)
    k = 96
    weights = [torch.from_numpy(random_blocks(q, n, k // 32, rng, edges=False))
               for q, n in zip(qtypes, out_features, strict=False)]
    biases = [torch.from_numpy(rng.standard_normal(w.shape[0]).astype(np.float32)) if i % 2 else None
              for i, w in enumerate(weights)]
    x = torch.from_numpy(activation_rows(rng, rows, k)) if rows else torch.zeros(0, k)
    many = ops.gguf_linear_int8_many(x, weights, [int(q) for q in qtypes], k, biases)
    assert len(many) == len(weights)
    for got, w, q, b in zip(many, weights, qtypes, biases, strict=True):
        assert torch.equal(got, ops.gguf_linear_int8(x, w, int(q), k, b))
    with pytest.raises(RuntimeError, match=r"gguf_linear_int8_many: 1 weights, 2 types and 1 biases"):
        ops.gguf_linear_int8_many(x, weights[:1], [8, 8], k, [None])


@pytest.mark.parametrize("qtype", TYPES)
def test_the_hand_reading_of_the_blocks_is_gguf_s(qtype) -> None:
    """The integers and scales the hand sums read (`weight_parts`) make gguf's own dequantized values."""
    import gguf

    raw = random_blocks(qtype, 5, 3, np.random.default_rng(int(qtype)), edges=False)
    w, dw, mw = weight_parts(raw, qtype, 96)
    values = (w.reshape(5, 3, 32) * dw[..., None] + mw[..., None]).reshape(5, 96)
    assert np.array_equal(values.astype(np.float32), gguf.quants.dequantize(raw, qtype).reshape(5, 96))


def test_activation_blocks_follow_llama_cpp_s_rule() -> None:
    rng = np.random.default_rng(3)
    x = activation_rows(rng, 5, 96)
    q, d, s = (t.numpy() for t in ops.gguf_quantize_activations(torch.from_numpy(x)))
    want_q, want_d, want_s = activation_blocks(x)
    assert (q == want_q).all() and (d == want_d).all() and (s == want_s).all()
    assert (q[0, :32] == 0).all() and (d[0, 0] == 0)  # a zero block: scale 0, values 0
    assert list(q[-1, 32:40]) == [127, -127, -14, -14, -12, -12, -10, -10]  # halves to even


def test_the_product_is_close_to_the_float_product() -> None:
    """8-bit activations cost accuracy within their rounding: relative error of the products about 1/127."""
    rng = np.random.default_rng(5)
    raw = random_blocks(Q.Q4_1, 64, 18, rng, edges=False)
    x = rng.standard_normal((4, 576)).astype(np.float32)
    exact = torch.from_numpy(x) @ ops.gguf_dequantize(torch.from_numpy(raw), int(Q.Q4_1), 576).T
    got = ops.gguf_linear_int8(torch.from_numpy(x), torch.from_numpy(raw), int(Q.Q4_1), 576, None)
    assert 0 < (got - exact).norm() / exact.norm() < 0.02


def test_wrong_operands_are_refused_with_the_reason() -> None:
    x, raw = torch.zeros(2, 64), torch.zeros(3, 68, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=r"GGML type 10 has no int8 activation product; supported: Q8_0"):
        ops.gguf_linear_int8(x, raw, 10, 64, None)
    with pytest.raises(RuntimeError, match=r"rows of K = 64 values take 40 bytes, got 68"):
        ops.gguf_linear_int8(x, raw, int(Q.Q4_1), 64, None)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[M, 64\]"):
        ops.gguf_linear_int8(x.double(), torch.zeros(3, 68, dtype=torch.uint8), int(Q.Q8_0), 64, None)
