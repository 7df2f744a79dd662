"""Perplexity of a model on a text, through the paged engine: how much a precision or a quantization
costs a model, in the one number language-model evaluations report for it.

The text is tokenized once as the tokenizer encodes a text (with its BOS where it adds one; no chat
template: the model scores the text as it lies) and cut
into windows as transformers' perplexity guide and lm-eval's rolling log-likelihood do: each window
holds up to `window` tokens, scores only the tokens no earlier window scored, and gives them the
`window - stride` tokens before them as context. Every window goes to the engine as one prompt with
`prompt_logprobs=0`, which returns the log-probability of each prompt token after the first under
the model's raw distribution (`engine/output_processor.record_prompt_logprob`): the numbers come from
the engine's own steps, whatever path serves the model (float, bf16, GGUF blocks, int8/int4).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Perplexity:
    nll: float  # summed negative log-likelihood of the scored tokens, in nats
    tokens: int  # tokens scored (every token of the encoded text but the first)
    words: int  # whitespace-separated words of the text
    windows: int

    @property
    def token_perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def word_perplexity(self) -> float:
        """Per word, as lm-eval's wikitext reports it: comparable across tokenizers."""
        return math.exp(self.nll / self.words)

    def describe(self) -> str:
        return (f"perplexity {self.token_perplexity:.4f} per token, {self.word_perplexity:.4f} per word "
                f"({self.tokens} tokens, {self.words} words, {self.windows} windows, {self.nll:.3f} nats)")


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) per window over tokens [0, num_tokens): windows end `stride` apart,
    each scores [first scored, end) after at least one token of context (the first window scores from
    token 1: token 0 has none)."""
    if window < 2 or not 0 < stride < window:
        raise ValueError(f"window must be >= 2 and stride in 1..window-1 (a window's first token is context "
                         f"only), got window={window}, stride={stride}")
    out, scored_to = [], 1
    while scored_to < num_tokens:
        end = min(num_tokens, scored_to + stride if out else window)
        out.append((max(0, end - window), end, scored_to))
        scored_to = end
    return out


def perplexity(llm: LLM, text: str, window: int = 1024, stride: int = 512) -> Perplexity:
    """The perplexity of `llm`'s model on `text` (see the module's docstring for the windows)."""
    if llm.tokenizer is None:
        raise ValueError("perplexity needs the model's tokenizer; this model was loaded without one")
    ids = llm.tokenizer.encode(text)
    if len(ids) < 2:
        raise ValueError(f"perplexity needs a text of at least 2 tokens, got {len(ids)}")
    window = min(window, llm.max_model_len)
    spans = windows(len(ids), window, min(stride, window - 1))
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate([ids[b:e] for b, e, _ in spans], params, use_tqdm=False)
    nll, tokens = 0.0, 0
    for (begin, end, first), out in zip(spans, outs, strict=True):
        entries = out.prompt_logprobs or []
        for pos in range(first, end):
            entry = entries[pos - begin]
            if entry is None:
                raise RuntimeError(f"the engine returned no log-prob for prompt token {pos - begin} of a window")
            nll -= entry[ids[pos]].logprob
            tokens += 1
    return Perplexity(nll, tokens, len(text.split()), len(spans))


def perplexity_of_file(llm: LLM, path: str | Path, window: int = 1024, stride: int = 512) -> Perplexity:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"--perplexity: {path}: file not found")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise ValueError(f"--perplexity: {path}: the file holds no text")
    return perplexity(llm, text, window, stride)
