"""The float32 engine with its kernel's row cap at this CPU class's value (`products.MAX_ROWS_FLOAT`)
against the cap of 32 rows every class had before, in one process, turns alternating, best of
`--rounds`: the products of prefill chunks and of decode steps of more than 32 rows go to the
engine's float32 kernel or to MKL. Default model, float32, greedy, `ignore_eos`.

    .venv/bin/python bench/bench_float_rows_cap.py [--threads 1] [--rounds 3]
    .venv/bin/python -m pagedrl.kernels.isa run avx2 -- .venv/bin/python bench/bench_float_rows_cap.py
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from pagedrl import LLM, SamplingParams
from pagedrl.kernels import isa, products


def workloads(vocab: int) -> dict[str, tuple[list[list[int]], SamplingParams]]:
    """Prompts of random token ids: 16 of 32-512 tokens x 32 new ones (prefill-heavy), 64 of 40
    tokens x 32 new ones (decode steps of 64 rows)."""
    rng = random.Random(0)

    def prompts(count: int, low: int, high: int) -> list[list[int]]:
        return [[rng.randrange(100, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]

    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    return {"16 prompts of 32-512 tokens x 32": (prompts(16, 32, 512), params),
            "64 prompts of 40 tokens x 32": (prompts(64, 40, 40), params)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    here = products.MAX_ROWS_FLOAT
    llm = LLM(dtype="float32", kv_cache_tokens=16384, seed=0)
    print(f"CPU class {isa.describe()}; {args.threads} thread(s); cap here {here} rows, before 32")
    print("| workload | cap 32 (tok/s) | cap here (tok/s) | here / 32 |")
    print("|---|---|---|---|")
    for name, (prompts, params) in workloads(llm.tokenizer.vocab_size).items():
        best = {32: 0.0, here: 0.0}
        for _ in range(args.rounds):
            for cap in (32, here):
                products.MAX_ROWS_FLOAT = cap
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
                tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
                best[cap] = max(best[cap], tokens / seconds)
        products.MAX_ROWS_FLOAT = here
        print(f"| {name} | {best[32]:.1f} | {best[here]:.1f} | {best[here] / best[32]:.2f}x |")


if __name__ == "__main__":
    main()
