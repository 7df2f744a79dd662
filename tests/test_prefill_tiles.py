"""The prefill tiles (`csrc/prefill_tiles.cpp`, `csrc/prefill_tiles_f32.h`, `ops.paged_prefill`): a step's
prompt chunks attended a sequence's consecutive rows at a time, in bf16 and in float32, held to float64
attention over the same cache."""

from __future__ import annotations

import random

import pytest
import torch
from cpu_class import needs
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cpu_kernels import needs_bf16_dot

from pagedrl.kernels import ops

pytestmark = pytest.mark.isa  # its paths follow the CPU class: `make test-isa` runs it as each lower one


def float64_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, tables: list[list[int]],
                      q_lens: list[int], seq_lens: list[int], scale: float, window: int | None = None,
                      softcap: float | None = None, sinks: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row over its sequence's keys up to its own position (its last `window` of them), in float64,
    scores capped by `softcap` and a `sinks` logit per head in each denominator: the output and, per row
    and head, the probability-weighted mean of |v| (what rounding the probabilities can move it by)."""
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    groups = q.shape[1] // num_kv_heads
    keys = key_cache.reshape(-1, num_kv_heads, head_dim).double().repeat_interleave(groups, dim=1)
    values = value_cache.reshape(-1, num_kv_heads, head_dim).double().repeat_interleave(groups, dim=1)
    out, spread, row = torch.empty(q.shape, dtype=torch.float64), torch.empty(q.shape[:2], dtype=torch.float64), 0
    for table, q_len, seq_len in zip(tables, q_lens, seq_lens, strict=True):
        slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(seq_len)])
        k, v = keys[slots], values[slots]  # [L, Hq, D]
        scores = torch.einsum("qhd,khd->hqk", q[row:row + q_len].double(), k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        position = torch.arange(seq_len - q_len, seq_len)[:, None]
        key = torch.arange(seq_len)[None, :]
        hidden = (key > position) | ((key <= position - window) if window else False)
        scores = scores.masked_fill(hidden, float("-inf"))
        if sinks is not None:  # one more column per head, with no value
            column = sinks.double()[:, None, None].expand(-1, q_len, 1)
            probs = torch.cat([scores, column], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        out[row:row + q_len] = torch.einsum("hqk,khd->qhd", probs, v)
        spread[row:row + q_len] = torch.einsum("hqk,khd->qhd", probs, v.abs()).amax(-1)
        row += q_len
    return out, spread


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 70)), min_size=1, max_size=5),
       block_size=st.sampled_from([8, 16, 32]), heads=st.sampled_from([(9, 3), (4, 4), (8, 2), (4, 1), (16, 2), (50, 1)]),
       head_dim=st.sampled_from(ops.PREFILL_HEAD_DIMS), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_tiles_equal_float64_attention(dtype, chunks, block_size, heads, head_dim, seed) -> None:
    check_tiles(dtype, chunks, block_size, heads, head_dim, seed)


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 70)), min_size=1, max_size=4),
       block_size=st.sampled_from([8, 16, 32]), heads=st.sampled_from([(9, 3), (8, 2), (4, 1), (16, 2)]),
       head_dim=st.sampled_from([64, 256]), seed=st.integers(0, 2**16), window=st.sampled_from([None, 1, 5, 16, 37]),
       softcap=st.sampled_from([None, 2.0]), sinks=st.booleans())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_tiles_under_a_layers_rules_equal_float64_attention(dtype, chunks, block_size, heads, head_dim, seed,
                                                                    window, softcap, sinks) -> None:
    """The same under a window (the blocks wholly below every row's window freed: their table entries point
    at a block of NaNs, which no row may read), a cap on the scores, and sinks."""
    check_tiles(dtype, chunks, block_size, heads, head_dim, seed, window, softcap, sinks)


def check_tiles(dtype, chunks, block_size, heads, head_dim, seed, window=None, softcap=None, sinks=False) -> None:
    """Sequences of (cached, new) tokens: fresh prompts, chunks after a cached prefix, single rows (the
    row routine); tables scattered, blocks smaller than, equal to and larger than a chunk of keys. In
    bf16 each output is within bf16's rounding of the exact one (half a step of the output, and of the
    probability-weighted |v| for the probabilities the values are multiplied by in bf16); in float32
    within 2^-16 of the same two (sums of up to 256 products and 130 positions in float32 stay well
    inside it): a masking, table or tiling slip is off by far more."""
    if dtype == torch.bfloat16:
        needs_bf16_dot()
    else:
        needs("avx2", "the float32 prefill tiles")
        assert ops.paged_prefill_float32()
    num_heads, num_kv_heads = heads
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    q_lens = [new for _, new in chunks]
    seq_lens = [cached + new for cached, new in chunks]
    need = [-(-n // block_size) for n in seq_lens]
    free = list(range(sum(need) + 3))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in need]
    shape = (sum(need) + 4, block_size, num_kv_heads, head_dim)  # (the last in no table)
    key_cache, value_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    q = (torch.randn(sum(q_lens), num_heads, head_dim, generator=gen) * 2).to(dtype)
    padded = torch.zeros(len(tables), max(need), dtype=torch.long)
    for s, table in enumerate(tables):
        padded[s, :len(table)] = torch.tensor(table)
    if window:  # blocks below every row's window, freed: their entries point at a block of NaNs
        key_cache[-1], value_cache[-1] = float("nan"), float("nan")
        for s, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
            padded[s, :max(0, seq_len - q_len - window + 1) // block_size] = shape[0] - 1
    starts = torch.tensor([0] + q_lens).cumsum(0)
    scale = head_dim ** -0.5
    logits = torch.randn(num_heads, generator=gen) if sinks else None
    out = ops.paged_prefill(q, key_cache, value_cache, padded, starts, torch.tensor(seq_lens), scale, window,
                            softcap, logits)
    exact, spread = float64_attention(q, key_cache, value_cache, tables, q_lens, seq_lens, scale, window, softcap,
                                      logits)
    assert out.dtype == dtype and out.shape == q.shape
    step = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-16
    bound = exact.abs() * step + spread[..., None] * step + 1e-5
    assert ((out.double() - exact).abs() <= bound).all()
