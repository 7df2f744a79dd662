"""A prefill's attention on a CPU, bf16 or (`--dtype float32`) float32: the prefill tiles against the row kernel and against gather +
torch's flash attention, on SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head_dim 64, or
`--head-dim`).

The step: `--prompts` fresh prompts of 32-512 tokens (seeded, as `bench_vllm_cpu.py`'s 64x128
workload), their keys and values in scattered 16-token blocks, one layer's attention timed per call,
best of `--rounds`; the three run in turns in one process. Also printed: each one's mean and largest
difference from float64 attention over the same bf16 inputs, on a subset of the rows (all three
round their output to bf16 once in bf16). `--window` and `--softcap` put a layer's rules on the tiles and the
row kernel (gather + flash attention knows none of them and is left out then).

    .venv/bin/python bench/bench_prefill_attention.py [--prompts 64] [--rounds 6] [--threads 2]
        [--window 128] [--softcap 50] [--head-dim 256] [--dtype float32]
    .venv/bin/python -m pagedrl.kernels.isa run avx2 -- .venv/bin/python bench/bench_prefill_attention.py --dtype float32
    .venv/bin/python bench/bench_prefill_attention.py --dtype float32 --kv-cache-dtype bfloat16

`--kv-cache-dtype bfloat16` under `--dtype float32`: float32 queries over a bf16 cache (a float32 engine's
`kv_cache_dtype`), the tiles and the row kernel widening the cache as they read it (gather + flash
attention, which would meet the cache in bf16, is left out).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedrl.engine.attention import PagedAttention
from pagedrl.engine.kv_cache import KVCache
from pagedrl.kernels import ops

HEADS, KV_HEADS, BLOCK = 9, 3, 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--window", type=int, default=None)
    ap.add_argument("--softcap", type=float, default=None)
    ap.add_argument("--head-dim", type=int, default=64, help="64: SmolLM2's; 256: Gemma's")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--kv-cache-dtype", choices=("auto", "bfloat16"), default="auto")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    kv_dtype = dtype if args.kv_cache_dtype == "auto" else torch.bfloat16
    head_dim = args.head_dim
    rules = dict(window=args.window, softcap=args.softcap)
    torch.set_num_threads(args.threads)
    if not (ops.paged_prefill_float32() if dtype == torch.float32 else ops.decode_linear_available()):
        raise SystemExit(f"the prefill tiles in {args.dtype} need the CPU kernels built with "
                         f"{'AVX2 and FMA, or AVX512' if dtype == torch.float32 else 'AVX512-BF16'}; not here")
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    q_lens = [rng.randint(32, 512) for _ in range(args.prompts)]
    need = [-(-n // BLOCK) for n in q_lens]
    cache = KVCache(1, sum(need) + 4, BLOCK, KV_HEADS, head_dim, dtype=kv_dtype)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen).to(kv_dtype))
    free = list(range(cache.num_blocks))
    rng.shuffle(free)
    tables = torch.zeros(len(q_lens), max(need), dtype=torch.long)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor([free.pop() for _ in range(n)])
    rows = sum(q_lens)
    q = torch.randn(rows, HEADS, head_dim, generator=gen).to(dtype)
    key_cache, value_cache = cache.key_cache[0], cache.value_cache[0]
    starts = torch.tensor([0] + q_lens).cumsum(0)
    lens = torch.tensor(q_lens)
    row_seqs = torch.repeat_interleave(torch.arange(len(q_lens)), lens)
    row_lens = torch.cat([torch.arange(1, n + 1) for n in q_lens])
    scale = head_dim ** -0.5
    seqs = [(tables[s, :n].tolist(), 0, q_len) for s, (n, q_len) in enumerate(zip(need, q_lens, strict=True))]
    flash = PagedAttention.build(cache, BLOCK, seqs, impl="fast")  # no prefill_rows: gather + SDPA
    ways = {
        "prefill tiles": lambda: ops.paged_prefill(q, key_cache, value_cache, tables, starts, lens, scale, **rules),
        "row kernel": lambda: ops.paged_attention(q, key_cache, value_cache, tables, row_lens, scale,
                                                          row_seqs, **rules)[0],
        "gather + flash attention": lambda: flash._attend_fast(q, key_cache, value_cache, scale),
    }
    if args.window or args.softcap or kv_dtype != dtype:
        del ways["gather + flash attention"]
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(args.rounds):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            best[name] = min(best[name], time.perf_counter() - start)
    first = q_lens[0] + q_lens[1]  # float64 reference over the first two prompts' rows
    keys = cache.key_cache[0].reshape(-1, KV_HEADS, head_dim).double().repeat_interleave(HEADS // KV_HEADS, 1)
    values = cache.value_cache[0].reshape(-1, KV_HEADS, head_dim).double().repeat_interleave(HEADS // KV_HEADS, 1)
    exact = torch.empty(first, HEADS, head_dim, dtype=torch.float64)
    for r in range(first):
        s, n = int(row_seqs[r]), int(row_lens[r])
        slots = tables[s, torch.arange(n) // BLOCK] * BLOCK + torch.arange(n) % BLOCK
        scores = torch.einsum("hd,khd->hk", q[r].double(), keys[slots]) * scale
        if args.softcap:
            scores = args.softcap * torch.tanh(scores / args.softcap)
        if args.window:
            scores[:, :max(0, n - args.window)] = float("-inf")
        probs = scores.softmax(-1)
        exact[r] = torch.einsum("hk,khd->hd", probs, values[slots])
    print(f"{args.dtype}, KV cache {str(kv_dtype).removeprefix('torch.')}, {len(q_lens)} prompts, {rows} rows, {args.threads} threads, best of {args.rounds}, one layer, "
          f"window {args.window}, softcap {args.softcap}")
    print("| attention | ms | against the tiles | mean / max difference from float64 |")
    print("|---|---|---|---|")
    for name, way in ways.items():
        diff = (way()[:first].double() - exact).abs()
        print(f"| {name} | {best[name] * 1e3:.1f} | {best[name] / best['prefill tiles']:.2f}x | "
              f"{diff.mean():.2e} / {diff.max():.2e} |")


if __name__ == "__main__":
    main()
