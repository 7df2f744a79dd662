"""The Responses API's response object and its output items, in OpenAI's shapes, and how a finished
chat answer becomes them: with a `--reasoning-parser`, its reasoning a `reasoning` item first (one
`reasoning_text` part, as vLLM's serving_responses gives it), its text a `message` item with one
`output_text` part, each tool call a `function_call` item (`call_id`, `name`, `arguments`). The client's `output_text` property joins the
text parts; nothing here needs to compute it.

With `include: ["message.output_text.logprobs"]` the text part carries the chat route's log-probs of
the answer's tokens (`server/logprobs.py`: `token`, `logprob`, `bytes`, `top_logprobs`), every token's,
as vLLM gives them: the tokens of a tool call the text part does not show are among them, and an
answer that is only calls has no text part to carry any.
"""

from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedrl.engine.outputs import CompletionOutput, RequestOutput
from pagedrl.server.logprobs import TokenText, chat_logprobs
from pagedrl.server.response_bodies import AssistantMessage, ChatTokenLogprob, now_s


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str = Field(default_factory=lambda: item_id("msg"))
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(BaseModel):
    id: str = Field(default_factory=lambda: item_id("rs"))
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class OutputFunctionCall(BaseModel):
    id: str = Field(default_factory=lambda: item_id("fc"))
    type: Literal["function_call"] = "function_call"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    call_id: str
    name: str
    arguments: str


OutputItem = OutputReasoning | OutputMessage | OutputFunctionCall


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache
    cache_write_tokens: int = 0  # OpenAI's field; the prefix cache keeps blocks without a count of its own


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0  # not counted (the reasoning is told apart in the text, not by token)


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A response as `POST /v1/responses` answers it and `GET /v1/responses/{id}` returns it: the
    request's settings said back (the effective sampling ones), its status, output and usage."""

    id: str = Field(default_factory=lambda: item_id("resp"))
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=now_s)
    status: Literal["completed", "incomplete", "in_progress", "failed", "cancelled", "queued"] = "in_progress"
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Any = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = None
    store: bool = False
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    service_tier: str = "default"
    top_logprobs: int | None = None


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool = True


def text_logprobs(c: CompletionOutput, names: TokenText, top: int) -> list[ChatTokenLogprob]:
    """The log-probs of `c`'s tokens (a whole answer's, or a stream's delta) as the chat route gives them."""
    return chat_logprobs(c, 0, len(c.token_ids), names, top).content or []


def output_items(message: AssistantMessage, incomplete: bool,
                 logprobs: list[ChatTokenLogprob] | None = None) -> list[OutputItem]:
    """An answer's items: its reasoning, its text (when it has some, or when it has nothing else) with
    `logprobs`, then its calls. When the token limit cut the answer, the last item is the one cut:
    `incomplete` (a call's arguments are then not whole JSON, and a client must not run it)."""
    items: list[OutputItem] = []
    if message.reasoning:
        items.append(OutputReasoning(content=[ReasoningText(text=message.reasoning)]))
    if message.content or not (message.tool_calls or items):
        items.append(OutputMessage(content=[OutputText(text=message.content or "", logprobs=logprobs or [])]))
    items.extend(OutputFunctionCall(call_id=c.id, name=c.function.name, arguments=c.function.arguments)
                 for c in message.tool_calls)
    if incomplete:
        items[-1].status = "incomplete"
    return items


def usage_of(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> ResponseUsage:
    return ResponseUsage(input_tokens=prompt_tokens, output_tokens=output_tokens,
                         total_tokens=prompt_tokens + output_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens))


def finished(base: ResponseObject, items: list[OutputItem], finish_reason: str | None, usage: ResponseUsage,
             error: str | None = None) -> ResponseObject:
    """`base` (the request's settings) with its outcome: `incomplete` when max_output_tokens (or the
    context) cut it, `failed` when the engine could not finish it, else `completed`."""
    out = base.model_copy(update={"output": items, "usage": usage})
    if finish_reason == "length":
        out.status, out.incomplete_details = "incomplete", IncompleteDetails()
    elif finish_reason in ("error", "abort"):
        out.status = "failed"
        out.error = ResponseError(code="server_error", message=error or f"the request ended: {finish_reason}")
    else:
        out.status = "completed"
    return out


def whole_response(base: ResponseObject, output: RequestOutput, message: AssistantMessage,
                   finish_reason: str | None, logprobs: list[ChatTokenLogprob] | None = None) -> ResponseObject:
    c = output.outputs[0]
    usage = usage_of(len(output.prompt_token_ids), len(c.token_ids), output.num_cached_tokens)
    return finished(base, output_items(message, finish_reason == "length", logprobs), finish_reason, usage, c.error)
