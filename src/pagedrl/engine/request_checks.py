"""What a request must satisfy before it is queued: its prompt in the vocabulary, its samples within
one step, prompt plus completion within the context and the KV cache. Each failure is a ValueError
naming the setting to change (HTTP 400 on the server). Nothing here changes engine state, so the
server runs these checks on its event loop or a worker thread while the engine thread steps."""

from __future__ import annotations

from typing import Any

from pagedrl.engine.kv_cache_manager import KVCacheManager
from pagedrl.engine.sampling_params import SamplingParams


def encode_prompt(prompt: str | list[int], tokenizer: Any, vocab_size: int, keep: int | None = None) -> list[int]:
    """A text prompt's token ids (through `tokenizer`), or a list of ids checked against the vocabulary;
    with `keep`, only the last `keep` of them (vLLM's `truncate_prompt_tokens`: a long prompt's start goes)."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty")
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids instead")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
    else:
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt token {i} is {t!r}, outside the vocabulary [0, {vocab_size})")
    return ids if keep is None else ids[-keep:]


def salt_key(cache_salt: str | None) -> bytes:
    """A request's `cache_salt` (vLLM's) as its prefix-cache hashes mix it in: b"" for none. Marked so that
    it never equals an adapter's salt (`LoRARequest.cache_salt`, which it follows when both are set). An
    empty salt is refused, as vLLM refuses it: it would salt nothing while seeming to."""
    if cache_salt is None:
        return b""
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
    return b"\x00salt:" + cache_salt.encode("utf-8", "surrogatepass")


def check_logprobs(params: SamplingParams, max_logprobs: int) -> None:
    """Alternatives are gathered from the whole vocabulary's distribution: bounded per request (vLLM's
    `max_logprobs`), so that one request cannot ask for a vocabulary-sized answer at every token."""
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and max_logprobs != -1 and value > max_logprobs:
            raise ValueError(f"{name} ({value}) exceeds max_logprobs ({max_logprobs}), the most alternatives an "
                             "engine returns; ask for fewer or raise max_logprobs")


def check_num_seqs(params: SamplingParams, max_num_seqs: int) -> None:
    """The n samples of a request run side by side, forked from one prompt, so n is bounded by the
    sequences one step runs (and forking never loops over more)."""
    if params.n > max_num_seqs:
        raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({max_num_seqs}), the sequences "
                         "one engine step runs; ask for fewer samples or raise max_num_seqs")


def check_fits(num_prompt_tokens: int, params: SamplingParams, max_model_len: int, kv_manager: KVCacheManager,
               block_size: int, step_tokens: int | None = None) -> None:
    """Room for the prompt and at least one token in the context (`max_model_len`), and for the prompt and
    its completion in the whole KV cache (a sequence that can never fit would wait for ever; under a
    sliding window, what it holds at once: the window and one step's `step_tokens`). As in vLLM, a
    `max_tokens` past the context is not an error: the completion ends there, finish_reason "length"."""
    limit = max_model_len
    if num_prompt_tokens >= limit:
        raise ValueError(f"prompt is {num_prompt_tokens} tokens, but the model's context "
                         f"(max_model_len) is {limit} tokens: no room for a completion token")
    room = limit - num_prompt_tokens
    total = num_prompt_tokens + min(params.max_tokens or room, room)
    if not kv_manager.can_ever_fit(total, step_tokens):
        raise ValueError(f"prompt + max_tokens = {total} tokens can never fit in the KV cache: they hold "
                         f"{kv_manager.most_blocks(total, step_tokens)} blocks of {block_size} tokens at once, "
                         f"the cache has {kv_manager.num_blocks_total}; raise kv_cache_tokens")
