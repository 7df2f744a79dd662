"""`pagedrl generate`: text from the paged engine, offline, with the chat template unless `--raw`."""

from __future__ import annotations

import argparse
import sys
import time

from pagedrl.model.precision import DTYPE_CHOICES, DTYPE_HELP


def generate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagedrl generate", description="Generate text with the paged engine.")
    parser.add_argument("model", nargs="?", default=None,
                        help="Hugging Face folder or Hub id, .gguf file or 'smollm2-135m-instruct' (default)")
    parser.add_argument("--revision", default=None, help="the branch, tag or commit of a Hub id MODEL")
    parser.add_argument("--adapter", default=None, metavar="PATH",
                        help="a LoRA adapter folder or Hub id (PEFT's format)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    args = parser.parse_args(argv)

    from pagedrl import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, adapter=args.adapter, revision=args.revision, kv_cache_tokens=args.kv_cache_tokens,
              dtype=args.dtype)
    load_s = time.perf_counter() - t0
    print(f"[precision: {llm.precision.describe()}]", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    t1 = time.perf_counter()
    use_chat = not args.raw and llm.tokenizer is not None and llm.tokenizer.chat_template is not None
    if use_chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
    else:
        outputs = llm.generate(args.prompt, params, use_tqdm=False)
    gen_s = time.perf_counter() - t1
    for prompt, out in zip(args.prompt, outputs, strict=True):
        print(f">>> {prompt}\n{out.outputs[0].text.strip()}\n")
    ntok = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[loaded in {load_s:.1f} s; {ntok} tokens in {gen_s:.1f} s, {ntok / max(gen_s, 1e-9):.1f} tokens/s]",
          file=sys.stderr)
    return 0
