"""`pagedrl eval`: held-out accuracy of any checkpoint on the built-in arithmetic task, with the
paged engine (greedy), the same measurement GRPO logs as `eval/accuracy`."""

from __future__ import annotations

import argparse
import time

from pagedrl.train.arithmetic import ArithmeticTask
from pagedrl.train.rewards import last_integer_match
from pagedrl.train.tokenization import tokenize_prompt


def eval_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagedrl eval", description=__doc__)
    parser.add_argument("model", nargs="?", default=None, help="HF folder, .gguf file or the default's name")
    parser.add_argument("--operations", default="+", help="operations to draw from, e.g. '+-'")
    parser.add_argument("--low", type=int, default=10)
    parser.add_argument("--high", type=int, default=99)
    parser.add_argument("--num-problems", type=int, default=256, help="held-out problems (the task's eval set)")
    parser.add_argument("--seed", type=int, default=0, help="the task's seed (GRPO uses its config seed)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    from pagedrl import LLM
    from pagedrl.train.grpo import evaluate_rows

    task = ArithmeticTask(tuple(args.operations), args.low, args.high, args.num_problems, seed=args.seed)
    llm = LLM(args.model)
    t0 = time.perf_counter()
    acc, _ = evaluate_rows(llm, task.eval_rows(), lambda r: tokenize_prompt(llm.tokenizer, r["prompt"]),
                           ("last_integer_match", last_integer_match), args.max_tokens)
    print(f"accuracy {acc:.4f} on {args.num_problems} held-out problems "
          f"({time.perf_counter() - t0:.1f} s, greedy, max_tokens={args.max_tokens})")
    return 0
