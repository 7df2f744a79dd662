"""A sliding-window layer's decode step: `reference_attention` against the row kernel, over long contexts.

One decode step of one layer (Mistral-7B attention shapes: 32 query heads, 8 KV heads, head_dim 128,
16-token blocks on scattered tables) for a batch of sequences whose context runs far past the window.
Both paths honour the window; the reference gathers each sequence's window into a contiguous tensor
and runs einsum/softmax per sequence, the kernel (`ops.paged_attention` with `window`) reads the
window's blocks where they lie, starting at the window's first block. Printed from one run: both
timings, their ratio, and the kernel over every key (what the layer cost without a window, so the
window's saving shows), at each context length.

    .venv/bin/python bench/bench_window_attention.py [--window 1024] [--seqs 8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time

import torch

from pagedrl.engine.attention import PagedAttention
from pagedrl.engine.kv_cache import KVCache
from pagedrl.kernels import isa

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Mistral-7B


def timed(fn, repeats: int) -> float:  # noqa: ANN001
    """Median seconds of `fn()` over `repeats` runs after three warm-ups (the first touches the cache's pages)."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(context: int, window: int, seqs: int, dtype: torch.dtype, repeats: int) -> None:
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    per_seq = -(-(context + 1) // BLOCK)
    cache = KVCache(1, per_seq * seqs, BLOCK, KV_HEADS, HEAD_DIM, dtype)
    cache.data.normal_(generator=gen)
    free = list(range(per_seq * seqs))
    rng.shuffle(free)
    tables = [([free.pop() for _ in range(per_seq)], context, 1) for _ in range(seqs)]
    q = torch.randn(1, seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(1, seqs, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(1, seqs, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    metas = {impl: dataclasses.replace(PagedAttention.build(cache, BLOCK, tables, impl=impl), windows=(window,))
             for impl in ("reference", "fast")}
    full = PagedAttention.build(cache, BLOCK, tables, impl="fast")  # no window: the in-place decode kernel
    ref = timed(lambda: metas["reference"].attend(0, q, k, v), repeats)
    fast = timed(lambda: metas["fast"].attend(0, q, k, v), repeats)
    every = timed(lambda: full.attend(0, q, k, v), repeats)
    diff = float((metas["fast"].attend(0, q, k, v).float() - metas["reference"].attend(0, q, k, v).float()).abs().max())
    print(f"context {context:>6} | window {window} | reference {ref * 1e3:8.2f} ms | kernel {fast * 1e3:7.3f} ms | "
          f"ratio {ref / fast:6.1f}x | kernel over every key {every * 1e3:8.2f} ms | max |diff| {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--contexts", default="2048,8192,32768")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"one decode step of one windowed layer, {args.seqs} sequences, {HEADS}/{KV_HEADS} heads of {HEAD_DIM}, "
          f"{args.dtype}, {torch.get_num_threads()} threads, CPU class {isa.describe()}")
    for context in (int(c) for c in args.contexts.split(",")):
        bench(context, args.window, args.seqs, dtype, args.repeats)


if __name__ == "__main__":
    main()
