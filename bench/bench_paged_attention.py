"""Paged attention: the reference path against the fast path, on SmolLM2-135M attention shapes.

Two engine steps, each timed as `layers` calls of `attend` (the per-step `build` timed apart):
  decode: 64 sequences, one new token each, ~300 tokens of context;
  mixed:  60 such decodes + 2 fresh 128-token prompts + 2 128-token chunks over 256 cached tokens.
Prints both timings and the ratio, measured in one run, plus the largest difference between them.

    .venv/bin/python bench/bench_paged_attention.py [--device cuda] [--dtype bfloat16]
    .venv/bin/python bench/bench_paged_attention.py --layers 30 --threads 1 --kv-cache-dtype bfloat16

`--kv-cache-dtype bfloat16` under float32: the cache in bf16 (a float32 engine's `kv_cache_dtype`): the fast
path's decode widens it as it reads; the mixed step's prompts (no `prefill_rows` here) and the reference
loop meet it in bf16.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pagedrl.engine.attention import PagedAttention
from pagedrl.engine.kv_cache import KVCache

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M


def step_shapes(kind: str, rng: random.Random) -> list[tuple[int, int]]:
    """(num_computed, num_new) per sequence."""
    decodes = [(rng.randint(280, 320), 1) for _ in range(64 if kind == "decode" else 60)]
    if kind == "decode":
        return decodes
    return decodes[:30] + [(0, 128), (256, 128)] + decodes[30:] + [(0, 128), (256, 128)]


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` runs after one warm-up."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(kind: str, layers: int, device: torch.device, dtype: torch.dtype, repeats: int,
          kv_dtype: torch.dtype | None = None) -> None:
    rng = random.Random(0)
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = step_shapes(kind, rng)
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in shapes) + 8
    cache = KVCache(layers, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, kv_dtype or dtype, device)
    cache.data.normal_(generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = [([free.pop() for _ in range(-(-(c + n) // BLOCK))], c, n) for c, n in shapes]
    rows = sum(n for _, n in shapes)
    q = torch.randn(1, rows, HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    k = torch.randn(1, rows, KV_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)
    v = torch.randn(1, rows, KV_HEADS, HEAD_DIM, generator=gen, device=device, dtype=dtype)

    metas = {impl: PagedAttention.build(cache, BLOCK, seqs, device, impl=impl) for impl in ("reference", "fast")}
    results = {}
    for impl, meta in metas.items():
        results[impl] = timed(lambda meta=meta: [meta.attend(i, q, k, v) for i in range(layers)], device, repeats)
    build = timed(lambda: PagedAttention.build(cache, BLOCK, seqs, device), device, repeats)
    diff = max(float((metas["fast"].attend(i, q, k, v) - metas["reference"].attend(i, q, k, v)).abs().max())
               for i in range(layers))
    ref_ms, fast_ms = results["reference"] * 1e3, results["fast"] * 1e3
    print(f"{kind:>6}: {len(seqs)} seqs, {rows} new tokens, {layers} layers | reference {ref_ms:8.2f} ms | "
          f"fast {fast_ms:7.2f} ms (+ build {build * 1e3:.2f} ms/step) | ratio {ref_ms / fast_ms:5.1f}x | "
          f"max |diff| {diff:.1e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16"])
    parser.add_argument("--layers", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else torch.bfloat16
    print(f"paged attention, Hq={HEADS} Hkv={KV_HEADS} D={HEAD_DIM} block={BLOCK}, {device} {dtype}, KV cache "
          f"{kv_dtype}, {torch.get_num_threads()} threads")
    for kind in ("decode", "mixed"):
        bench(kind, args.layers, device, dtype, args.repeats, kv_dtype)


if __name__ == "__main__":
    main()
