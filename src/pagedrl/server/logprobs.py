"""Log-probs in OpenAI's shapes: the legacy completions format (tokens, token_logprobs, top_logprobs,
text_offset) and the chat format (token, logprob, bytes, top_logprobs).

Tokens are named as OpenAI names them: a token that is only part of a UTF-8 character is
`bytes:\\xNN...` and carries its own bytes, so distinct tokens never share a name. Offsets index the
returned text. With `echo`, the prompt's tokens come first; the first has no log-prob (nothing
predicts it), as in OpenAI's and vLLM's answers.
"""

from __future__ import annotations

import codecs
from typing import Any

from pagedrl.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.server.response_bodies import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)

MIN_LOGPROB = -9999.0  # as vLLM: -inf is not valid JSON


def finite(x: float) -> float:
    return x if x >= MIN_LOGPROB else MIN_LOGPROB


class TokenText:
    """Names, bytes and text offsets of tokens in log-probs (OpenAI's convention: a token that is only
    part of a UTF-8 character is named `bytes:\\xNN...` and carries its own bytes).

    With `as_ids` (vLLM's `return_tokens_as_token_ids`, as its serving code writes `token_id:{id}` for
    both the chosen token and the alternatives), every name is `token_id:<id>`, so a client maps it back
    to the vocabulary without the tokenizer. Bytes stay the token's own and offsets still index the
    returned text (vLLM sums the names' lengths there instead)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.as_ids = as_ids
        self.skipped = set(tokenizer.all_special_ids) if tokenizer is not None and skip_special_tokens else set()

    def name(self, token_id: int, lp: Logprob) -> str:
        if self.as_ids:
            return f"token_id:{token_id}"
        if self.tokenizer is None:
            return lp.decoded_token or ""
        return self.tokenizer.token_name(token_id)

    def raw(self, token_id: int, lp: Logprob) -> bytes:
        if self.tokenizer is None:
            return (lp.decoded_token or "").encode()
        return self.tokenizer.token_bytes(token_id)

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def offsets(self) -> TextOffsets:
        return TextOffsets(self)


class TextOffsets:
    """Where each token's text starts in the returned text, in characters: the bytes of all earlier
    tokens are decoded incrementally, so a token inside a multi-byte character points at that character
    and special tokens the text leaves out add nothing."""

    def __init__(self, text: TokenText) -> None:
        self.text = text
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0

    def next(self, token_id: int, lp: Logprob) -> int:
        at = self.chars
        if token_id not in self.text.skipped:
            self.chars += len(self.decoder.decode(self.text.raw(token_id, lp)))
        return at


def completion_logprobs(c: CompletionOutput, start: int, stop: int, names: TokenText,
                        offsets: TextOffsets, text_len: int | None = None) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for i in range(start, stop):
        entry: dict[int, Logprob] = c.logprobs[i]
        token_id = c.token_ids[i]
        chosen = entry[token_id]
        out.tokens.append(names.name(token_id, chosen))
        out.token_logprobs.append(finite(chosen.logprob))
        out.top_logprobs.append({names.name(t, lp): finite(lp.logprob) for t, lp in entry.items()})
        at = offsets.next(token_id, chosen)
        out.text_offset.append(at if text_len is None else min(at, text_len))
    return out


def _top(token_id: int, lp: Logprob, names: TokenText) -> TopLogprob:
    return TopLogprob(token=names.name(token_id, lp), logprob=finite(lp.logprob), bytes=list(names.raw(token_id, lp)))


def chat_logprobs(c: CompletionOutput, start: int, stop: int, names: TokenText, top: int | None) -> ChatLogprobs:
    """OpenAI's chat log-probs: each token's own, and the `top` most likely tokens in rank order (the
    sampled one among them only where it ranks in the top); `top` None lists every token of the entry in
    its order (`logprob_token_ids`: the sampled token, then the ids as the request named them, as vLLM's)."""
    content = []
    for i in range(start, stop):
        entry = c.logprobs[i]
        token_id = c.token_ids[i]
        chosen = _top(token_id, entry[token_id], names)
        ranked = list(entry.items()) if top is None else \
            sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)[:top]
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[_top(t, lp, names) for t, lp in ranked]))
    return ChatLogprobs(content=content)


def listed_alternatives(params: SamplingParams) -> int | None:
    """How many of an entry's tokens a chat answer lists as `top_logprobs`: the `logprobs` most likely,
    or with `logprob_token_ids` all of them, the ids named and the sampled token (as vLLM's answer)."""
    return None if params.logprob_token_ids is not None else params.logprobs


def prompt_logprobs(out: RequestOutput, names: TokenText, offsets: TextOffsets) -> CompletionLogprobs:
    """The echoed prompt's tokens; the engine computed each one's log-prob from the positions before it."""
    lp = CompletionLogprobs()
    entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    for token_id, entry in zip(out.prompt_token_ids, entries, strict=True):
        chosen = entry.get(token_id) if entry else None
        placeholder = chosen or Logprob(0.0)
        lp.tokens.append(names.name(token_id, placeholder))
        lp.token_logprobs.append(None if chosen is None else finite(chosen.logprob))
        lp.top_logprobs.append(None if not entry else {names.name(t, v): finite(v.logprob) for t, v in entry.items()})
        lp.text_offset.append(offsets.next(token_id, placeholder))
    return lp


def extend(lp: CompletionLogprobs, more: CompletionLogprobs) -> CompletionLogprobs:
    lp.tokens.extend(more.tokens)
    lp.token_logprobs.extend(more.token_logprobs)
    lp.top_logprobs.extend(more.top_logprobs)
    lp.text_offset.extend(more.text_offset)
    return lp


def prompt_logprob_entries(out: RequestOutput) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` of a request: per prompt token, None for the first, then the token's
    entry and its alternatives' by token id."""
    if out.prompt_logprobs is None:
        return None
    return [None if e is None else {str(t): PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank,
                                                          decoded_token=lp.decoded_token) for t, lp in e.items()}
            for e in out.prompt_logprobs]
