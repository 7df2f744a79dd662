"""`use_beam_search: true` on /v1/completions and /v1/chat/completions, as vLLM's server answers it
(`serving_engine.py`'s `beam_search`, the requests' `to_beam_search_params`): `n` is the beam width,
`length_penalty` the final ranking's exponent, `temperature` (1 unless given, or the model's default)
and `ignore_eos`, `include_stop_str_in_output` and `max_tokens` as for sampling; the answer's choices are
the n best beams, best first (`engine/beam_search.py`). A stream carries each choice whole in one chunk,
as vLLM's does, since no beam is known to be kept until the search ends.

The fields that would change the candidates or the answer's shape and that beam search does not apply
are refused by name instead, when the request sets them to anything but a value that asks for nothing
(its default, or an empty list or map, `top_p` 1, `response_format` text, `tool_choice` "none"):
sampling's truncation and seed, stop strings and ids, penalties, token choices, structured outputs,
tools, log-probs and echo (vLLM ignores them). `allowed_token_ids` is applied, as vLLM's beam search
applies it: each beam's candidates are the allowed tokens, every one of a list of at most 128 ranked by its
log-prob (`logprob_token_ids`), a longer list's among the 2 * n most likely.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pagedrl.engine.beam_search import (
    BeamSearchInstance,
    BeamSearchParams,
    advance_all,
    check_logprobs_limit,
    live_beams,
    step_params,
)
from pagedrl.engine.outputs import RequestOutput
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.server.errors import bad_request
from pagedrl.server.protocol import SamplingRequest

# Fields beam search does not apply, each with the values besides its default that ask for nothing.
REFUSED: dict[str, tuple[Any, ...]] = {
    "top_p": (1.0,), "top_k": (0, -1), "min_p": (0.0,), "seed": (-1,), "stop": ([],), "stop_token_ids": ([],),
    "presence_penalty": (0.0,), "frequency_penalty": (0.0,), "repetition_penalty": (1.0,), "min_tokens": (),
    "logit_bias": ({},), "bad_words": ([],), "logprob_token_ids": ([],), "response_format": (),
    "structured_outputs": (), "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
    "prompt_logprobs": (), "logprobs": (), "top_logprobs": (), "echo": (), "tools": ([],), "tool_choice": ("none",)}
_FIELD = re.compile(r"^BeamSearchParams\.(\w+)")

StepRunner = Callable[[list[Any]], Awaitable[list[RequestOutput]]]


def beam_search_params(req: SamplingRequest, params: SamplingParams, max_model_len: int,
                       max_logprobs: int) -> BeamSearchParams:
    """The request's BeamSearchParams, from its fields and the SamplingParams already checked (max_tokens,
    the temperature with the model's default); a field beam search does not apply is a 400 naming it."""
    check_fields(req)
    try:
        beam = BeamSearchParams(beam_width=req.n, max_tokens=params.max_tokens or max_model_len,
                                ignore_eos=req.ignore_eos, temperature=params.temperature,
                                length_penalty=req.length_penalty,
                                include_stop_str_in_output=req.include_stop_str_in_output,
                                allowed_token_ids=req.allowed_token_ids)
        check_logprobs_limit(beam, max_logprobs)
    except ValueError as e:
        match = _FIELD.match(str(e))
        field = match.group(1) if match else None
        raise bad_request(str(e), param="n" if field == "beam_width" else field) from None
    return beam


def check_fields(req: SamplingRequest) -> None:
    """A 400 naming the first field the request set that beam search would not apply. A value that asks
    for nothing passes: `logprobs: 0` asks for the sampled token's log-prob, `logit_bias: {}` for nothing."""
    fields = type(req).model_fields
    for name, idle in REFUSED.items():
        if name not in fields or name not in req.model_fields_set:
            continue
        value = getattr(req, name)
        if name == "response_format" and value is not None:
            idle = (value,) if value.type == "text" else ()  # the plain text every answer is
        if _same(value, fields[name].default) or any(_same(value, v) for v in idle):
            continue
        raise bad_request(f"{name} is not supported with use_beam_search", param=name)


def _same(value: Any, idle: Any) -> bool:
    """Equal and of one type: `0 == False` in Python, yet `logprobs: 0` asks for something."""
    return type(value) is type(idle) and value == idle


async def run_beam_search(prompts: list[Any], beam: BeamSearchParams, run_step: StepRunner, eos_token_ids: list[int],
                          max_model_len: int, request_id: str, tokenizer: Any) -> list[RequestOutput]:
    """One answer per prompt. `run_step(prompts)` runs one engine request per prompt (text or ids) with
    `step_params(beam)` and returns their final outputs; the first step runs on the prompts as sent,
    whose outputs tell their token ids."""
    outputs = await run_step(prompts)
    instances = [BeamSearchInstance(out.prompt_token_ids, beam, eos_token_ids,
                                    max_steps=max_model_len - len(out.prompt_token_ids)) for out in outputs]
    advance_all(instances, outputs)
    while beams := live_beams(instances):
        advance_all(instances, await run_step([b.tokens for b in beams]))
    return [inst.request_output(f"{request_id}-{i}", prompt if isinstance(prompt, str) else None, tokenizer)
            for i, (inst, prompt) in enumerate(zip(instances, prompts, strict=True))]


def answer_params(beam: BeamSearchParams) -> SamplingParams:
    """What the response builders read of a beam search: n choices a prompt, no log-probs."""
    return step_params(beam).clone(n=beam.beam_width, logprobs=None, max_tokens=beam.max_tokens, detokenize=True)


@dataclass
class _Done:
    prompt_token_ids: list[int]
    num_generation_tokens: int
    last: RequestOutput


class FinishedGroup:
    """Finished outputs in the shape the stream builders iterate (a `RequestGroup`'s): one update
    carrying every choice whole."""

    def __init__(self, outputs: list[RequestOutput], params: SamplingParams) -> None:
        self.outputs, self.params = outputs, params
        self.streams = [_Done(out.prompt_token_ids, sum(len(c.token_ids) for c in out.outputs), out) for out in outputs]

    async def _updates(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        yield list(enumerate(self.outputs))

    def __aiter__(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        return self._updates()

    async def final_outputs(self) -> list[RequestOutput]:
        return self.outputs

    def abort(self) -> None:
        """Nothing runs any more."""
