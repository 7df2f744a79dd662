"""Sequences and requests: the state the scheduler moves forward one step at a time.

A request with `n` samples starts as one sequence; when its prompt has been computed the engine forks
it into `n` sequences that share the prompt's KV blocks (copy-on-write for a shared partial block).
Each sequence only tracks how many of its tokens have KV in the cache (`num_computed_tokens`): a step
catches that count up toward `num_tokens`, which is how prefill, chunked prefill, decode and recompute
after preemption are one mechanism.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedrl.engine.block_pool import BlockHash
from pagedrl.engine.grammar import TokenMatcher
from pagedrl.engine.lora_request import LoRARequest
from pagedrl.engine.outputs import Logprob
from pagedrl.engine.sampler import SamplingRow
from pagedrl.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Read for every sequence every step: a module constant costs a tenth of the enum class's lookup.
RUNNING, FINISHED = SequenceStatus.RUNNING, SequenceStatus.FINISHED
_seq_ids = itertools.count()


@dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n samples this is
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    arrival: float
    seq_id: int = field(default_factory=lambda: next(_seq_ids))
    token_ids: list[int] = field(init=False)  # prompt + output
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted (vLLM's)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Logprob contract: the processed log-prob of each sampled token (the distribution it was drawn
    # from) and its raw log-prob (plain log-softmax of the logits).
    processed_logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # sum of the reported log-probs (raw or processed), kept as they come
    # with params.logprobs set: each sampled token's entry (its alternatives, named), built once
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    text: str = ""
    detokenizer: Any = None
    num_preemptions: int = 0
    # With structured outputs: its place in the grammar (a grammar.TokenMatcher), advanced on every
    # appended token. Preemption keeps the tokens, so it keeps this too: recompute replays nothing.
    grammar: TokenMatcher | None = None
    first_token_time: float | None = None
    # Chain hashes of its full blocks, kept as it grows so that each block is hashed once (the KV
    # cache manager extends the list; it starts again after a weight update).
    block_hashes: list[BlockHash] = field(default_factory=list)
    # Running sequences this one becomes once admitted: a request's first sequence stands for all `n`
    # samples until it is forked, so admission counts sequences, not requests.
    seats: int = 1
    # What DELTA outputs have delivered: output tokens, characters of text, the finish.
    num_tokens_sent: int = 0
    num_chars_sent: int = 0
    finish_sent: bool = False
    # What the sampler needs about it, kept once it can no longer change (no penalties, grammar or
    # min_tokens ban in force): built once, not once per step (see LLMEngine.sampling_row).
    sampling_row: SamplingRow | None = None
    # The LoRA adapter it runs with (None: the base model); its forks run with it too.
    lora: LoRARequest | None = None
    # The request's own cache_salt (vLLM's), as `request_checks.salt_key` marks it; b"" for none.
    request_salt: bytes = b""
    # Why it ended with finish_reason "error" (its logits went NaN or infinite): carried to its output.
    error: str | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def cache_salt(self) -> bytes:
        """What its first block's prefix-cache hash is salted with: KV is only shared under the same
        adapter and the same request salt (vLLM's `cache_salt`, which a user sets so that others cannot
        tell from timings what their prompts were)."""
        return self.request_salt if self.lora is None else self.lora.cache_salt + self.request_salt

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is FINISHED

    @property
    def is_prefill_done(self) -> bool:
        """True once this sequence has KV for all its prompt tokens at least once."""
        return self.num_output_tokens > 0 or self.num_computed_tokens >= self.num_prompt_tokens

    def append(self, token: int, processed: float, raw: float, entry: dict[int, Logprob] | None = None) -> None:
        self.token_ids.append(token)
        self.processed_logprobs.append(processed)
        self.raw_logprobs.append(raw)
        # the sampled tokens' log-probs summed in the distribution they are reported in (vLLM's)
        self.cumulative_logprob += processed if self.params.logprobs_mode == "processed_logprobs" else raw
        if entry is not None:
            self.logprobs.append(entry)


@dataclass(eq=False)
class Request:
    """One call's worth of sequences: the first is forked into `params.n` once its prompt is in."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False
    prompt_logprobs_sent: bool = False  # a DELTA request sends them once

    @property
    def is_finished(self) -> bool:
        for seq in self.seqs:  # (read for every request every step: no generator, no property calls)
            if seq.status is not FINISHED:
                return False
        return True


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """Prompt log-probs are computed on the first pass over the prompt only (not after preemption), and
    that pass computes every prompt position: a prefix-cache hit would skip the rows they come from."""
    return seq.params.prompt_logprobs is not None and seq.num_output_tokens == 0 and seq.index == 0
