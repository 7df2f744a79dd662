"""The `rows8` layout of Q4_0 / Q4_1 / Q5_0 / Q5_1 weights on 8-bit activations (`kernels/csrc/gguf_int8_rows8.h`,
`model/gguf_rows8.pack_rows8`): the same bytes moved, to the places the layout states and back; its
products against the hand sums of `test_gguf_int8`, and against the file layout's own kernels: the same
bits where it goes through them (rows in lane groups), each row its own one-row product where it does not
(a decode step's few rows); the refusals."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrl.kernels import ops
from pagedrl.model.gguf_modules import GGUFLinear
from pagedrl.model.gguf_rows8 import ROWS8, pack_rows8, unpack_rows8
from tests.test_gguf_int8 import activation_blocks, activation_rows, by_hand, weight_parts
from tests.test_gguf_linear import random_blocks

pytestmark = pytest.mark.isa  # the group steps follow the CPU class (AVX512-VNNI, AVX2, none)

TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1)


@pytest.fixture(autouse=True, scope="module")
def kernels() -> None:
    assert ops.available()


@settings(max_examples=30, deadline=None)
@given(qtype=st.sampled_from(TYPES), groups=st.integers(1, 3), blocks=st.integers(1, 6), data=st.data())
def test_packing_moves_each_byte_to_its_stated_place_and_back(qtype, groups, blocks, data) -> None:
    raw = torch.from_numpy(random_blocks(qtype, 8 * groups, blocks, np.random.default_rng(blocks), edges=True))
    packed = pack_rows8(raw, qtype)
    assert packed.shape == raw.shape and torch.equal(unpack_rows8(packed, qtype), raw)
    g, r, b = (data.draw(st.integers(0, n - 1)) for n in (groups, 8, blocks))
    size = raw.shape[1] // blocks
    block = raw[8 * g + r, b * size:(b + 1) * size]
    step = packed[8 * g:8 * g + 8].reshape(-1)[b * 8 * size:(b + 1) * 8 * size]  # block b of the group's 8 rows
    fields = [2, 2] if qtype in (Q.Q4_1, Q.Q5_1) else [2]  # the scale (and minimum) halves
    fields += [4] if qtype in (Q.Q5_0, Q.Q5_1) else []  # the fifth bits
    at = 0
    for width in fields:  # each field of the 8 rows side by side, in the block's order
        assert torch.equal(step[8 * at + width * r:8 * at + width * (r + 1)], block[at:at + width])
        at += width
    for c in range(4):  # then the nibbles, chunk by chunk, the 8 rows' 4 bytes each
        assert torch.equal(step[8 * at + 32 * c + 4 * r:8 * at + 32 * c + 4 * r + 4], block[at + 4 * c:at + 4 * c + 4])


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(TYPES), rows=st.integers(1, 40), groups=st.integers(1, 3), blocks=st.integers(1, 6),
       bias=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_products_are_the_hand_sums_and_the_file_layout_s(qtype, rows, groups, blocks, bias, seed) -> None:
    """Any row count: within float32 rounding of the hand sum. Up to 24 rows (the group steps on every CPU
    class): `in_block_order` bit for bit, so each row its own one-row product's bits; more (AVX2's group
    steps, or AVX512-VNNI's lane groups over the unpacked rows): that, or the file layout's bits."""
    rng = np.random.default_rng(seed)
    k, n = 32 * blocks, 8 * groups
    raw = random_blocks(qtype, n, blocks, rng, edges=False)
    x = activation_rows(rng, rows, k)
    b = rng.standard_normal(n).astype(np.float32) if bias else None
    tb = None if b is None else torch.from_numpy(b)
    packed = pack_rows8(torch.from_numpy(raw), qtype)
    got = ops.gguf_linear_int8(torch.from_numpy(x), packed, int(qtype) + ROWS8, k, tb)
    want, scale = by_hand(x, raw, qtype, b)
    bound = 4 * np.finfo(np.float32).eps * (blocks + 2) * scale + np.finfo(np.float32).tiny
    assert (np.abs(got.numpy() - want) <= bound).all(), np.abs(got.numpy() - want).max()
    steps = in_block_order(x, raw, qtype) + (np.float32(0) if b is None else b)
    if rows <= 24:
        assert np.array_equal(got.numpy(), steps)
    else:
        assert np.array_equal(got.numpy(), steps) or torch.equal(
            got, ops.gguf_linear_int8(torch.from_numpy(x), torch.from_numpy(raw), int(qtype), k, tb))


def in_block_order(x: np.ndarray, raw: np.ndarray, qtype: Q) -> np.ndarray:
    """The group step's arithmetic, in numpy: per row and block the exact integer sum, times the float32
    product dw * dx, added to the row's float32 sum by a fused multiply-add (exact in float64, then
    rounded), blocks in order; the minimum terms mw * s likewise in a sum of their own; then the two added."""
    k = x.shape[1]
    q, d, s = activation_blocks(x)
    w, dw, mw = weight_parts(raw, qtype, k)
    sums = np.einsum("mbi,nbi->mnb", q.astype(np.int64).reshape(len(q), -1, 32), w.reshape(len(w), -1, 32))
    f32 = np.float32
    out = np.zeros((len(x), len(raw)), np.float32)
    for m in range(len(x)):
        for n in range(len(raw)):
            acc = minimum = f32(0)
            for b in range(k // 32):
                scale = f32(f32(dw[n, b]) * d[m, b])
                acc = f32(np.float64(scale) * np.float64(sums[m, n, b]) + np.float64(acc))
                minimum = f32(np.float64(f32(mw[n, b])) * np.float64(s[m, b]) + np.float64(minimum))
            out[m, n] = f32(acc + minimum)
    return out


@settings(max_examples=20, deadline=None)
@given(qtype=st.sampled_from(TYPES), rows=st.integers(1, 2), blocks=st.integers(1, 5), seed=st.integers(0, 2**32 - 1))
def test_a_decode_step_s_products_are_the_same_bits_on_every_cpu_class(qtype, rows, blocks, seed) -> None:
    """The group steps (AVX512-VNNI and AVX2 alike) compute `in_block_order`, bit for bit."""
    rng = np.random.default_rng(seed)
    raw = random_blocks(qtype, 8, blocks, rng, edges=False)
    x = activation_rows(rng, rows, 32 * blocks)
    got = ops.gguf_linear_int8(torch.from_numpy(x), pack_rows8(torch.from_numpy(raw), qtype), int(qtype) + ROWS8,
                               32 * blocks, None)
    assert np.array_equal(got.numpy(), in_block_order(x, raw, qtype))


def test_a_block_too_small_to_scale_is_zeros() -> None:
    """amax below ~3.7e-37: 127 / amax overflows; the block's values are 0 (its scale is a half 0 either way)."""
    x = torch.zeros(1, 64)
    x[0, :3] = torch.tensor([1e-37, -5e-38, 2e-38])
    x[0, 32:] = 1.0
    q, d, s = ops.gguf_quantize_activations(x)
    assert (q[0, :32] == 0).all() and d[0, 0] == 0 and s[0, 0] == 0
    assert (q[0, 32:] == 127).all() and d[0, 1] == torch.tensor(1 / 127).half().float()


def test_several_weights_in_one_call_mix_the_layouts() -> None:
    rng = np.random.default_rng(7)
    weights = [torch.from_numpy(random_blocks(q, n, 3, rng, edges=False)) for q, n in
               ((Q.Q4_1, 16), (Q.Q8_0, 12), (Q.Q4_0, 8))]
    weights[0], weights[2] = pack_rows8(weights[0], Q.Q4_1), pack_rows8(weights[2], Q.Q4_0)
    types = [int(Q.Q4_1) + ROWS8, int(Q.Q8_0), int(Q.Q4_0) + ROWS8]
    x = torch.from_numpy(activation_rows(rng, 1, 96))
    for got, w, t in zip(ops.gguf_linear_int8_many(x, weights, types, 96, [None] * 3), weights, types, strict=True):
        assert torch.equal(got, ops.gguf_linear_int8(x, w, t, 96, None))


@pytest.mark.parametrize(("qtype", "k"), [(Q.Q4_1, 64), (Q.Q5_K, 512)])
def test_a_module_keeps_its_weight_through_the_layout(qtype, k) -> None:
    values = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = torch.from_numpy(random_blocks(qtype, 16, k // values, np.random.default_rng(1), edges=False).reshape(16, -1))
    module = GGUFLinear(raw.clone(), int(qtype), k)
    before = module.dequantized()
    module.to_rows8()
    assert module.rows8 and module.kernel_type == int(qtype) + ROWS8 and "layout=rows8" in repr(module)
    assert not torch.equal(module.qweight, raw) and torch.equal(module.blocks, raw)
    assert torch.equal(module.dequantized(), before)
    with pytest.raises(ValueError, match=r"the rows8 layout holds Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K weights of a "
                                         r"multiple of 8 rows, not Q8_0 \[12, 96\]"):
        GGUFLinear(torch.from_numpy(random_blocks(Q.Q8_0, 12, 3, np.random.default_rng(2), edges=False)),
                   int(Q.Q8_0), 96).to_rows8()


def test_wrong_layouts_are_refused_with_the_reason() -> None:
    x = torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match=r"the rows8 layout holds Q4_0, Q4_1, Q5_0, Q5_1, Q4_K or Q5_K weights of a "
                                           r"multiple of 8 contiguous rows, got type 8 with 8 rows"):
        ops.gguf_linear_int8(x, torch.zeros(8, 68, dtype=torch.uint8), int(Q.Q8_0) + ROWS8, 64, None)
    with pytest.raises(RuntimeError, match=r"got type 3 with 12 rows"):
        ops.gguf_linear_int8(x, torch.zeros(12, 40, dtype=torch.uint8), int(Q.Q4_1) + ROWS8, 64, None)
    with pytest.raises(RuntimeError, match=r"the rows8 layout holds .* weights of a multiple of 8 contiguous rows, "
                                           r"got Q6_K with 8 rows"):  # the K-quants' own check
        ops.gguf_linear_int8(torch.zeros(1, 256), torch.zeros(8, 210, dtype=torch.uint8), int(Q.Q6_K) + ROWS8, 256, None)


def test_a_table_an_embedding_reads_keeps_the_file_layout() -> None:
    """`use_int8_activations` moves the projections to the layout, but not a tied LM head: its blocks are
    also the embedding's table, whose lookups read rows in the file's layout."""
    from torch import nn

    from pagedrl.model.gguf_modules import GGUFEmbedding, use_int8_activations

    rng = np.random.default_rng(3)
    model = nn.Module()
    model.embed = GGUFEmbedding(torch.from_numpy(random_blocks(Q.Q4_1, 16, 2, rng, edges=False)), int(Q.Q4_1), 64)
    model.lm_head = GGUFLinear(model.embed.table.qweight, int(Q.Q4_1), 64)
    model.proj = GGUFLinear(torch.from_numpy(random_blocks(Q.Q5_0, 24, 2, rng, edges=False)), int(Q.Q5_0), 64)
    rows = model.embed(torch.arange(16))
    assert use_int8_activations(model) == {"Q4_1": 1, "Q5_0": 1}
    assert model.lm_head.int8_activations and not model.lm_head.rows8 and model.proj.rows8
    assert torch.equal(model.embed(torch.arange(16)), rows)
