"""Where a quantized engine's decode time goes, per GGUF block type: a single stream decoded with the
file kept quantized (`quantization="gguf"`), every call of the CPU kernels timed in process CPU time
(not wall time: on a shared machine another process's turns do not count) and the products summed per
block type, with the bytes each type streams a token and the speed that makes. Files alternate, best of
`--rounds` by total.

A mixed file such as llama.cpp's Q4_K_M (most projections Q5_0 where 256 does not divide a row, some
Q6_K and Q4_K, a Q8_0 embedding) streams at the speed of its slowest types; this says which.

    .venv/bin/python bench/bench_gguf_types.py [--files a.gguf,b.gguf] [--tokens 64] [--rounds 2]
        [--activations float32|int8|both]
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable
from typing import Any

import torch
from gguf import GGMLQuantizationType

from pagedrl import LLM, SamplingParams
from pagedrl.kernels import isa, ops
from pagedrl.model.default import default_gguf_path
from pagedrl.model.gguf_rows8 import ROWS8


def type_name(kernel_type: int) -> str:
    """A kernel's type id as the GGML type's name, `rows8` where the blocks are in that layout."""
    kernel_type = int(kernel_type)
    rows8 = kernel_type >= ROWS8
    return GGMLQuantizationType(kernel_type - ROWS8 * rows8).name + " rows8" * rows8


class TimedOps:
    """Stands in for the kernels' op namespace: each call timed, products keyed by block type."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.bytes: dict[str, int] = collections.defaultdict(int)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        fn = getattr(self.real, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.process_time()
            out = fn(*args, **kwargs)
            key = name
            if name in ("gguf_linear", "gguf_linear_int8"):
                key = f"{type_name(args[2])} products" + (" (int8 activations)" * name.endswith("8"))
                self.bytes[key] += args[1].numel()
            elif name == "gguf_linear_int8_many":  # a layer's q, k, v (gate, up) in one call
                types = "+".join(sorted({type_name(t) for t in args[2]}))
                key = f"{types} products (int8 activations, several a call)"
                self.bytes[key] += sum(b.numel() for b in args[1])
            self.seconds[key] += time.process_time() - start
            return out

        return timed

    def clear(self) -> None:
        self.seconds.clear()
        self.bytes.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", default=str(default_gguf_path()))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--activations", default="float32", help="float32, int8 (llama.cpp's arithmetic), or both: each "
                    "file twice")
    args = ap.parse_args()
    torch.set_num_threads(1)
    assert ops.available(), "the CPU kernels are not built here"
    files = args.files.split(",")
    kinds = ["float32", "int8"] if args.activations == "both" else [args.activations]
    engines = {f"{f} ({a} activations)": LLM(f, quantization="gguf", activations=a, kv_cache_tokens=2048)
               for f in files for a in kinds}
    timed = TimedOps(ops._OPS)
    ops._OPS = timed
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    prompt = [[1] * 128]
    best: dict[str, tuple[float, dict[str, float], dict[str, int]]] = {}
    for _ in range(args.rounds):
        for f, llm in engines.items():
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
            timed.clear()
            start = time.process_time()
            llm.generate(prompt, params, use_tqdm=False)
            total = time.process_time() - start
            if f not in best or total < best[f][0]:
                best[f] = (total, dict(timed.seconds), dict(timed.bytes))
    print(f"CPU class {isa.describe()}; one thread; a 128-token prompt, {args.tokens} tokens decoded; "
          "process CPU ms a token (prefill included)")
    for f, (total, seconds, sizes) in best.items():
        print(f"\n{f}: {total / args.tokens * 1e3:.2f} ms a token")
        print("| kernel | ms a token | MB a token | GB/s |")
        print("|---|---|---|---|")
        for key, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
            per_token = s / args.tokens
            if per_token < 5e-5:
                continue
            mb = sizes.get(key, 0) / args.tokens / 1e6
            speed = f"{sizes[key] / s / 1e9:.1f}" if key in sizes else ""
            print(f"| {key} | {per_token * 1e3:.2f} | {mb:.1f} | {speed} |" if mb else
                  f"| {key} | {per_token * 1e3:.2f} | | |")


if __name__ == "__main__":
    main()
