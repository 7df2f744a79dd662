"""GGUF weights kept quantized (`kernels/csrc/gguf_linear.cpp`): every dequantized value the bits of
`gguf.quants.dequantize` (the package's own numpy code is the oracle), on random blocks with edge scales
and on the default model's tensors; every product the bits of `float_linear` on the dequantized weight,
for any number of rows; and its refusals."""

from __future__ import annotations

import functools

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrl.kernels import ops

pytestmark = pytest.mark.isa  # the product's lanes follow the CPU class: `make test-isa` runs it as each lower one

TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4)
SCALE_OFFSETS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q4_K: (0, 2),
                 Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.MXFP4: ()}  # (MXFP4's scale is a byte: `random_blocks`)
# Half-precision scales at the edges: ±0, the smallest and largest subnormals, the largest finite, ±inf, NaN.
EDGE_HALVES = (0x0000, 0x8000, 0x0001, 0x83FF, 0x03FF, 0x7BFF, 0xBC00, 0x7C00, 0xFC00, 0x7E00, 0xFE01)


@pytest.fixture(autouse=True, scope="module")
def kernels() -> None:
    assert ops.available()


def same_bits(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> bool:
    """Equal as float32 bit patterns, -0 apart from +0; a NaN only where the other has one. Which of two
    NaNs an addition returns follows its operands' order in the instruction, which a compiler may swap
    (a + b is a + b), so a NaN's payload is not part of the contract."""
    a32, b32 = np.ascontiguousarray(np.asarray(a, np.float32)), np.ascontiguousarray(np.asarray(b, np.float32))
    if a32.shape != b32.shape:
        return False
    nan_a, nan_b = np.isnan(a32), np.isnan(b32)
    return bool((nan_a == nan_b).all() and (a32.view(np.uint32)[~nan_a] == b32.view(np.uint32)[~nan_b]).all())


def random_blocks(qtype: Q, rows: int, blocks: int, rng: np.random.Generator, edges: bool) -> np.ndarray:
    """Random bytes in GGUF's layout; with `edges`, each block's scales drawn from EDGE_HALVES, else small
    finite halves (products that stay finite)."""
    _, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, blocks, type_size), dtype=np.uint8)
    for offset in SCALE_OFFSETS[qtype]:
        if edges:
            halves = rng.choice(np.array(EDGE_HALVES, np.uint16), size=(rows, blocks))
        else:
            halves = rng.uniform(-0.05, 0.05, size=(rows, blocks)).astype(np.float16).view(np.uint16)
        raw[:, :, offset:offset + 2] = halves[..., None].view(np.uint8).reshape(rows, blocks, 2)
    if qtype == Q.MXFP4:  # an E8M0 byte: any (subnormal to inf) at the edges, else 2^-10 to 2^1
        raw[:, :, 0] = rng.integers(0, 256, size=(rows, blocks)) if edges else rng.integers(118, 130, size=(rows, blocks))
    return raw.reshape(rows, blocks * type_size)


def oracle(raw: np.ndarray, qtype: Q) -> np.ndarray:
    with np.errstate(all="ignore"):  # inf and NaN scales propagate, as they should
        return gguf.quants.dequantize(raw, qtype).reshape(raw.shape[0], -1)


@settings(max_examples=80, deadline=None)
@given(qtype=st.sampled_from(TYPES), rows=st.integers(1, 9), blocks=st.integers(1, 4), edges=st.booleans(),
       seed=st.integers(0, 2**32 - 1))
def test_random_blocks_dequantize_to_gguf_s_bits(qtype, rows, blocks, edges, seed) -> None:
    """Any bytes: every value as gguf's numpy computes it (half scales widened exactly, subnormals
    included; a product and a sum each rounded; ±0 kept; inf and NaN scales propagated alike)."""
    raw = random_blocks(qtype, rows, blocks, np.random.default_rng(seed), edges)
    k = blocks * GGML_QUANT_SIZES[qtype][0]
    assert same_bits(ops.gguf_dequantize(torch.from_numpy(raw), int(qtype), k), oracle(raw, qtype))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_edge_scale_in_every_position(qtype) -> None:
    """Each edge half as every scale of a block against every quant byte value (a sweep, not a draw)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(int(qtype))
    raw = rng.integers(0, 256, size=(len(EDGE_HALVES) ** 2, type_size), dtype=np.uint8)
    offsets = SCALE_OFFSETS[qtype]
    for i, (a, b) in enumerate((a, b) for a in EDGE_HALVES for b in EDGE_HALVES):
        for offset, half in zip(offsets, (a, b), strict=False):
            raw[i, offset:offset + 2] = np.array([half], np.uint16).view(np.uint8)
    assert same_bits(ops.gguf_dequantize(torch.from_numpy(raw), int(qtype), block_size), oracle(raw, qtype))


@functools.cache
def default_model_tensors() -> list[gguf.ReaderTensor]:
    from pagedrl.model.default import default_gguf_path

    try:
        path = default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return [t for t in gguf.GGUFReader(path).tensors if t.tensor_type in TYPES]


def test_the_default_model_s_tensors_dequantize_to_gguf_s_bits() -> None:
    """Every quantized tensor of the default model (its Q4_1 projections, its Q8_0 embedding), and the
    embedding's float weights quantized to Q8_0, Q4_0 and Q4_1 by gguf itself."""
    tensors = default_model_tensors()
    assert {t.tensor_type for t in tensors} >= {Q.Q4_1, Q.Q8_0}
    for t in tensors:
        raw = np.array(t.data)  # a writable copy of the mapped file
        k = int(t.shape[0])
        assert same_bits(ops.gguf_dequantize(torch.from_numpy(raw), int(t.tensor_type), k), oracle(raw, t.tensor_type)), t.name
    embedding = next(t for t in tensors if t.name == "token_embd.weight")
    weights = oracle(np.asarray(embedding.data[:4096]), embedding.tensor_type)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        raw = gguf.quants.quantize(weights, qtype)
        assert same_bits(ops.gguf_dequantize(torch.from_numpy(raw), int(qtype), weights.shape[1]), oracle(raw, qtype))


@settings(max_examples=60, deadline=None)
@given(qtype=st.sampled_from(TYPES), rows=st.integers(1, 40), out_features=st.integers(1, 40),
       blocks=st.sampled_from([1, 3, 5, 7]), bias=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_the_product_is_float_linear_s_on_the_dequantized_weight(qtype, rows, out_features, blocks, bias,
                                                                 seed) -> None:
    """The same float32 number for every output: one row, a pair, the many-row path (weight rows
    dequantized once per tile), every weight-row count past a tile, odd numbers of blocks (K is a
    multiple of 32, so a multiple of the lanes: no tail), with a bias and without."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, out_features, blocks, rng, edges=False)
    k = blocks * GGML_QUANT_SIZES[qtype][0]
    x = torch.from_numpy(rng.standard_normal((rows, k), dtype=np.float32))
    b = torch.from_numpy(rng.standard_normal(out_features, dtype=np.float32)) if bias else None
    weight = torch.from_numpy(oracle(raw, qtype))
    assert same_bits(ops.gguf_linear(x, torch.from_numpy(raw), int(qtype), k, b), ops.float_linear(x, weight, b))


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 33])
def test_the_default_model_s_projections_give_float_linear_s_bits(rows) -> None:
    """Layer 0's seven Q4_1 projections and a slice of the Q8_0 embedding (as a tied output head), on
    both threads' shares of the rows."""
    gen = torch.Generator().manual_seed(rows)
    tensors = [t for t in default_model_tensors() if t.name.startswith("blk.0.")]
    tensors.append(next(t for t in default_model_tensors() if t.name == "token_embd.weight"))
    for t in tensors:
        raw = torch.from_numpy(np.array(t.data[:2048]))
        k = int(t.shape[0])
        x = torch.randn(rows, k, generator=gen)
        weight = ops.gguf_dequantize(raw, int(t.tensor_type), k)
        assert same_bits(ops.gguf_linear(x, raw, int(t.tensor_type), k, None), ops.float_linear(x, weight, None)), t.name


def test_a_row_s_outputs_do_not_depend_on_its_batch() -> None:
    raw = torch.from_numpy(random_blocks(Q.Q4_1, 77, 18, np.random.default_rng(5), edges=False))
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(5))
    whole = ops.gguf_linear(x, raw, int(Q.Q4_1), 576, None)
    for first, count in ((0, 1), (0, 2), (3, 3), (7, 33), (39, 1)):
        assert same_bits(ops.gguf_linear(x[first:first + count], raw, int(Q.Q4_1), 576, None), whole[first:first + count])


def test_wrong_operands_are_refused_with_the_reason() -> None:
    raw = torch.zeros(4, 40, dtype=torch.uint8)  # 4 rows of two Q4_1 blocks: K = 64
    x = torch.randn(3, 64)
    with pytest.raises(RuntimeError, match=r"GGML type 10 \(Q2_K\) is not supported; supported: Q8_0 \(8\), Q4_0"):
        ops.gguf_linear(x, raw, int(Q.Q2_K), 64, None)
    with pytest.raises(RuntimeError, match=r"GGML type 99 \(unknown\) is not supported; supported: Q8_0"):
        ops.gguf_dequantize(raw, 99, 64)
    with pytest.raises(RuntimeError, match=r"K = 48 is not a positive multiple of Q4_1's block of 32 values"):
        ops.gguf_dequantize(raw, int(Q.Q4_1), 48)
    with pytest.raises(RuntimeError, match=r"Q4_1 rows of K = 96 values take 60 bytes, got 40"):
        ops.gguf_linear(torch.randn(3, 96), raw, int(Q.Q4_1), 96, None)
    with pytest.raises(RuntimeError, match=r"blocks must be uint8 \[N, row_bytes\]"):
        ops.gguf_dequantize(raw.float(), int(Q.Q4_1), 64)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[M, 64\]"):
        ops.gguf_linear(torch.randn(3, 32), raw, int(Q.Q4_1), 64, None)
    with pytest.raises(RuntimeError, match=r"x must be float32 \[M, 64\]"):
        ops.gguf_linear(x.double(), raw, int(Q.Q4_1), 64, None)
    with pytest.raises(RuntimeError, match=r"float32 bias \[4\] expected"):
        ops.gguf_linear(x, raw, int(Q.Q4_1), 64, torch.randn(5))
