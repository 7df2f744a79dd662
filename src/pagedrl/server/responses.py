"""From engine outputs to OpenAI response bodies and server-sent event streams.

Streams read DELTA outputs: each carries only the text, tokens and log-probs that are new (the engine
already holds back text that a stop string may still cut), so sending a chunk costs what it holds.

vLLM's `return_token_ids` adds the token ids to the answer where vLLM's serving code puts them
(`OpenAIServingCompletion` and `OpenAIServingChat`, `entrypoints/openai/serving_completion.py` and
`serving_chat.py` in vLLM 0.11, `completion/serving.py` and `chat_completion/serving.py` since): on a
completion choice its prompt's (`prompt_token_ids`) and its own (`token_ids`, never the echoed prompt);
on a chat answer the prompt's at the top and each choice's own. In a stream the prompt's come once (a
completion choice's first chunk; the chat stream's first chunks, which give the role) and `token_ids`
are each chunk's new ones, so a chunk whose text is held back still brings its ids. vLLM drops an echoed
prompt's text when token ids are asked for; here echo keeps it. With `include_usage`, vLLM's
`continuous_usage_stats` puts on every chunk the usage of its choice so far: its prompt's tokens and the
completion tokens made up to it (the last chunk still totals them all); without include_usage it adds
nothing, as vLLM's `should_include_usage` decides.

`echo` on /v1/completions puts the prompt (and with `logprobs`, its tokens' log-probs) before each
choice's text; with `max_tokens: 0` the choice is the prompt alone (the engine still makes one token,
which is left out, as vLLM does). This is how log-likelihood evaluations (lm-evaluation-harness)
score continuations.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from pagedrl.engine.outputs import CompletionOutput, RequestOutput
from pagedrl.engine.request_stream import RequestAborted, RequestFailed, RequestGroup
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.server.harmony import HarmonyAnswer
from pagedrl.server.logprobs import (
    TextOffsets,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    extend,
    listed_alternatives,
    prompt_logprob_entries,
    prompt_logprobs,
)
from pagedrl.server.protocol import FunctionCall, ToolCall
from pagedrl.server.reasoning_parsers import ReasoningPlan, ThinkingReader
from pagedrl.server.request_log import RequestLog, delta_text
from pagedrl.server.response_bodies import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    PromptTokensDetails,
    UsageInfo,
    now_s,
)
from pagedrl.server.tool_parsers import ChoiceToolReader
from pagedrl.server.tools import ToolPlan

DONE = b"data: [DONE]\n\n"


def sse(payload: str) -> bytes:
    return b"data: " + payload.encode() + b"\n\n"


def counted(prompt: int, completion: int, cached: int | None = None) -> UsageInfo:
    """A usage; with `cached` (the server's --enable-prompt-tokens-details), its prompt_tokens_details."""
    details = None if cached is None else PromptTokensDetails(cached_tokens=cached)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=details)


def usage(outputs: list[RequestOutput], prompt_only: bool = False, details: bool = False) -> UsageInfo:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    cached = sum(o.num_cached_tokens for o in outputs) if details else None
    return counted(prompt, 0 if prompt_only else sum(len(c.token_ids) for o in outputs for c in o.outputs), cached)


def include_usage(stream_options: Any, force: bool) -> bool:
    """Whether a stream ends with a usage chunk: as vLLM's `should_include_usage`, when the request's
    stream_options ask or the server's --enable-force-include-usage does."""
    return force or bool(stream_options and stream_options.include_usage)


@dataclass
class Extras:
    """What a request asked for beyond OpenAI's answer: vLLM's `return_token_ids`, and in a stream with
    include_usage its `continuous_usage_stats`."""

    token_ids: bool = False
    continuous_usage: bool = False
    prompt_tokens_details: bool = False  # the server's --enable-prompt-tokens-details


@dataclass
class Echo:
    """What a completion choice repeats of its prompt."""

    echo: bool = False
    prompt_only: bool = False  # echo with max_tokens 0: the generated token is left out


def choice_content(out: RequestOutput, c: CompletionOutput, first: bool, echo: Echo, params: SamplingParams,
                   names: TokenText, offsets: TextOffsets) -> tuple[str, CompletionLogprobs | None]:
    """A choice's text and log-probs (for a stream: of this delta; `first` puts the echoed prompt in)."""
    text = ""
    lp = CompletionLogprobs() if params.num_logprobs is not None else None
    if echo.echo and first:
        text = out.prompt if out.prompt is not None else names.decode(out.prompt_token_ids)
        if lp is not None:
            extend(lp, prompt_logprobs(out, names, offsets))
    if not echo.prompt_only:
        text += c.text
        if lp is not None:
            extend(lp, completion_logprobs(c, 0, len(c.token_ids), names, offsets))
    return text, lp


# ---------------------------------------------------------------------------- whole responses
def completion_response(request_id: str, model: str, outputs: list[RequestOutput], params: SamplingParams,
                        names: TokenText, echo: Echo | None = None, with_prompt_logprobs: bool = False,
                        extras: Extras | None = None) -> CompletionResponse:
    """The whole answer: a choice per prompt and sample, each with its prompt's `prompt_logprobs` when
    the request asked for them (vLLM's field, apart from `echo`'s)."""
    echo, extras = echo or Echo(), extras or Extras()
    choices = []
    for p, out in enumerate(outputs):
        prompt_lp = prompt_logprob_entries(out) if with_prompt_logprobs else None
        for c in out.outputs:
            text, lp = choice_content(out, c, True, echo, params, names, names.offsets())
            if lp is not None:
                lp.text_offset = [min(at, len(text)) for at in lp.text_offset]
            ids = dict(prompt_token_ids=list(out.prompt_token_ids), token_ids=[] if echo.prompt_only
                       else list(c.token_ids)) if extras.token_ids else {}
            choices.append(CompletionChoice(index=p * params.n + c.index, text=text, logprobs=lp,
                                            finish_reason=c.finish_reason,
                                            stop_reason=None if echo.prompt_only else c.stop_reason,
                                            prompt_logprobs=prompt_lp, **ids))
    return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage(outputs, echo.prompt_only,
                                                                                      extras.prompt_tokens_details))


def tool_reader(plan: ToolPlan | None, harmony: HarmonyAnswer | None = None) -> ChoiceToolReader | None:
    if plan is None or plan.mode == "none":
        return None
    return ChoiceToolReader(plan.mode, plan.parser, plan.name, harmony)


def answer_readers(plan: ToolPlan | None, thinking: ReasoningPlan | None
                   ) -> tuple[ThinkingReader | None, ChoiceToolReader | None]:
    """One choice's reasoning reader and tool reader. gpt-oss's (`openai_gptoss`, `openai`) read the
    answer once: the reasoning reader sorts its harmony messages and finds the calls the tool reader
    gives out."""
    thinker = thinking.reader() if thinking is not None else None
    if isinstance(thinker, HarmonyAnswer) and plan is not None and plan.mode == "auto" and plan.parser == "openai":
        thinker.calls = True
        return thinker, tool_reader(plan, thinker)
    return thinker, tool_reader(plan)


def chat_message(c: CompletionOutput, plan: ToolPlan | None,
                 thinking: ReasoningPlan | None = None) -> tuple[AssistantMessage, str | None]:
    """A whole choice's message and finish reason: its reasoning split off first (`--reasoning-parser`),
    then its tool calls read out of what is left, as the plan asks (vLLM parses tools from the content
    after the reasoning, never from the reasoning)."""
    thinker, reader = answer_readers(plan, thinking)
    if isinstance(thinker, HarmonyAnswer):
        reasoning, text = split_delta(thinker, c.text, True)
        reasoning = reasoning if "reasoning" in thinker.used else None
        text = text if "content" in thinker.used else None
    else:
        reasoning, text = (None, c.text) if thinking is None else thinking.split(c.text)
    if thinking is not None and not thinking.include:
        reasoning = None
    if reader is None:
        return AssistantMessage(content=text, reasoning=reasoning), c.finish_reason
    content, calls, arguments = reader.feed(text or "", finished=True)
    tool_calls = [ToolCall(id=call.id, function=FunctionCall(name=call.name, arguments=call.arguments + arguments))
                  for call in calls]
    return (AssistantMessage(content=content or None, reasoning=reasoning, tool_calls=tool_calls),
            reader.finish_reason(c.finish_reason))


def chat_response(request_id: str, model: str, output: RequestOutput, params: SamplingParams,
                  names: TokenText, plan: ToolPlan | None = None, role: str = "assistant",
                  extras: Extras | None = None, thinking: ReasoningPlan | None = None) -> ChatCompletionResponse:
    """The whole answer; `role` is the message's (vLLM's --response-role, or the last message's role when
    the request asked for no generation prompt)."""
    with_ids = extras is not None and extras.token_ids
    choices = []
    for c in output.outputs:
        message, finish_reason = chat_message(c, plan, thinking)
        message.role = role
        lp = chat_logprobs(c, 0, len(c.token_ids), names, listed_alternatives(params)) \
            if params.num_logprobs is not None else None
        choices.append(ChatChoice(index=c.index, message=message, finish_reason=finish_reason, logprobs=lp,
                                  stop_reason=c.stop_reason, token_ids=list(c.token_ids) if with_ids else None))
    details = extras is not None and extras.prompt_tokens_details
    return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage([output], details=details),
                                  prompt_logprobs=prompt_logprob_entries(output) if params.prompt_logprobs is not None
                                  else None, prompt_token_ids=list(output.prompt_token_ids) if with_ids else None)


# ---------------------------------------------------------------------------- streams
def stream_usage(group: RequestGroup, prompt_only: bool = False, details: bool = False) -> UsageInfo:
    """A stream's final usage (each request's output carries its prompt's cached tokens)."""
    prompt = sum(len(st.prompt_token_ids) for st in group.streams)
    cached = sum(st.last.num_cached_tokens for st in group.streams if st.last is not None) if details else None
    return counted(prompt, 0 if prompt_only else sum(st.num_generation_tokens for st in group.streams), cached)


def has_news(c: CompletionOutput) -> bool:
    return bool(c.text or c.token_ids or c.finish_reason is not None)


def error_event(e: Exception) -> bytes:
    """The last event of a stream that could not finish (then `[DONE]`), with the code a whole response has."""
    code = "generation_error" if isinstance(e, RequestFailed) else "request_aborted"
    body = ErrorResponse(error=ErrorInfo(message=str(e), type="server_error", code=code))
    return sse(body.model_dump_json())


async def completion_stream(group: RequestGroup, request_id: str, model: str, params: SamplingParams,
                            include_usage: bool, names: TokenText, echo: Echo | None = None,
                            extras: Extras | None = None) -> AsyncIterator[bytes]:
    echo, extras = echo or Echo(), extras or Extras()
    created = now_s()
    offsets: dict[tuple[int, int], TextOffsets] = {}
    prompts: dict[int, RequestOutput] = {}  # the first output of each prompt: it holds the prompt log-probs
    made: dict[tuple[int, int], int] = {}  # completion tokens of each choice so far
    with_prompt_ids: set[tuple[int, int]] = set()  # choices whose prompt ids went out
    continuous = include_usage and extras.continuous_usage
    try:
        async for updates in group:
            events = []
            for p, out in updates:
                first_of_prompt = prompts.setdefault(p, out)
                for c in out.outputs:
                    key = (p, c.index)
                    first = key not in offsets
                    if not first and not has_news(c):
                        continue
                    offs = offsets.setdefault(key, names.offsets())
                    text, lp = choice_content(first_of_prompt, c, first, echo, params, names, offs)
                    new_ids = [] if echo.prompt_only else list(c.token_ids)
                    made[key] = made.get(key, 0) + len(new_ids)
                    if not text and not (lp and lp.tokens) and c.finish_reason is None and not (
                            extras.token_ids and new_ids):
                        continue
                    ids = {}
                    if extras.token_ids:
                        ids = {"token_ids": new_ids}
                        if key not in with_prompt_ids:
                            ids["prompt_token_ids"] = list(group.streams[p].prompt_token_ids)
                            with_prompt_ids.add(key)
                    choice = CompletionChoice(index=p * params.n + c.index, text=text, logprobs=lp,
                                              finish_reason=c.finish_reason,
                                              stop_reason=None if echo.prompt_only else c.stop_reason, **ids)
                    so_far = counted(len(group.streams[p].prompt_token_ids), made[key]) if continuous else None
                    chunk = CompletionChunk(id=request_id, created=created, model=model, choices=[choice],
                                            usage=so_far)
                    events.append(sse(chunk.model_dump_json()))
            if events:
                yield b"".join(events)
        if include_usage:
            chunk = CompletionChunk(id=request_id, created=created, model=model, choices=[],
                                    usage=stream_usage(group, echo.prompt_only, extras.prompt_tokens_details))
            yield sse(chunk.model_dump_json())
    except (RequestAborted, RequestFailed) as e:
        yield error_event(e)
    finally:
        group.abort()
    yield DONE


def split_delta(thinking: ThinkingReader | None, text: str, finished: bool) -> tuple[str, str]:
    """A delta's (reasoning, content): all content without a reasoning parser."""
    if thinking is None:
        return "", text
    reasoning, content = thinking.feed(text)
    if finished:
        more_reasoning, more_content = thinking.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
    return reasoning, content


def tool_deltas(reader: ChoiceToolReader, c: CompletionOutput, text: str | None = None) -> DeltaMessage:
    """A choice's delta with its tool calls read out of `text` (the delta's content; its whole text when
    None): each new call whole (its id, name and arguments so far), and a named call's arguments as
    they are written."""
    content, calls, arguments = reader.feed(c.text if text is None else text, finished=c.finish_reason is not None)
    deltas = []
    for call in calls:
        deltas.append(DeltaToolCall(index=reader.num_calls - len(calls) + len(deltas), id=call.id, type="function",
                                    function=DeltaFunctionCall(name=call.name, arguments=call.arguments + arguments)))
        arguments = ""
    if arguments:
        deltas.append(DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=arguments)))
    return DeltaMessage(content=content or None, tool_calls=deltas or None)


async def chat_stream(group: RequestGroup, request_id: str, model: str, params: SamplingParams,
                      include_usage: bool, names: TokenText, plan: ToolPlan | None = None,
                      role: str = "assistant", extras: Extras | None = None,
                      thinking: ReasoningPlan | None = None, log: RequestLog | None = None) -> AsyncIterator[bytes]:
    """The chunks of a chat answer; with a reasoning parser each delta's text is split into `reasoning`
    and `content` first, and tool calls are read from the content; `log` (--enable-log-outputs) logs each
    delta and each choice's whole text."""
    extras = extras or Extras()
    log = log if log is not None and log.logs_outputs else None  # no text kept nor delta joined for a log that is off
    created = now_s()
    thinkers, readers = {}, {}
    for i in range(params.n):
        thinkers[i], readers[i] = answer_readers(plan, thinking)
    show_reasoning = thinking is None or thinking.include
    prompt_ids = list(group.streams[0].prompt_token_ids)
    made = [0] * params.n  # completion tokens of each choice so far
    texts = dict.fromkeys(range(params.n), "")

    def chunk(choice: ChatStreamChoice, **more: Any) -> bytes:
        so_far = counted(len(prompt_ids), made[choice.index]) if include_usage and extras.continuous_usage else None
        body = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[choice], usage=so_far,
                                   **more)
        return sse(body.model_dump_json(exclude_none=False))

    try:
        first = {"prompt_token_ids": prompt_ids} if extras.token_ids else {}
        yield b"".join(chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role=role, content="")), **first)
                       for i in range(params.n))
        async for updates in group:
            events = []
            for _, out in updates:
                for c in out.outputs:
                    if not has_news(c):
                        continue
                    made[c.index] += len(c.token_ids)
                    lp = chat_logprobs(c, 0, len(c.token_ids), names, listed_alternatives(params)) \
                        if params.num_logprobs is not None else None
                    reader, thinker = readers[c.index], thinkers[c.index]
                    reasoning, text = split_delta(thinker, c.text, c.finish_reason is not None)
                    delta = DeltaMessage(content=text) if reader is None else tool_deltas(reader, c, text)
                    delta.reasoning = reasoning if reasoning and show_reasoning else None
                    finish_reason = c.finish_reason if reader is None else reader.finish_reason(c.finish_reason)
                    ids = list(c.token_ids) if extras.token_ids else None
                    if log is not None:
                        texts[c.index] += c.text
                    if (reader is not None or thinker is not None) and not (
                            delta.content or delta.reasoning or delta.tool_calls or lp or finish_reason or ids):
                        continue  # text held back (a possible tag, a call not yet complete)
                    if thinker is not None and not delta.content:
                        delta.content = None  # a reasoning delta carries no content field
                    if log is not None:
                        arguments = "".join(t.function.arguments or "" for t in delta.tool_calls or () if t.function)
                        log.generated(request_id, delta_text(delta.content, arguments), c.token_ids, finish_reason,
                                      streaming=True, delta=True)
                    events.append(chunk(ChatStreamChoice(index=c.index, delta=delta, logprobs=lp, token_ids=ids,
                                                         finish_reason=finish_reason, stop_reason=c.stop_reason)))
            if events:
                yield b"".join(events)
        if include_usage:
            body = ChatCompletionChunk(id=request_id, created=created, model=model, choices=[],
                                       usage=stream_usage(group, details=extras.prompt_tokens_details))
            yield sse(body.model_dump_json())
        for text in texts.values() if log is not None else ():
            log.generated(request_id, text, None, "streaming_complete", streaming=True)
    except (RequestAborted, RequestFailed) as e:
        yield error_event(e)
    finally:
        group.abort()
    yield DONE
