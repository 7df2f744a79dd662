"""The `rows8` layout of Q4_K / Q5_K weights on 8-bit activations
(`kernels/csrc/gguf_int8_krows8.h`, `model/gguf_rows8.pack_rows8`): each byte (each 6-bit scale and
minimum) moved to the place the layout states and back; its products against the hand sums of
`test_gguf_int8_kquants` and, bit for bit, against the file layout's lane groups at every row count; the
largest sums (the refusals: `test_gguf_rows8`)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrl.kernels import ops
from pagedrl.model import gguf_dequant
from pagedrl.model.gguf_rows8 import ROWS8, pack_rows8, unpack_rows8
from tests.test_gguf_int8 import assert_the_hand_sum
from tests.test_gguf_int8_kquants import activation_rows, by_hand
from tests.test_gguf_linear import random_blocks

pytestmark = pytest.mark.isa  # the group steps follow the CPU class (AVX2 and wider; none: the lane groups)

TYPES = (Q.Q4_K, Q.Q5_K)
# From how many rows the file layout's products run in lane groups on every CPU class
# (`gguf_int8_kgroups.h`'s kMinGroupRows): the bits the layout's products give at every row count.
LANE_GROUP_ROWS = 32


@pytest.fixture(autouse=True, scope="module")
def kernels() -> None:
    assert ops.available()


def raw_blocks(qtype: Q, rows: int, blocks: int, rng: np.random.Generator) -> torch.Tensor:
    return torch.from_numpy(random_blocks(qtype, rows, blocks, rng, edges=False).reshape(rows, -1))


@settings(max_examples=30, deadline=None)
@given(qtype=st.sampled_from(TYPES), groups=st.integers(1, 3), blocks=st.integers(1, 3), data=st.data())
def test_packing_moves_each_field_to_its_stated_place_and_back(qtype, groups, blocks, data) -> None:
    raw = raw_blocks(qtype, 8 * groups, blocks, np.random.default_rng(blocks))
    packed = pack_rows8(raw, int(qtype))
    assert packed.shape == raw.shape and torch.equal(unpack_rows8(packed, int(qtype)), raw)
    g, r, b = (data.draw(st.integers(0, n - 1)) for n in (groups, 8, blocks))
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    block = raw[8 * g + r, b * size:(b + 1) * size]
    step = packed[8 * g:8 * g + 8].reshape(-1)[b * 8 * size:(b + 1) * 8 * size]  # block b of the group's 8 rows
    assert torch.equal(step[2 * r:2 * r + 2], block[0:2]) and torch.equal(step[16 + 2 * r:18 + 2 * r], block[2:4])
    sc, mn = (t[0] for t in gguf_dequant.scale_min(block[None, 4:16]))
    for j in range(8):  # low 4 bits of scale and minimum in one byte; their high 2 bits in a nibble
        assert step[32 + 8 * j + r] == (sc[j] & 15) | (mn[j] & 15) << 4
        assert (step[96 + 8 * (j % 4) + r] >> 4 * (j // 4)) & 15 == (sc[j] >> 4) | (mn[j] >> 4) << 2
    at = 128
    if qtype == Q.Q5_K:  # the fifth bits' 4-byte chunks, chunk-major
        for c in range(8):
            assert torch.equal(step[at + 32 * c + 4 * r:at + 32 * c + 4 * r + 4], block[16 + 4 * c:20 + 4 * c])
        at += 256
    qs = block[48 if qtype == Q.Q5_K else 16:]
    for p in range(4):
        for c in range(8):
            chunk = step[at + 256 * p + 32 * c + 4 * r:at + 256 * p + 32 * c + 4 * r + 4]
            assert torch.equal(chunk, qs[32 * p + 4 * c:32 * p + 4 * c + 4])


@settings(max_examples=40, deadline=None)
@given(qtype=st.sampled_from(TYPES), rows=st.integers(1, 40), groups=st.integers(1, 3), blocks=st.integers(1, 3),
       bias=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_products_are_the_hand_sums_and_the_lane_groups_bits(qtype, rows, groups, blocks, bias, seed) -> None:
    """Any row count: within float32 rounding of the hand sum, and each row the bits the file layout's lane
    groups give it (whatever rows share either call)."""
    rng = np.random.default_rng(seed)
    k, n = 256 * blocks, 8 * groups
    raw = raw_blocks(qtype, n, blocks, rng)
    x = activation_rows(rng, rows, k)
    b = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if bias else None
    got = ops.gguf_linear_int8(torch.from_numpy(x), pack_rows8(raw, int(qtype)), int(qtype) + ROWS8, k, b)
    want, scale = by_hand(x, raw.numpy(), qtype, None if b is None else b.numpy())
    bound = 4 * np.finfo(np.float32).eps * (blocks + 2) * scale + np.finfo(np.float32).tiny
    assert (np.abs(got.numpy() - want) <= bound).all(), np.abs(got.numpy() - want).max()
    padded = np.concatenate([x, activation_rows(rng, LANE_GROUP_ROWS, k)])
    lanes = ops.gguf_linear_int8(torch.from_numpy(padded), raw, int(qtype), k, b)
    assert torch.equal(got, lanes[:rows])


def test_the_largest_sums_stay_exact() -> None:
    """Every value at its top (15, Q5_K 31 with every fifth bit), scales and minimums 63, activations ±127:
    the 16-bit pair sums at their bound (Q4_K 8 chunks of 2 * 15 * 127, Q5_K 4 of 2 * 31 * 127)."""
    for qtype in TYPES:
        size = gguf.GGML_QUANT_SIZES[qtype][1]
        raw = np.full((8, 2, size), 0xFF, np.uint8)
        raw[:, :, 0:4] = np.array([0.01, 0.02], np.float16).view(np.uint8)
        raw[4:, :, 4:16] = 0  # rows 4-7: scales and minimums 0
        raw = raw.reshape(8, -1)
        x = np.tile(np.float32([-1, 1]), (3, 256))
        x[1], x[2] = -1, 1
        assert_the_hand_sum(x, raw, qtype, None, by_hand, 2)
        got = ops.gguf_linear_int8(torch.from_numpy(x), pack_rows8(torch.from_numpy(raw), int(qtype)),
                                   int(qtype) + ROWS8, 512, None)
        padded = np.tile(x, (11, 1))[:LANE_GROUP_ROWS]
        lanes = ops.gguf_linear_int8(torch.from_numpy(padded), torch.from_numpy(raw), int(qtype), 512, None)
        assert torch.equal(got, lanes[:3])


def test_edge_scales_threads_and_several_weights_keep_the_lane_groups_bits() -> None:
    """Scales at the edges (inf, NaN, subnormal halves), 10 groups split between 2 threads, and a call of
    several weights (the next weight's bytes asked for early): each the file layout's lane-group bits."""
    rng = np.random.default_rng(11)
    x = torch.from_numpy(activation_rows(rng, 5, 512))
    padded = torch.cat([x, torch.from_numpy(activation_rows(rng, LANE_GROUP_ROWS, 512))])
    weights = [torch.from_numpy(random_blocks(q, 80, 2, rng, edges=True).reshape(80, -1)) for q in TYPES]
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        packed = [pack_rows8(w, int(q)) for w, q in zip(weights, TYPES, strict=True)]
        types = [int(q) + ROWS8 for q in TYPES]
        many = ops.gguf_linear_int8_many(x, packed, types, 512, [None, None])
        for got, w, p, q, t in zip(many, weights, packed, TYPES, types, strict=True):
            lanes = ops.gguf_linear_int8(padded, w, int(q), 512, None)[:5]
            assert torch.equal(got.view(torch.int32), ops.gguf_linear_int8(x, p, t, 512, None).view(torch.int32))
            assert torch.equal(got.isnan(), lanes.isnan()) and torch.equal(got.nan_to_num(), lanes.nan_to_num())
            assert not got.isfinite().all()  # the edges were drawn
    finally:
        torch.set_num_threads(threads)
