"""Beam search above the engine, as vLLM (V1) builds it: `vllm/beam_search.py` (BeamSearchSequence,
BeamSearchOutput, BeamSearchInstance, get_beam_search_score), `vllm/sampling_params.py` (BeamSearchParams),
`LLM.beam_search` and the OpenAI server's `beam_search` (`serving_engine.py`).

Each step asks the engine for one token of every live beam, with `logprobs=2 * beam_width` (transformers'
choice: enough candidates that `beam_width` survive even where some end at EOS). A candidate that is EOS
(unless `ignore_eos`) completes its beam; the others compete, and the `beam_width` best by cumulative
log-prob live on. In the end the completed and the live beams are ranked by `get_beam_search_score`: the
cumulative log-prob over the length (the prompt's tokens counted, the final EOS not, as vLLM counts) to the
power `length_penalty`.

Every beam is its own engine request whose prompt is the beam's tokens so far. Prefix caching shares the
KV of their common prefix: the prompt's full blocks and every full block the beams generated alike map to
the same physical blocks, so a step computes only each beam's last, partial block. This is vLLM's way,
and the simplest correct one here: forking block tables with copy-on-write would keep a beam's partial
block too, but needs the scheduler to fork, prune and reorder running sequences, and the engine's samples
(`n`) are independent once forked. The log-probs are the raw ones (the model's log-softmax, before
temperature), as vLLM's engine returns by default; `temperature` only changes the token each request
samples, which joins the candidates.

A beam's request that the engine fails (finish_reason "error": its logits went NaN or infinite) stops
the whole search with `RequestFailed`, as vLLM's server stops it with its error: no answer is ranked
from beams some of which were silently dropped.

Where vLLM's offline and server paths differ, each is kept: `LLM.beam_search`'s sequences hold the prompt's
tokens, an ending EOS, and the text of all of them; the server's choices hold the completion's tokens (EOS
only with `include_stop_str_in_output`) and its text without EOS, with finish_reason "stop" or "length".
EOS is any of the engine's end-of-sequence ids (vLLM takes the tokenizer's one), so a chat model's
end-of-turn token ends a beam as it ends `generate`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from pagedrl.engine.lora_request import LoRARequest
from pagedrl.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedrl.engine.request_stream import RequestFailed
from pagedrl.engine.sampling_params import MAX_LOGPROB_TOKEN_IDS, SamplingParams


def _bad(name: str, value: Any, requirement: str) -> ValueError:
    return ValueError(f"BeamSearchParams.{name} {requirement}, got {value!r}")


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's BeamSearchParams: `beam_width` beams kept, at most `max_tokens` new tokens each,
    `length_penalty` the exponent of the length the final ranking divides by (1.0: the mean log-prob per
    token; 0.0: the plain sum, which favours short beams)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _bad(name, value, "must be an int of at least 1")
        for name in ("temperature", "length_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise _bad(name, value, "must be a finite number")
        if self.temperature < 0:
            raise _bad("temperature", self.temperature, "must be at least 0")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "must be a bool")
        if self.allowed_token_ids is not None:
            try:  # SamplingParams' own rules for the list, named as this class's field
                ids = SamplingParams(allowed_token_ids=self.allowed_token_ids).allowed_token_ids
            except ValueError as e:
                raise ValueError(str(e).replace("SamplingParams.", "BeamSearchParams.", 1)) from None
            object.__setattr__(self, "allowed_token_ids", ids)


@dataclass
class BeamSearchSequence:
    """One beam: its tokens (the prompt's first), the log-prob entries of each step (the candidates the
    engine returned), and their cumulative log-prob. `text` is filled when the beam is returned."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: LoRARequest | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    cache_salt: str | None = None  # the prompt's (vLLM's), for every request of the beam

    def prompt(self) -> list[int] | dict[str, Any]:
        """The beam's next engine request: its tokens, with the prompt's cache_salt if it has one."""
        return self.tokens if self.cache_salt is None else {"prompt_token_ids": self.tokens,
                                                            "cache_salt": self.cache_salt}


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | Collection[int],
                          length_penalty: float = 1.0) -> float:
    """vLLM's (after transformers'): the cumulative log-prob over the length to the power
    `length_penalty`, the length all the tokens (the prompt's too) less a final EOS."""
    eos = {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    return cumulative_logprob / (seq_len**length_penalty)


def step_params(params: BeamSearchParams) -> SamplingParams:
    """What each step asks of every beam: one token and its 2 * beam_width most likely alternatives; with
    `allowed_token_ids`, the token drawn among them and (a list of at most MAX_LOGPROB_TOKEN_IDS, as
    vLLM's) the log-prob of every allowed id, so that each is a candidate however unlikely; a longer list
    gets the 2 * beam_width most likely alternatives, the allowed ones among them the candidates."""
    allowed = params.allowed_token_ids
    if allowed is not None and len(allowed) <= MAX_LOGPROB_TOKEN_IDS:
        return SamplingParams(max_tokens=1, temperature=params.temperature, detokenize=False,
                              allowed_token_ids=allowed, logprob_token_ids=allowed)
    return SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature,
                          detokenize=False, allowed_token_ids=allowed)


class BeamSearchInstance:
    """The beams of one prompt: `beams` still growing, `completed` ended at EOS."""

    def __init__(self, prompt_tokens: list[int], params: BeamSearchParams, eos_token_ids: Collection[int],
                 lora_request: LoRARequest | None = None, max_steps: int | None = None,
                 cache_salt: str | None = None) -> None:
        self.prompt_tokens = list(prompt_tokens)
        self.prompt_len = len(prompt_tokens)
        self.params = params
        self.eos = set(eos_token_ids)
        self.allowed = None if params.allowed_token_ids is None else set(params.allowed_token_ids)
        self.beams = [BeamSearchSequence(list(prompt_tokens), lora_request=lora_request, cache_salt=cache_salt)]
        self.completed: list[BeamSearchSequence] = []
        # A beam can grow only while it fits the context: at least one step, so that a prompt too long
        # for the context is refused by the engine, naming it.
        self.steps_left = max(1, params.max_tokens if max_steps is None else min(params.max_tokens, max_steps))

    def score(self, beam: BeamSearchSequence) -> float:
        return get_beam_search_score(beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty)

    def live(self) -> list[BeamSearchSequence]:
        """The beams the next step extends (none once the instance is done)."""
        return self.beams if self.steps_left > 0 else []

    def advance(self, results: list[CompletionOutput]) -> None:
        """One step: `results[i]` is the engine's one-token output for `live()[i]`."""
        candidates = []
        for beam, result in zip(self.beams, results, strict=True):
            if result.finish_reason == "error":  # as vLLM's server: the search stops with the error
                raise RequestFailed(f"beam search: the engine failed a beam's request: {result.error}")
            if not result.logprobs:
                continue  # the engine gave it no token (aborted): the beam ends here
            entries = result.logprobs[0]
            for token_id, lp in entries.items():
                if self.allowed is not None and token_id not in self.allowed:
                    continue  # an alternative the request does not allow (vLLM's rule)
                new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [entries], beam.lora_request,
                                         beam.cum_logprob + lp.logprob, cache_salt=beam.cache_salt)
                if token_id in self.eos and not self.params.ignore_eos:
                    new.finish_reason, new.stop_reason = "stop", token_id
                    self.completed.append(new)
                else:
                    candidates.append(new)
        # all candidates have the same length, so the score orders them as their cumulative log-probs
        self.beams = sorted(candidates, key=self.score, reverse=True)[: self.params.beam_width]
        self.steps_left = self.steps_left - 1 if self.beams else 0

    def best(self, decode: Callable[..., str] | None = None) -> list[BeamSearchSequence]:
        """The `beam_width` best of the completed and the live beams, best first; with `decode` (a
        tokenizer's), each with the text of all its tokens, special ones kept (`LLM.beam_search`'s, as vLLM's)."""
        best = sorted(self.completed + self.beams, key=self.score, reverse=True)[: self.params.beam_width]
        if decode is not None:
            for beam in best:
                beam.text = decode(beam.tokens, skip_special_tokens=False)
        return best

    def request_output(self, request_id: str, prompt: str | None, tokenizer: Any) -> RequestOutput:
        """The server's answer (vLLM's serving `beam_search`): a choice per best beam, its completion's
        tokens (EOS only with include_stop_str_in_output) and text (without EOS)."""
        outputs = []
        for i, beam in enumerate(self.best()):
            tokens = beam.tokens[self.prompt_len:]
            ended = beam.finish_reason == "stop"
            text_tokens = tokens[:-1] if ended else tokens
            if ended and not self.params.include_stop_str_in_output:
                tokens = text_tokens
            text = tokenizer.decode(text_tokens, skip_special_tokens=False) if tokenizer is not None else ""
            outputs.append(CompletionOutput(index=i, text=text, token_ids=tokens, cumulative_logprob=beam.cum_logprob,
                                            logprobs=beam.logprobs, finish_reason=beam.finish_reason or "length",
                                            stop_reason=beam.stop_reason))
        return RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(self.prompt_tokens),
                             outputs=outputs, finished=True)



def live_beams(instances: list[BeamSearchInstance]) -> list[BeamSearchSequence]:
    """Every beam the next step extends, instance after instance: one engine request each."""
    return [beam for inst in instances for beam in inst.live()]


def advance_all(instances: list[BeamSearchInstance], outputs: list[RequestOutput]) -> None:
    """One step of every instance, from the engine's outputs for `live_beams(instances)`, in that order."""
    at = 0
    for inst in instances:
        n = len(inst.live())
        if n:
            inst.advance([out.outputs[0] for out in outputs[at:at + n]])
            at += n


def check_logprobs_limit(params: BeamSearchParams, max_logprobs: int) -> None:
    """A step asks for 2 * beam_width log-probs, which the engine's max_logprobs (-1: none) bounds (unless
    it asks for a short allowed list's own, which MAX_LOGPROB_TOKEN_IDS bounds)."""
    if step_params(params).logprobs is None:
        return
    if max_logprobs != -1 and 2 * params.beam_width > max_logprobs:
        raise ValueError(f"BeamSearchParams.beam_width {params.beam_width} asks the engine for 2 * beam_width = "
                         f"{2 * params.beam_width} log-probs a step, over max_logprobs ({max_logprobs})")
