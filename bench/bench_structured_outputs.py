"""What structured outputs cost the engine per step, at 64 concurrent constrained streams.

Two measurements on the default model (SmolLM2-135M, 49k vocabulary):

1. The mask alone, per step of 64 rows: the grammars' bitmasks (llguidance, one per sequence, each
   advancing along a valid JSON document) plus applying them in the sampler, against the sampler
   on the same logits without masks. This is the overhead a step pays for 64 constrained rows.
2. End to end: 64 chat requests through `LLM.generate` with a JSON schema, against the same 64
   requests unconstrained and forced to the same number of tokens; time per generated token, the
   best of `--repeats` alternating runs (a shared machine's noise only ever adds time).

    OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 PYTHONPATH=src python bench/bench_structured_outputs.py [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")

import torch  # noqa: E402

from pagedrl.engine.llm import LLM  # noqa: E402
from pagedrl.engine.sampler import Sampler, SamplingRow  # noqa: E402
from pagedrl.engine.sampling_params import SamplingParams  # noqa: E402
from pagedrl.engine.structured_outputs import StructuredOutputsParams  # noqa: E402

STREAMS = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "tags", "address", "role"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"],
                       "address": {"city": "London", "zip": "01234"}, "role": "admin"}, separators=(",", ":"))


def mask_cost(llm: LLM, device: str) -> None:
    engine = llm.engine
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    compiler = engine.grammar_compiler()
    compiler.check(so)  # tokenizer tables built outside the timing
    doc = llm.tokenizer.encode(DOCUMENT, add_special_tokens=False)
    vocab = llm.vocab_size
    # temperature 0.8: unmasked rows take the same processing path as masked ones (no fast path)
    params = SamplingParams(temperature=0.8, max_tokens=len(doc))
    sampler = Sampler(torch.Generator(device=device).manual_seed(0))
    buf = torch.empty(STREAMS, compiler.words, dtype=torch.int32)
    torch.manual_seed(0)
    logits = torch.randn(STREAMS, vocab, device=device) * 4
    plain_rows = [SamplingRow(params=params) for _ in range(STREAMS)]
    start = time.perf_counter()
    matchers = [compiler.matcher(so) for _ in range(STREAMS)]
    new_matchers = (time.perf_counter() - start) / STREAMS
    fill, apply, plain = [], [], []
    rows = [SamplingRow(params=params, token_bitmask=buf[j]) for j in range(STREAMS)]
    for token in doc:  # every stream at the same place in the document: each step a different state
        # the masks once (a second computation of the same state is cheaper than the first), the
        # sampler the best of 3: noise only adds time
        fill.append(_timed(lambda: [m.fill_bitmask(buf[j]) for j, m in enumerate(matchers)], device))
        apply.append(min(_timed(lambda: sampler(logits, rows), device) for _ in range(3)))
        plain.append(min(_timed(lambda: sampler(logits, plain_rows), device) for _ in range(3)))
        for m in matchers:
            m.accept(token)
    base = statistics.median(plain)
    masked = statistics.median(apply)
    print(f"[1] {STREAMS} constrained rows per step, {len(doc)} steps (median over steps), vocabulary {vocab}, {device}")
    print(f"    grammar bitmasks (llguidance):  {1e3 * statistics.median(fill):7.2f} ms/step "
          f"(mean {1e3 * statistics.mean(fill):.2f}, {1e6 * statistics.median(fill) / STREAMS:.1f} us/row)")
    print(f"    sampler without masks:          {1e3 * base:7.2f} ms/step")
    print(f"    sampler with masks:             {1e3 * masked:7.2f} ms/step  (+{1e3 * (masked - base):.2f} ms)")
    total = statistics.median(fill) + masked - base
    print(f"    mask overhead per step:         {1e3 * total:7.2f} ms  ({1e6 * total / STREAMS:.1f} us per row)")
    print(f"    new matcher per sequence:       {1e3 * new_matchers:7.3f} ms")


def _timed(fn, device: str) -> float:
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def end_to_end(llm: LLM, max_tokens: int, repeats: int) -> None:
    convs = [[{"role": "user", "content": f"Describe person number {i} as JSON: name, age, tags, address, role."}]
             for i in range(STREAMS)]
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    llm.chat(convs[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    llm.engine.grammar_compiler().check(so)
    constrained = SamplingParams(temperature=0.8, seed=0, max_tokens=max_tokens, structured_outputs=so)
    constrained_s = free_s = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.chat(convs, constrained, use_tqdm=False)
        constrained_s = min(constrained_s, time.perf_counter() - start)
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        free_params = [SamplingParams(temperature=0.8, seed=0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        free = llm.chat(convs, free_params, use_tqdm=False)
        free_s = min(free_s, time.perf_counter() - start)
        assert [len(o.outputs[0].token_ids) for o in free] == lengths
    valid = sum(o.outputs[0].finish_reason == "stop" and isinstance(json.loads(o.outputs[0].text), dict) for o in outs)
    tokens = sum(lengths)
    print(f"[2] {STREAMS} chat requests, {tokens} tokens ({valid}/{STREAMS} finished as valid JSON)")
    print(f"    unconstrained (same lengths):   {free_s:6.2f} s  {1e3 * free_s / tokens:6.2f} ms/token")
    print(f"    JSON schema:                    {constrained_s:6.2f} s  {1e3 * constrained_s / tokens:6.2f} ms/token")
    print(f"    ratio constrained / unconstrained: {constrained_s / free_s:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-end-to-end", action="store_true")
    args = parser.parse_args()
    llm = LLM(device=args.device)
    mask_cost(llm, args.device)
    if not args.skip_end_to_end:
        end_to_end(llm, args.max_tokens, args.repeats)


if __name__ == "__main__":
    main()
