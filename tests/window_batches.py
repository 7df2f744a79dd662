"""Random steps for the windowed-attention tests (`test_window_kernels.py`, `triton_window_cases.py`):
a cache, sequences on scattered blocks, and q, k, v, with the blocks every window has left holding NaN."""

from __future__ import annotations

import contextlib
import random
from unittest import mock

import torch

from pagedrl.engine import layer_rules
from pagedrl.engine.kv_cache import KVCache
from pagedrl.kernels import ops

BLOCK = 16


def make_batch(shapes: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
               window: int | None, seed: int, block: int = BLOCK) -> tuple[KVCache, list[tuple[list[int], int, int]], torch.Tensor,
                                                      torch.Tensor, torch.Tensor]:
    """A cache, sequences (table, computed, new) on scattered blocks, and the step's q, k, v. Blocks wholly
    below the window of a sequence's first new query point at a NaN block."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    num_blocks = 2 + sum(-(-(c + n) // block) for c, n in shapes)
    cache = KVCache(1, num_blocks, block, kv_heads, head_dim, dtype=dtype)
    cache.data.normal_(generator=gen)
    poison = num_blocks - 1
    cache.data[:, :, poison] = float("nan")
    free = list(range(num_blocks - 1))
    rng.shuffle(free)
    seqs = []
    for c, n in shapes:
        table = [free.pop() for _ in range(-(-(c + n) // block))]
        if window is not None:
            dead = max(0, c - window + 1) // block  # blocks every new query's window has left
            table[:dead] = [poison] * dead
        seqs.append((table, c, n))
    rows = sum(n for _, n in shapes)
    q = torch.randn(1, rows, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(1, rows, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(1, rows, kv_heads, head_dim, generator=gen).to(dtype)
    return cache, seqs, q, k, v


def kernels_only() -> contextlib.AbstractContextManager[object]:
    """Where the CPU kernels are built, a layer with rules that falls back to `reference_attention` fails
    the test: the engine's fast impl must route it to the row kernel."""
    if not ops.available():
        return contextlib.nullcontext()
    return mock.patch.object(layer_rules, "reference_attention",
                             side_effect=AssertionError("a layer with rules took the reference path"))
