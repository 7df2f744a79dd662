"""Generation time of one seeded GRPO-shaped rollout, for comparing two versions of the code on the
same machine: 8 arithmetic prompts x n=8, 64 tokens each (`ignore_eos`), one thread, 3 runs after a
warm-up. Point PYTHONPATH at each tree in turn:

    PYTHONPATH=<old-tree>/src .venv/bin/python bench/bench_generate_ab.py old
    PYTHONPATH=src .venv/bin/python bench/bench_generate_ab.py new
"""

from __future__ import annotations

import sys
import time

import torch

from pagedrl import LLM, SamplingParams

try:
    from pagedrl.train.rl.arithmetic import ArithmeticTask
except ImportError:  # before train/ was split into wings
    from pagedrl.train.arithmetic import ArithmeticTask  # type: ignore[no-redef]


def main() -> None:
    torch.set_num_threads(1)
    llm = LLM(kv_cache_tokens=16384, seed=0)
    stream = ArithmeticTask(seed=42).train_rows()
    prompts = [llm.tokenizer.apply_chat_template(next(stream)["prompt"], add_generation_prompt=True, tokenize=True)
               for _ in range(8)]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=64, ignore_eos=True, seed=1)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    label = sys.argv[1] if len(sys.argv) > 1 else "this tree"
    print(f"{label}: generate 64 x 64 tokens: {[round(s, 2) for s in seconds]} s")


if __name__ == "__main__":
    main()
