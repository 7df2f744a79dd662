"""The fast kernels under a layer's rules (sliding window, soft-capped scores, attention sinks) held to
`reference_attention`, and the engine's metadata routing rule layers to them.

Random caches with scattered block tables; windows smaller and larger than a block and crossing block
boundaries; decodes, fresh prompts and chunks of prompts; grouped-query heads; float32 and bf16. The
blocks wholly below every row's window hold NaN, as a freed block may hold anything: a kernel that read
them (even to mask them) would return NaN.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from window_batches import BLOCK, make_batch

from pagedrl.engine import layer_rules
from pagedrl.engine.attention import PagedAttention
from pagedrl.engine.kv_cache import KVCache
from pagedrl.engine.reference_attention import reference_attention
from pagedrl.kernels import ops


@pytest.fixture(autouse=True)
def cpu_kernels() -> None:
    """Asked when a test runs, not at collection: the kernels load from the cache the session points at."""
    if not ops.available():
        pytest.skip("the CPU kernels are not built here")


# float32: the kernel and the reference sum the same terms in other orders (a few ulps of outputs of ~1).
# bf16: each rounds its float32 result to bf16 once (2^-8 relative), so they may differ by one ulp of |out| <= 4.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6}


def engine_outputs(shapes, heads, kv_heads, head_dim, dtype, window, softcap, with_sinks, seed,
                   prefill_rows: bool = False, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The fast impl's output and the reference's, each from the same starting cache."""
    cache, seqs, q, k, v = make_batch(shapes, heads, kv_heads, head_dim, dtype, window, seed, block)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(seed + 1)) * 2 if with_sinks else None
    before = cache.data.clone()
    outs = []
    for impl in ("fast", "reference"):
        cache.data.copy_(before)
        meta = PagedAttention.build(cache, block, seqs, impl=impl, prefill_rows=prefill_rows)
        meta = dataclasses.replace(meta, windows=(window,), softcap=softcap)
        no_reference = mock.patch.object(layer_rules, "reference_attention",
                                         side_effect=AssertionError("the fast impl took the reference"))
        with no_reference if impl == "fast" else contextlib.nullcontext():
            outs.append(meta.attend(0, q, k, v, sinks))
    return outs[0], outs[1]


shape_lists = st.lists(st.one_of(
    st.tuples(st.just(0), st.integers(1, 40)),  # fresh prompts
    st.tuples(st.integers(1, 70), st.integers(2, 20)),  # chunks of prompts with a cached prefix
    st.tuples(st.integers(1, 90), st.just(1)),  # decodes
), min_size=1, max_size=5)


@settings(max_examples=40, deadline=None)
@given(shapes=shape_lists, window=st.sampled_from([None, 1, 5, 16, 17, 24, 40, 100]),
       softcap=st.sampled_from([None, 2.0, 50.0]), with_sinks=st.booleans(),
       heads=st.sampled_from([(4, 4), (8, 2), (6, 1)]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       block=st.sampled_from([16, 4, 32]), seed=st.integers(0, 2**16))
def test_row_kernel_equals_reference_under_rules(shapes, window, softcap, with_sinks, heads, dtype, block,
                                                 seed) -> None:
    """Random batches of decodes and prompt chunks through the engine's metadata, fast against reference;
    blocks of 4 (a kernel chunk of 16 positions spans four, some freed) and of 32 too."""
    if window is None and softcap is None and not with_sinks:
        window = 7
    fast, ref = engine_outputs(shapes, *heads, 32, dtype, window, softcap, with_sinks, seed, block=block)
    assert torch.isfinite(fast).all()
    torch.testing.assert_close(fast.float(), ref.float(), atol=TOLERANCE[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 24])  # the compiled sizes (bf16 dot products) and a run-time one
@pytest.mark.parametrize("window", [3, 16, 31, 48])
def test_row_kernel_on_head_sizes_and_block_crossings(dtype, head_dim, window) -> None:
    """Decodes at every offset of a block and a chunk of a prompt, so windows start anywhere in a block; with
    `prefill_rows`, a step through the prefill tiles under the rules (bf16 or float32, where built)."""
    shapes = [(c, 1) for c in range(40, 72, 3)] + [(37, 21), (0, 50)]
    for prefill_rows in (False, True):
        with mock.patch.object(layer_rules.ops, "paged_prefill", wraps=ops.paged_prefill) as tiles:
            fast, ref = engine_outputs(shapes, 8, 2, head_dim, dtype, window, 30.0, True, head_dim + window,
                                       prefill_rows=prefill_rows)
        # a step with prompt chunks takes the prefill tiles under the rules where they are built
        built = ops.decode_linear_available() if dtype == torch.bfloat16 else ops.paged_prefill_float32()
        assert tiles.called == (prefill_rows and head_dim in ops.PREFILL_HEAD_DIMS and built)
        torch.testing.assert_close(fast.float(), ref.float(), atol=TOLERANCE[dtype], rtol=0)


def test_windowed_rows_read_only_their_window() -> None:
    """ops.paged_attention directly: a decode at position 1000 with a window of 20 equals the reference's
    over its last 20 keys, every block before them NaN."""
    cache, seqs, q, k, v = make_batch([(1000, 1)], 4, 4, 64, torch.float32, 20, 3)
    (table, c, n), = seqs
    meta = PagedAttention.build(cache, BLOCK, seqs)
    meta._store(k, v, cache.key_cache[0], cache.value_cache[0])
    out = ops.paged_attention(q[0], cache.key_cache[0], cache.value_cache[0], meta.block_tables,
                              torch.tensor([1001]), 0.125, window=20)[0]
    ref = reference_attention(q[0], cache.key_cache[0], cache.value_cache[0], meta.seq_lens, meta.query_start_loc,
                              meta.block_tables, 0.125, 20)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_layers_without_rules_are_unchanged() -> None:
    """The same metadata with a window on layer 0 only: layer 1 still attends over every key."""
    cache, seqs, q, k, v = make_batch([(30, 1), (0, 9)], 4, 2, 32, torch.float32, None, 5)
    cache = KVCache(2, cache.num_blocks, BLOCK, 2, 32)
    cache.data.normal_(generator=torch.Generator().manual_seed(0))
    meta = dataclasses.replace(PagedAttention.build(cache, BLOCK, seqs), windows=(4, None))
    full = meta.attend(1, q, k, v)
    ref = PagedAttention.build(cache, BLOCK, seqs, impl="reference").attend(1, q, k, v)
    torch.testing.assert_close(full, ref, atol=1e-5, rtol=0)
