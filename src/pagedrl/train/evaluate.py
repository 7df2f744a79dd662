"""`pagedrl eval`: held-out accuracy of any checkpoint on the built-in arithmetic task, with the
paged engine (greedy), the same measurement GRPO logs as `eval/accuracy`; with `--perplexity FILE`
also its perplexity on a text (`train/perplexity.py`), what a precision or quantization costs."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.precision import ACTIVATIONS, DTYPE_CHOICES, DTYPE_HELP, QUANTIZATIONS
from pagedrl.train.data import load_examples
from pagedrl.train.examples import PromptOnly, PromptRows
from pagedrl.train.perplexity import perplexity_of_file
from pagedrl.train.rl.arithmetic import ArithmeticTask
from pagedrl.train.rl.rewards import RewardFunc, last_integer_match, score
from pagedrl.train.rl.rollout import completion_for
from pagedrl.train.significance import wilson_interval


def score_sums(values: Sequence[float]) -> tuple[float, float, int]:
    """(completions scoring 1, sum of scores, completions scored) of per-row scores, sums that add
    across ranks; NaN scores are not applicable and left out."""
    scored = [v for v in values if v == v]
    return sum(1.0 for v in scored if v >= 1.0), float(sum(scored)), len(scored)


# Rows generated together in one evaluation batch. In bf16 a row's logits depend (in their last bits)
# on which rows share its batch, and a greedy answer can follow those bits: an evaluation batched by
# each engine's own capacity would give a model a different accuracy in a trainer's rollout engine
# than in a fresh one. Fixed groups, small enough for the smallest rollout engine, make the
# evaluation one computation whichever engine runs it.
EVAL_BATCH = 16


def greedy_scores(llm: LLM, rows: Sequence[PromptOnly], reward: tuple[str, RewardFunc],
                  max_tokens: int) -> list[float]:
    """Each row's greedy completion scored by `reward`, in the rows' order (NaN: not applicable):
    the per-problem outcomes an accuracy, its interval and a paired test are computed from."""
    if not rows:
        return []
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = [out for start in range(0, len(rows), EVAL_BATCH)
            for out in llm.generate([r.prompt_ids for r in rows[start:start + EVAL_BATCH]], params, use_tqdm=False)]
    prompts = [r.prompt for r in rows]
    completions = [completion_for(p, o.outputs[0].text) for p, o in zip(prompts, outs, strict=True)]
    columns: dict[str, list[Any]] = {}
    for r in rows:
        for k, v in r.columns.items():
            columns.setdefault(k, []).append(v)
    return [float(row[0]) for row in score([reward], prompts, completions,
                                           [o.outputs[0].token_ids for o in outs], columns)]


def eval_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagedrl eval", description=__doc__)
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face folder or Hub id, .gguf file or the default's name")
    parser.add_argument("--revision", default=None, help="the branch, tag or commit of a Hub id MODEL")
    parser.add_argument("--operations", default="+", help="operations to draw from, e.g. '+-'")
    parser.add_argument("--low", type=int, default=10)
    parser.add_argument("--high", type=int, default=99)
    parser.add_argument("--num-problems", type=int, default=256,
                        help="held-out problems (the task's eval set); 0: no arithmetic accuracy")
    parser.add_argument("--seed", type=int, default=0, help="the task's seed (GRPO uses its config seed)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="gguf: a .gguf model's quantized weights stay quantized; int8 / int4: weight-only "
                        "quantization made at load (see `pagedrl serve --help`)")
    parser.add_argument("--activations", choices=ACTIVATIONS, default="float32",
                        help="with --quantization: int8, the Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / K-quant products on 8-bit activations "
                        "(llama.cpp's arithmetic; see `pagedrl serve --help`)")
    parser.add_argument("--perplexity", metavar="FILE", default=None,
                        help="also the model's perplexity on the text in FILE (e.g. examples/data/perplexity.txt)")
    parser.add_argument("--window", type=int, default=1024, help="--perplexity: tokens per window (context included)")
    parser.add_argument("--stride", type=int, default=512, help="--perplexity: new tokens scored per window")
    args = parser.parse_args(argv)
    if args.num_problems < 0:
        parser.error(f"--num-problems must be >= 0, got {args.num_problems}")
    if args.num_problems == 0 and args.perplexity is None:
        parser.error("nothing to evaluate: --num-problems 0 needs --perplexity FILE")
    try:  # the task's settings are checked before the model loads
        task = ArithmeticTask(tuple(args.operations), args.low, args.high, max(args.num_problems, 1), seed=args.seed)
    except ValueError as e:
        parser.error(str(e))
    try:  # a model that cannot load (CheckpointError included): one line naming it
        llm = LLM(args.model, revision=args.revision, dtype=args.dtype, quantization=args.quantization,
                  activations=args.activations)
    except ValueError as e:
        print(f"pagedrl eval: {e}", file=sys.stderr)
        return 2
    print(f"[precision: {llm.precision.describe()}]", file=sys.stderr)
    if args.perplexity is not None:
        t0 = time.perf_counter()
        try:
            result = perplexity_of_file(llm, args.perplexity, args.window, args.stride)
        except ValueError as e:
            parser.error(str(e))
        print(f"{result.describe()} on {args.perplexity} ({time.perf_counter() - t0:.1f} s)")
    if args.num_problems == 0:
        return 0
    rows, _ = load_examples(task.eval_rows(), PromptRows(llm.tokenizer, None))
    t0 = time.perf_counter()
    correct, _, scored = score_sums(greedy_scores(llm, rows, ("last_integer_match", last_integer_match),
                                                  args.max_tokens))
    low, high = wilson_interval(int(correct), scored)
    print(f"accuracy {correct / scored:.4f} (95% interval [{low:.3f}, {high:.3f}]) on {scored} held-out problems "
          f"({time.perf_counter() - t0:.1f} s, greedy, max_tokens={args.max_tokens})")
    return 0
