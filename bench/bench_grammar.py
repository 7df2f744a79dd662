"""Grammar libraries for structured outputs, measured on the default model's tokenizer (SmolLM2, 49k tokens).

For each of llguidance, xgrammar and outlines-core that is importable, one run prints:
  - tokenizer set-up: the one-off cost of preparing the vocabulary (per engine start);
  - schema compile: the cost of turning one JSON schema into a matcher (per request);
  - mask per token: the mean time to compute the allowed-token mask, one thread, while walking a
    valid JSON document token by token (what the sampler pays per constrained sequence per step).
The mask walk also checks that every library allows each token of the document (a sanity check).

    OMP_NUM_THREADS=1 RAYON_NUM_THREADS=1 PYTHONPATH=src python bench/bench_grammar.py

Libraries that are not installed are reported as such; the chosen one (llguidance) is a runtime
dependency of pagedrl, the others can be installed beside it for the comparison.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("RAYON_NUM_THREADS", "1")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "address", "role"],
    "additionalProperties": False,
}
DOCUMENT = json.dumps({
    "name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "engines", "poetry"],
    "address": {"city": "London", "zip": "01234"}, "role": "admin",
}, separators=(",", ":"))


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def bench_llguidance(tokenizer_json: str, eos: int, tokens: list[int]) -> dict[str, float]:
    import llguidance
    import numpy as np

    setup, tok = timed(lambda: llguidance.LLTokenizer(tokenizer_json, eos_token=eos))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    compile_s, matcher = timed(lambda: llguidance.LLMatcher(tok, grammar))
    assert not matcher.is_error(), matcher.get_error()
    words = (tok.vocab_size + 31) // 32
    mask = np.zeros(words, dtype=np.int32)
    times = []
    for t in tokens:
        start = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
        times.append(time.perf_counter() - start)
        assert (int(mask[t // 32]) >> (t % 32)) & 1, f"llguidance refuses token {t}"
        assert matcher.consume_token(t), matcher.get_error()
    assert matcher.is_accepting()
    return {"setup_s": setup, "compile_s": compile_s, "mask_us": 1e6 * statistics.mean(times),
            "mask_median_us": 1e6 * statistics.median(times), "mask_max_us": 1e6 * max(times)}


def bench_xgrammar(folder: str, eos: int, vocab: int, tokens: list[int]) -> dict[str, float]:
    import torch
    import xgrammar
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(folder, "tokenizer.json"))
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    setup = time.perf_counter() - start
    compile_s, compiled = timed(lambda: compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                         separators=(",", ":")))
    matcher = xgrammar.GrammarMatcher(compiled)
    mask = xgrammar.allocate_token_bitmask(1, vocab)
    times = []
    for t in tokens:
        start = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - start)
        assert (int(mask[0, t // 32]) >> (t % 32)) & 1, f"xgrammar refuses token {t}"
        assert matcher.accept_token(t)
    assert matcher.is_terminated() or matcher.accept_token(info.stop_token_ids[0])
    del torch
    return {"setup_s": setup, "compile_s": compile_s, "mask_us": 1e6 * statistics.mean(times),
            "mask_median_us": 1e6 * statistics.median(times), "mask_max_us": 1e6 * max(times)}


def _byte_level_vocab(tokenizer_json: str) -> dict[bytes, list[int]]:
    """Token bytes of a byte-level BPE vocabulary (GPT-2's printable-byte alphabet undone)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    decoder = {chr(c): b for b, c in zip(printable, chars, strict=True)}
    data = json.loads(tokenizer_json)
    out: dict[bytes, list[int]] = {}
    special = {t["id"] for t in data.get("added_tokens", []) if t.get("special")}
    for piece, i in data["model"]["vocab"].items():
        if i not in special:
            out.setdefault(bytes(decoder[c] for c in piece), []).append(i)
    return out


def bench_outlines_core(tokenizer_json: str, eos: int, vocab: int, tokens: list[int]) -> dict[str, float]:
    import numpy as np
    import outlines_core

    setup, vocabulary = timed(lambda: outlines_core.Vocabulary(eos, _byte_level_vocab(tokenizer_json)))
    regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(SCHEMA))
    compile_s, index = timed(lambda: outlines_core.Index(regex, vocabulary))
    guide = outlines_core.Guide(index)
    mask = np.zeros((vocab + 31) // 32, dtype=np.int32)
    times = []
    for t in tokens:
        start = time.perf_counter()
        guide.write_mask_into(mask.ctypes.data, mask.size, 4)
        times.append(time.perf_counter() - start)
        assert (int(mask[t // 32]) >> (t % 32)) & 1, f"outlines-core refuses token {t}"
        guide.advance(t)
    assert guide.is_finished() or eos in guide.get_tokens()
    return {"setup_s": setup, "compile_s": compile_s, "mask_us": 1e6 * statistics.mean(times),
            "mask_median_us": 1e6 * statistics.median(times), "mask_max_us": 1e6 * max(times)}


def main() -> None:
    from pagedrl.model.default import resolve_default_model
    from pagedrl.model.tokenizer import Tokenizer

    folder = resolve_default_model()
    tokenizer = Tokenizer.from_folder(folder)
    tokenizer_json = (folder / "tokenizer.json").read_text()
    eos = tokenizer.eos_token_id
    vocab = tokenizer.vocab_size
    tokens = tokenizer.encode(DOCUMENT, add_special_tokens=False)
    print(f"tokenizer: {folder.name}, {vocab} tokens; document: {len(tokens)} tokens; one thread")
    runs = {
        "llguidance": lambda: bench_llguidance(tokenizer_json, eos, tokens),
        "xgrammar": lambda: bench_xgrammar(str(folder), eos, vocab, tokens),
        "outlines-core": lambda: bench_outlines_core(tokenizer_json, eos, vocab, tokens),
    }
    results: dict[str, dict[str, float]] = {}
    print(f"{'library':<14} {'tokenizer setup':>16} {'schema compile':>15} {'mask/token':>11} {'median':>9} {'max':>9}")
    for name, run in runs.items():
        try:
            r = results[name] = run()
        except ImportError as exc:
            print(f"{name:<14} not installed ({exc.name})")
            continue
        print(f"{name:<14} {r['setup_s'] * 1e3:>13.0f} ms {r['compile_s'] * 1e3:>12.1f} ms "
              f"{r['mask_us']:>8.1f} us "
              f"{r['mask_median_us']:>6.1f} us {r['mask_max_us']:>6.0f} us")
    if "llguidance" in results:
        ours = results["llguidance"]
        for name, r in results.items():
            if name != "llguidance":
                print(f"{name} / llguidance: setup {r['setup_s'] / ours['setup_s']:.2f}x, compile "
                      f"{r['compile_s'] / ours['compile_s']:.2f}x, mask {r['mask_us'] / ours['mask_us']:.2f}x")


if __name__ == "__main__":
    main()
