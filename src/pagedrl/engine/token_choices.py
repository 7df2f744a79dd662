"""A request's own say over which tokens it draws: `logit_bias`, `allowed_token_ids` and `bad_words`
(vLLM's `SamplingParams` fields, which OpenAI-style clients send).

vLLM's order, kept here: the allowed set, then the bans (bad words, `min_tokens`), then the bias, then
the penalties, then the structured-output mask, temperature and truncation. A ban is -inf and a bias
is finite (at most 100 either way), so the bias may be added before the bans without changing a
single value: the sampler adds bias and allowed set first (`choose_tokens`), then penalises, then bans.

A bad word of one token is banned at every step; a longer one bans its last token only where the
output so far ends with the word's other tokens. Each word is tokenized as it would start a text and,
where that gives a different first token in as many tokens, after a space (the word in mid-text).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from pagedrl.engine.sampling_params import SamplingParams

NEG_INF = float("-inf")


def bad_words_token_ids(words: Sequence[str], tokenizer: Any) -> list[list[int]]:
    """The token sequences of `bad_words` (vLLM's `update_from_tokenizer`): each word as it would
    open a text, and after a space where that tokenizes into a new first token of the same length."""
    if tokenizer is None:
        raise ValueError("bad_words needs the model's tokenizer; pass allowed_token_ids or logit_bias instead")
    sequences: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        sequences.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def bad_words_banned(sequences: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> list[int]:
    """The last tokens of the bad words whose other tokens end `output_token_ids` (only the output
    counts, as in vLLM: a word begun in the prompt is not continued from it)."""
    banned: list[int] = []
    for seq in sequences:
        head = len(seq) - 1
        if head <= len(output_token_ids) and (
                head == 0 or list(output_token_ids[-head:]) == list(seq[:head])) and seq[-1] not in banned:
            banned.append(seq[-1])
    return banned


class TokenChoices:
    """An engine's side of the token choices: requests checked against its vocabulary, and the bad
    words' token ids, tokenized once per list of words."""

    def __init__(self, vocab_size: int, tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = list(eos_token_ids)
        self._bad_words: dict[tuple[str, ...], list[list[int]]] = {}

    def check(self, params: SamplingParams) -> None:
        """ValueError naming the field when a request's token choices fall outside the vocabulary, or
        its allowed set leaves nothing to draw while `min_tokens` bans the stop tokens. Changes nothing
        the engine steps with, so it is safe off the engine thread."""
        for name, ids in (("logit_bias", list(params.logit_bias or ())),
                          ("allowed_token_ids", params.allowed_token_ids or []),
                          ("logprob_token_ids", params.logprob_token_ids or [])):
            outside = sorted(i for i in ids if i >= self.vocab_size)
            if outside:
                raise ValueError(f"{name} names token ids outside the vocabulary [0, {self.vocab_size}): "
                                 f"{outside[:8]}")
        for seq in bad_words_token_ids(params.bad_words or (), self.tokenizer) if params.bad_words else ():
            if any(t >= self.vocab_size for t in seq):
                raise ValueError(f"bad_words tokenize to ids outside the vocabulary [0, {self.vocab_size}): {seq}")
        if params.allowed_token_ids is not None and params.min_tokens > 0:
            stops = set(params.min_tokens_banned_ids(0, self.eos_token_ids, self.vocab_size))
            if stops.issuperset(params.allowed_token_ids):
                raise ValueError(f"allowed_token_ids {params.allowed_token_ids} are all stop tokens, which "
                                 f"min_tokens={params.min_tokens} bans: nothing is left to draw")

    def banned(self, params: SamplingParams, num_output_tokens: int, output_token_ids: Sequence[int]) -> list[int]:
        """What the sampler must not draw next: the stop tokens while `min_tokens` holds, and the last
        tokens of the bad words the output has begun."""
        banned = params.min_tokens_banned_ids(num_output_tokens, self.eos_token_ids, self.vocab_size)
        if params.bad_words:
            key = tuple(params.bad_words)
            if key not in self._bad_words:
                self._bad_words[key] = bad_words_token_ids(key, self.tokenizer)
            banned += [t for t in bad_words_banned(self._bad_words[key], output_token_ids) if t not in banned]
        return banned


def choose_tokens(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """`logits` [S, V] with each row's allowed set kept (the rest -inf) and its logit bias added;
    the very tensor when no row asks for either."""
    picked = [i for i, p in enumerate(params) if p.chooses_tokens]
    if not picked:
        return logits
    out = logits.clone()
    device = logits.device
    for i in picked:
        p = params[i]
        if p.allowed_token_ids is not None:
            keep = torch.tensor(p.allowed_token_ids, device=device)
            row = torch.full_like(out[i], NEG_INF)
            row[keep] = out[i, keep]
            out[i] = row
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=device)
            out[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=out.dtype, device=device)
    return out
