"""From engine outputs to OpenAI response bodies and server-sent event streams.

Streams read DELTA outputs: each carries only the text, tokens and log-probs that are new (the engine
already holds back text that a stop string may still cut), so sending a chunk costs what it holds.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator
from typing import Any

from pagedrl.engine.async_engine import RequestAborted, RequestGroup
from pagedrl.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    TopLogprob,
    UsageInfo,
    now_s,
)

MIN_LOGPROB = -9999.0  # as vLLM: -inf is not valid JSON
DONE = b"data: [DONE]\n\n"


def sse(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


def finite(x: float) -> float:
    return x if x >= MIN_LOGPROB else MIN_LOGPROB


def usage(outputs: list[RequestOutput]) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# ---------------------------------------------------------------------------- logprobs
class TokenText:
    """Names, bytes and text offsets of tokens in log-probs (OpenAI's convention: a token that is only
    part of a UTF-8 character is named `bytes:\\xNN...` and carries its own bytes)."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skipped = set(tokenizer.all_special_ids) if tokenizer is not None and skip_special_tokens else set()

    def name(self, token_id: int, lp: Logprob) -> str:
        if self.tokenizer is None:
            return lp.decoded_token or ""
        return self.tokenizer.token_name(token_id)

    def raw(self, token_id: int, lp: Logprob) -> bytes:
        if self.tokenizer is None:
            return (lp.decoded_token or "").encode()
        return self.tokenizer.token_bytes(token_id)

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


def chat_logprobs(c: CompletionOutput, start: int, stop: int, names: TokenText) -> ChatLogprobs:
    content = []
    for i in range(start, stop):
        entry = c.logprobs[i]
        token_id = c.token_ids[i]
        chosen = _top(token_id, entry[token_id], names)
        ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda x: x[1].rank)
        content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=[_top(t, lp, names) for t, lp in ranked]))
    return ChatLogprobs(content=content)


# ---------------------------------------------------------------------------- whole responses
def completion_response(request_id: str, model: str, outputs: list[RequestOutput],
                        params: SamplingParams, names: TokenText) -> CompletionResponse:
    choices = []
    for p, out in enumerate(outputs):
        for c in out.outputs:
            lp = None
            if params.logprobs is not None:
                lp = completion_logprobs(c, 0, len(c.token_ids), names, names.offsets(), len(c.text))
            choices.append(CompletionChoice(index=p * params.n + c.index, text=c.text, logprobs=lp,
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage(outputs))


def chat_response(request_id: str, model: str, output: RequestOutput, params: SamplingParams,
                  names: TokenText) -> ChatCompletionResponse:
    choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                          logprobs=chat_logprobs(c, 0, len(c.token_ids), names) if params.logprobs is not None
                          else None,
                          finish_reason=c.finish_reason, stop_reason=c.stop_reason)
               for c in output.outputs]
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage([output]))


# ---------------------------------------------------------------------------- streams
def stream_usage(group: RequestGroup) -> UsageInfo:
    prompt = sum(len(st.prompt_token_ids) for st in group.streams)
    completion = sum(st.num_generation_tokens for st in group.streams)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def has_news(c: CompletionOutput) -> bool:
    return bool(c.text or c.token_ids or c.finish_reason is not None)


def error_event(e: Exception) -> bytes:
    body = ErrorResponse(error=ErrorInfo(message=str(e), type="server_error", code="request_aborted"))
    return sse(body.model_dump_json())


async def completion_stream(group: RequestGroup, request_id: str, model: str, params: SamplingParams,
                            include_usage: bool, names: TokenText) -> AsyncIterator[bytes]:
    created = now_s()
    offsets: dict[tuple[int, int], TextOffsets] = {}
    usage_field = {"usage": None} if include_usage else {}
    try:
        async for updates in group:
            events = []
            for p, out in updates:
                for c in out.outputs:
                    if not has_news(c):
                        continue
                    lp = None
                    if params.logprobs is not None:
                        offs = offsets.setdefault((p, c.index), names.offsets())
                        lp = completion_logprobs(c, 0, len(c.token_ids), names, offs)
                    choice = CompletionChoice(index=p * params.n + c.index, text=c.text, logprobs=lp,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                    chunk = CompletionChunk(id=request_id, created=created, model=model, choices=[choice],
                                            **usage_field)
                    events.append(sse(chunk.model_dump_json()))
            if events:
                yield b"".join(events)
        if include_usage:
            chunk = CompletionChunk(id=request_id, created=created, model=model, choices=[],
                                    usage=stream_usage(group))
            yield sse(chunk.model_dump_json())
    except RequestAborted as e:
        yield error_event(e)
    finally:
        group.abort()
    yield DONE


async def chat_stream(group: RequestGroup, request_id: str, model: str, params: SamplingParams,
                      include_usage: bool, names: TokenText) -> AsyncIterator[bytes]:
    created = now_s()
    usage_field = {"usage": None} if include_usage else {}

    def chunk(choice: ChatStreamChoice) -> bytes:
        body = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice], **usage_field)
        return sse(body.model_dump_json(exclude_none=False))

    try:
        yield b"".join(chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
                       for i in range(params.n))
        async for updates in group:
            events = []
            for _, out in updates:
                for c in out.outputs:
                    if not has_news(c):
                        continue
                    lp = chat_logprobs(c, 0, len(c.token_ids), names) if params.logprobs is not None else None
                    events.append(chunk(ChatStreamChoice(index=c.index, delta=DeltaMessage(content=c.text),
                                                         logprobs=lp, finish_reason=c.finish_reason,
                                                         stop_reason=c.stop_reason)))
            if events:
                yield b"".join(events)
        if include_usage:
            body = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                       usage=stream_usage(group))
            yield sse(body.model_dump_json())
    except RequestAborted as e:
        yield error_event(e)
    finally:
        group.abort()
    yield DONE
