"""`pagedrl generate`: text from the paged engine, offline, with the chat template unless `--raw`."""

from __future__ import annotations

import argparse
import sys
import time

from pagedrl.engine.engine_args import EngineArgs, add_engine_arguments

# --seed is the requests' sampling seed here (the engine's, for requests without one, stays 0), and
# adapters chosen per request need a server: a LoRA adapter is folded in with --adapter.
ENGINE_SKIP = ("seed", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")


def generate_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagedrl generate", description="Generate text with the paged engine.")
    sampling = parser.add_argument_group("the prompts and their sampling")
    sampling.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    sampling.add_argument("--max-tokens", type=int, default=128)
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--seed", type=int, default=None, help="the requests' sampling seed (default: none)")
    sampling.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    add_engine_arguments(parser, skip=ENGINE_SKIP)
    args = parser.parse_args(argv)

    from pagedrl import LLM, SamplingParams

    try:  # the sampling settings are checked before the model loads
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
    except ValueError as e:
        parser.error(str(e).replace("SamplingParams.", "--").replace("_", "-"))
    t0 = time.perf_counter()
    try:  # a model that cannot load (CheckpointError included) or a prompt the engine refuses: one line
        llm = LLM.from_engine_args(EngineArgs.from_cli_args(args, skip=ENGINE_SKIP))
        load_s = time.perf_counter() - t0
        print(f"[precision: {llm.precision.describe()}]", file=sys.stderr)
        t1 = time.perf_counter()
        use_chat = not args.raw and llm.tokenizer is not None and llm.tokenizer.chat_template is not None
        if use_chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params, use_tqdm=False)
        else:
            outputs = llm.generate(args.prompt, params, use_tqdm=False)
    except ValueError as e:
        print(f"pagedrl generate: {e}", file=sys.stderr)
        return 2
    gen_s = time.perf_counter() - t1
    for prompt, out in zip(args.prompt, outputs, strict=True):
        print(f">>> {prompt}\n{out.outputs[0].text.strip()}\n")
    ntok = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"[loaded in {load_s:.1f} s; {ntok} tokens in {gen_s:.1f} s, {ntok / max(gen_s, 1e-9):.1f} tokens/s]",
          file=sys.stderr)
    return 0
