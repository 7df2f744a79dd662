"""The CPU decode kernel that reads the KV cache's blocks in place (`kernels/ops.py`), held to
the reference path: grouped-query heads, partial last blocks, shared prefix blocks, the block sizes
and head sizes it compiles fixed and those it reads at run time, float32 and bf16."""

from __future__ import annotations

import os
import random

import pytest
import torch
from cpu_class import needs
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrl.engine.attention import PagedAttention
from pagedrl.engine.kv_cache import KVCache
from pagedrl.kernels import build_lock, ops

pytestmark = pytest.mark.isa  # its paths follow the CPU class: `make test-isa` runs it as each lower one


def test_the_kernel_builds_here() -> None:
    """ninja is a dependency and the machine has a C++ compiler: the engine's decode reads in place."""
    assert ops.available()
    assert ops.build_dir().is_dir()


def decode_step(block_size: int, lengths: list[int], heads: tuple[int, int], head_dim: int, dtype: torch.dtype,
                seed: int, shared_prefix: bool = False) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Reference and in-place outputs of one all-decode step over random caches and scattered tables."""
    num_heads, num_kv_heads = heads
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lengths]
    cache = KVCache(1, sum(need) + 4, block_size, num_kv_heads, head_dim, dtype=dtype)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen).to(dtype))
    free = list(range(cache.num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(b)] for b in need]
    if shared_prefix:  # every sequence reads the first sequence's first block (a cached prefix)
        for t in tables[1:]:
            t[0] = tables[0][0]
    seqs = [(t, n - 1, 1) for t, n in zip(tables, lengths, strict=True)]
    q = torch.randn(1, len(lengths), num_heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(1, len(lengths), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(1, len(lengths), num_kv_heads, head_dim, generator=gen).to(dtype)
    before = cache.data.clone()
    ref = PagedAttention.build(cache, block_size, seqs, impl="reference").attend(0, q, k, v)
    cache.data.copy_(before)
    meta = PagedAttention.build(cache, block_size, seqs, impl="fast")
    return ref[0].float(), meta.attend(0, q, k, v)[0].float(), meta.in_place


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 70), min_size=1, max_size=6),
       block_size=st.sampled_from([4, 16]), heads=st.sampled_from([(4, 4), (9, 3), (6, 2), (4, 1)]),
       head_dim=st.sampled_from([64, 24]), seed=st.integers(0, 2**16), shared=st.booleans())
def test_in_place_decode_equals_the_reference_in_float32(lengths, block_size, heads, head_dim, seed, shared) -> None:
    shared = shared and min(lengths) > block_size  # a shared block must be a full one
    ref, out, in_place = decode_step(block_size, lengths, heads, head_dim, torch.float32, seed, shared)
    assert in_place
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_in_place_decode_equals_the_reference_in_bf16(head_dim) -> None:
    ref, out, in_place = decode_step(16, [1, 15, 16, 17, 100, 250], (9, 3), head_dim, torch.bfloat16, seed=3)
    assert in_place
    # both round the output to bf16 once (a step of 2^-8 relative); the kernel accumulates in float32
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


def test_the_kernel_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setenv(ops.DISABLE_ENV, "0")
    ref, out, in_place = decode_step(16, [5, 40], (4, 2), 64, torch.float32, seed=1)
    assert not in_place  # the gather path instead
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def needs_bf16_dot() -> None:
    """Decided inside the test, not at collection: the kernels build into the test session's cache."""
    needs("avx512_bf16", "the bf16 dot-product kernel")
    assert ops.decode_linear_available()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 70), out_features=st.integers(1, 70),
       in_features=st.one_of(st.integers(1, 200), st.sampled_from([32, 64, 96, 576])),
       bias=st.booleans(), strided=st.booleans(), seed=st.integers(0, 2**16))
def test_decode_linear_is_the_float32_sum_rounded_once(rows, out_features, in_features, bias, strided, seed) -> None:
    """Every output is the float32 sum of its products plus the bias, rounded to bf16 once: within half
    a bf16 step of the exact (float64) value, plus float32's accumulation error. Both paths: AMX tiles
    (K a multiple of 32; 16 weight rows a tile, the rest by dot products; up to 4 tiles of 16 input
    rows, then more), dot products (any K, any tail of the 32-wide products); a weight whose rows are
    strided (a slice of a wider tensor)."""
    needs_bf16_dot()
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    wide = torch.randn(out_features, in_features + (7 if strided else 0), generator=gen).bfloat16()
    weight = wide[:, :in_features]
    b = torch.randn(out_features, generator=gen).bfloat16() if bias else None
    assert_float32_sum_rounded_once(torch.ops.pagedrl_cpu.decode_linear(x, weight, b), x, weight, b)


def assert_float32_sum_rounded_once(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                    bias: torch.Tensor | None) -> None:
    """out = x @ weight.T (+ bias) in bf16, each output within half a bf16 step of the exact (float64)
    value plus float32's accumulation error over the row's K products."""
    exact = x.double() @ weight.double().t() + (bias.double() if bias is not None else 0.0)
    magnitude = x.double().abs() @ weight.double().abs().t()
    bound = exact.abs() * 2.0**-8 + magnitude * x.shape[1] * 2.0**-24 + 1e-30
    assert out.dtype == torch.bfloat16 and out.shape == exact.shape
    assert ((out.double() - exact).abs() <= bound).all()


def test_decode_linear_computes_a_row_alike_in_any_batch() -> None:
    """A row's outputs do not depend on how many rows share the call: alone, among 32, or among 600
    (three passes of 256 rows over the weights on AMX): what batch-invariant products rest on."""
    needs_bf16_dot()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(600, 576, generator=gen).bfloat16()
    weight = torch.randn(1536, 576, generator=gen).bfloat16()
    whole = torch.ops.pagedrl_cpu.decode_linear(x, weight, None)
    by_32 = torch.cat([torch.ops.pagedrl_cpu.decode_linear(x[i:i + 32], weight, None) for i in range(0, 600, 32)])
    assert torch.equal(whole, by_32)
    for row in (0, 255, 256, 599):
        assert torch.equal(whole[row:row + 1], torch.ops.pagedrl_cpu.decode_linear(x[row:row + 1], weight, None))


def test_the_kernels_are_built_for_the_process_s_cpu_class() -> None:
    """Each path exactly where the class has its instructions, on every class (a `PAGEDRL_CPU_ISA`
    cap included: the build leaves out what is above it): the bf16 dot products from AVX512-BF16, the
    AMX tiles with AMX, the k-pairs kernel between, oneDNN's packed bf16 weights from AVX512; and the
    tile path sets how many rows the kernel takes."""
    from pagedrl.kernels import isa, products

    assert ops.available()
    assert ops.decode_linear_available() == isa.at_least("avx512_bf16")
    assert ops.decode_linear_amx() == isa.at_least("amx")
    assert products.pairs_available() == (isa.at_least("avx512_bf16") and not isa.at_least("amx"))
    assert products.onednn_packs_bf16() == isa.at_least("avx512")
    assert products.packs_weights() == products.pairs_available()
    expected = (products.MAX_ROWS_AMX if isa.at_least("amx") else
                products.MAX_ROWS_DOT if isa.at_least("avx512_bf16") else 0)
    assert products.max_rows() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prompt_chunks_by_rows_equal_the_reference(dtype) -> None:
    """`prefill_rows`: a step of a fresh prompt, a chunk after a cached prefix and a decode, through the
    prefill tiles (bf16 where the CPU has the bf16 dot products, float32 with AVX2 or AVX512) or every new
    token's row through the row kernel, equals the reference path; a step of decodes only keeps the in-place decode kernel."""
    block_size, num_kv_heads, num_heads, head_dim = 16, 3, 9, 64
    gen = torch.Generator().manual_seed(11)
    cache = KVCache(1, 24, block_size, num_kv_heads, head_dim, dtype=dtype)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen).to(dtype))
    order = torch.randperm(cache.num_blocks, generator=gen).tolist()
    seqs = [(order[0:3], 0, 37), (order[3:6], 20, 13), (order[6:10], 50, 1)]
    rows = sum(new for _, _, new in seqs)
    q = torch.randn(1, rows, num_heads, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(1, rows, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
    before = cache.data.clone()
    ref = PagedAttention.build(cache, block_size, seqs, impl="reference").attend(0, q, k, v)
    cache.data.copy_(before)
    meta = PagedAttention.build(cache, block_size, seqs, impl="fast", prefill_rows=True)
    tiles = ops.decode_linear_available() if dtype == torch.bfloat16 else ops.paged_prefill_float32()
    assert meta.tiles == tiles and (meta.row_lens is None) == tiles and meta.groups is None
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(meta.attend(0, q, k, v).float(), ref.float(), rtol=tol, atol=tol)
    decodes = PagedAttention.build(cache, block_size, [(order[6:10], 51, 1)], impl="fast", prefill_rows=True)
    assert decodes.in_place and decodes.row_lens is None


def test_a_killed_build_s_lock_is_cleared_and_a_live_one_waited_for(tmp_path, monkeypatch) -> None:
    """torch's builder waits for ever on a lock a killed build left: the lock of a dead builder, or of
    none named and old, is removed; a live builder's lock is waited for."""
    import subprocess
    import sys
    import threading

    lock = tmp_path / "lock"
    lock.touch()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    (tmp_path / build_lock.BUILDER_FILE).write_text(dead.stdout.strip())
    build_lock.wait_for_builder(tmp_path, poll=0.01)
    assert not lock.exists()
    lock.touch()
    (tmp_path / build_lock.BUILDER_FILE).unlink()
    monkeypatch.setattr(build_lock, "STALE_LOCK_SECONDS", -1.0)  # no builder named: old enough
    build_lock.wait_for_builder(tmp_path, poll=0.01)
    assert not lock.exists()
    lock.touch()
    (tmp_path / build_lock.BUILDER_FILE).write_text(str(os.getpid()))  # alive: waited for until released
    threading.Timer(0.2, lock.unlink).start()
    build_lock.wait_for_builder(tmp_path, poll=0.01)
    assert not lock.exists()
