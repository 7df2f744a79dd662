"""What a precision or a quantization costs the default model: its perplexity on a fixed text
(`examples/data/perplexity.txt`) and its held-out arithmetic accuracy (the task GRPO trains on,
greedy), each variant against float32 with an exact McNemar test on the problems one gets right and
the other wrong. The numbers come from the engine, as served (`pagedrl eval` computes the same).

The default model ships as a Q4_1 GGUF; its float32 model is that file dequantized, so Q4_1 kept
quantized gives float32's numbers bit for bit (tests/test_gguf_engine.py) and is not a row here. The
other files are made from it: Q8_0 by `bench/gguf_requantize.py`, Q4_K_M by llama.cpp's
`llama-quantize` from its bf16 GGUF (built by `bench/llamacpp_env.sh`; this model's 576-wide rows are
not a multiple of 256, so llama.cpp falls back to Q5_0 for most of its projections).

    .venv/bin/python bench/quant_accuracy.py [--variants float32,bfloat16,q8_0,q4_k_m,int8,int4]
        [--num-problems 256]
    .venv/bin/python bench/quant_accuracy.py --variants float32,q4_1-a8,q8_0-a8

`-a8` (q4_1-a8: the default Q4_1 file; q8_0-a8): the file kept quantized with `activations="int8"`, its
Q8_0 / Q4_0 / Q4_1 products on 8-bit activations as llama.cpp computes them. `-kvbf16` after any
variant (float32-kvbf16): its KV cache in bf16 (`kv_cache_dtype="bfloat16"`).

    .venv/bin/python bench/quant_accuracy.py --variants float32,float32-kvbf16,q8_0-a8-kvbf16
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

from bench_vllm_cpu import gguf_file  # noqa: E402

from pagedrl.engine.llm import LLM  # noqa: E402
from pagedrl.kernels import isa  # noqa: E402
from pagedrl.model.precision import QUANTIZATIONS  # noqa: E402
from pagedrl.train.data import load_examples  # noqa: E402
from pagedrl.train.evaluate import greedy_scores  # noqa: E402
from pagedrl.train.examples import PromptRows  # noqa: E402
from pagedrl.train.perplexity import perplexity_of_file  # noqa: E402
from pagedrl.train.rl.arithmetic import ArithmeticTask  # noqa: E402
from pagedrl.train.rl.rewards import last_integer_match  # noqa: E402
from pagedrl.train.significance import compare, wilson_interval  # noqa: E402

TEXT = ROOT / "examples" / "data" / "perplexity.txt"


def engine(variant: str) -> tuple[LLM, str]:
    """The engine of a variant and what it holds. float32 / bfloat16: the default model in that
    precision; q8_0 / q4_k_m: those GGUFs, dequantized to float32 at load (kept quantized, a file of types
    pagedrl multiplies as blocks computes the same numbers); int8 / int4: `--quantization` at load;
    `-kvbf16` appended: the same with a bf16 KV cache."""
    if variant.endswith("-kvbf16"):
        llm, held = engine_of(variant.removesuffix("-kvbf16"), kv_cache_dtype="bfloat16")
        return llm, f"{held}; KV cache in bf16"
    return engine_of(variant)


def engine_of(variant: str, **settings: str) -> tuple[LLM, str]:
    if variant in ("float32", "bfloat16"):
        return LLM(None, dtype=variant, **settings), f"Q4_1 file dequantized, {variant}"
    if variant == "q8_0":
        return LLM(str(gguf_file("q8_0")), dtype="float32", **settings), "Q4_1 requantized to Q8_0"
    if variant == "q4_k_m":
        return LLM(str(gguf_file("q4_k_m")), dtype="float32", **settings), "llama-quantize Q4_K_M of the bf16 GGUF"
    if variant.endswith("-a8"):
        kind = variant.removesuffix("-a8")
        llm = LLM(str(gguf_file(kind)), quantization="gguf", activations="int8", **settings)
        return llm, llm.precision.describe()
    if variant in QUANTIZATIONS:
        llm = LLM(None, dtype="float32", quantization=variant, **settings)
        return llm, llm.precision.describe()
    raise SystemExit(f"unknown variant {variant!r}: float32, bfloat16, q8_0, q4_k_m, q4_1-a8, q8_0-a8, or one of {QUANTIZATIONS}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="float32,bfloat16,q8_0,q4_k_m,int8,int4")
    parser.add_argument("--num-problems", type=int, default=256)
    args = parser.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if variants[0] != "float32":
        variants.insert(0, "float32")  # the base every other variant is compared with
    task = ArithmeticTask(("+",), 10, 99, args.num_problems, seed=0)
    print(f"CPU class {isa.describe()}; {args.num_problems} held-out problems; text {TEXT.name}")
    base: list[float] = []
    rows_out = []
    for variant in variants:
        t0 = time.perf_counter()
        llm, held = engine(variant)
        ppl = perplexity_of_file(llm, TEXT)
        rows, _ = load_examples(task.eval_rows(), PromptRows(llm.tokenizer, None))
        scores = greedy_scores(llm, rows, ("last_integer_match", last_integer_match), 64)
        correct = [s >= 1.0 for s in scores]
        if variant == "float32":
            base = scores
        test = compare([s >= 1.0 for s in base], correct)
        low, high = wilson_interval(sum(correct), len(correct))
        row = (f"| {variant} | {held} | {ppl.token_perplexity:.3f} | "
               f"{ppl.word_perplexity:.3f} | {sum(correct) / len(correct):.3f} [{low:.3f}, {high:.3f}] | "
               f"{test.fixed} / {test.broken}, p = {test.p_value:.3g} |")
        rows_out.append(row)
        print(row, f"({time.perf_counter() - t0:.0f} s)", flush=True)
        del llm
    print("\n| variant | weights | perplexity / token | / word | arithmetic accuracy [95%] | vs float32: fixed / broken |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows_out))


if __name__ == "__main__":
    main()
