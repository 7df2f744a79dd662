"""A Responses request as the chat request it means, so that `/v1/responses` runs the chat route's own
path (its template, SamplingParams, tools and structured outputs), not a copy of it.

`instructions` become a system message first; the previous response's conversation (without its
instructions, as OpenAI's `previous_response_id` carries none over) comes next, then the input items:
messages (`developer` read as `system`), `function_call` items as the assistant's `tool_calls`, and
`function_call_output` items as `tool` messages. Errors the chat path raises name chat fields; they
are renamed here to the fields the client sent (`text.format.schema`, `tools.0.parameters`, `input.2`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from pagedrl.server.errors import ApiError, bad_request, from_validation_error
from pagedrl.server.protocol import ChatCompletionRequest
from pagedrl.server.responses_protocol import (
    OUTPUT_LOGPROBS,
    FunctionCallItem,
    FunctionCallOutputItem,
    InputPart,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)

TEXT_PARTS = ("input_text", "output_text")
# known fields this server does not implement: a 400 naming each when given
UNSUPPORTED = {"max_tool_calls": "max_tool_calls",
               "conversation": "conversations", "prompt": "prompt templates"}


@dataclass
class ChatForm:
    """The chat request, the conversation to keep for a later `previous_response_id` (no instructions),
    and where each chat message came from in the Responses request, for renaming errors."""

    request: ChatCompletionRequest
    conversation: list[dict[str, Any]]
    origins: list[str] = field(default_factory=list)


def check_supported(req: ResponsesRequest) -> None:
    for name, what in UNSUPPORTED.items():
        if getattr(req, name) not in (None, False, [], 0):
            raise bad_request(f"{name}: {what} not supported on this server", param=name)
    if req.truncation == "auto":
        raise bad_request('truncation "auto" is not supported: an input longer than the context is refused',
                          param="truncation")
    if req.background and not req.store:  # vLLM's and OpenAI's rule: the answer is fetched from the store
        raise bad_request("background can only be used when `store` is true", param="background")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")


def parts(content: str | list[InputPart], where: str) -> str | list[dict[str, str]]:
    """Text parts as the chat route's; another part type is refused naming it."""
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        if part.type not in TEXT_PARTS or part.text is None:
            raise bad_request(f"content part of type {part.type!r} is not supported (input_text and output_text "
                              "only)", param=f"{where}.{j}.type")
        out.append({"type": "text", "text": part.text})
    return out


def reasoning_text(item: ReasoningItem, where: str) -> str:
    """A reasoning item's text as vLLM reads it: its first content part's, else its first summary's."""
    if item.encrypted_content:
        raise bad_request("encrypted reasoning content is not supported", param=f"{where}.encrypted_content")
    parts = item.content or item.summary
    return str(parts[0].get("text") or "") if parts else ""


def item_messages(items: list[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem],
                  messages: list[dict[str, Any]], origins: list[str]) -> None:
    """Append the input items to `messages` as chat messages; consecutive calls join one assistant turn
    (and the assistant's message just before them), as OpenAI's output lists a turn's text then its calls."""
    for i, item in enumerate(items):
        where = f"input.{i}"
        # this request's assistant turn so far, which a reasoning item, an answer or calls join (vLLM's rule)
        turn = messages[-1] if messages and messages[-1]["role"] == "assistant" and origins[-1].startswith(
            "input.") else None
        if isinstance(item, ReasoningItem):
            reasoning = reasoning_text(item, where)
            if turn is not None and isinstance(turn.get("reasoning", ""), str):
                turn["reasoning"] = turn.get("reasoning", "") + reasoning
            else:
                messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
        elif isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            content = parts(item.content, f"{where}.content")
            if role == "assistant" and turn is not None and turn.get("content") is None:
                turn["content"] = content  # the answer after its reasoning or calls: one turn
            else:
                messages.append({"role": role, "content": content})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and origins[-1].startswith("input."):
                last.setdefault("tool_calls", []).append(call)
                continue
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            called = {c["id"] for m in messages for c in m.get("tool_calls") or ()}
            if item.call_id not in called:  # OpenAI's 400: an output answers a call the conversation made
                raise bad_request(f"No tool call found for function call output with call_id {item.call_id}.",
                                  param=f"{where}.call_id")
            messages.append({"role": "tool", "tool_call_id": item.call_id,
                             "content": parts(item.output, f"{where}.output")})
        origins.append(where)


def wants_logprobs(req: ResponsesRequest) -> bool:
    return OUTPUT_LOGPROBS in (req.include or ())


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body: dict[str, Any] = {"model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "user": req.user,
                            "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        for i, tool in enumerate(req.tools):
            if tool.type != "function":
                raise bad_request(f"tools.{i}: tool type {tool.type!r} is not supported (function tools only)",
                                  param=f"tools.{i}.type")
            if tool.name is None:
                raise bad_request(f"tools.{i}: a function tool needs a name", param=f"tools.{i}.name")
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise bad_request("text.format of type json_schema needs a schema", param="text.format.schema")
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
    if wants_logprobs(req):  # the chat route's log-probs, bounded by --max-logprobs as there
        body["logprobs"], body["top_logprobs"] = True, req.top_logprobs
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["chat_template_kwargs"] = {"reasoning_effort": req.reasoning.effort}
    return {k: v for k, v in body.items() if v is not None}


def chat_form(req: ResponsesRequest, history: list[dict[str, Any]]) -> ChatForm:
    """The chat request `req` means after the conversation `history` (a stored response's)."""
    check_supported(req)
    messages: list[dict[str, Any]] = []
    origins: list[str] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
        origins.append("instructions")
    messages.extend(dict(m) for m in history)
    origins.extend("previous_response_id" for _ in history)
    if isinstance(req.input, str):
        messages.append({"role": "user", "content": req.input})
        origins.append("input")
    else:
        item_messages(req.input, messages, origins)
    if not messages:
        raise bad_request("input is empty and there is no earlier conversation to answer", param="input")
    try:
        chat = ChatCompletionRequest.model_validate(chat_body(req, messages))
    except ValidationError as e:
        raise in_responses_terms(from_validation_error(e), origins) from None
    first = 1 if req.instructions is not None else 0
    return ChatForm(chat, messages[first:], origins)


# chat field -> Responses field, in the order tried
RENAMES = [(re.compile(r"response_format\.json_schema\.schema"), "text.format.schema"),
           (re.compile(r"response_format"), "text.format"),
           (re.compile(r"tools(\.|\[)(\d+)(\]?)\.function\."), r"tools\1\2\3."),
           (re.compile(r"tool_choice\.function\.name"), "tool_choice.name"),
           (re.compile(r"max_(completion_)?tokens"), "max_output_tokens")]
MESSAGE = re.compile(r"messages(\.(\d+))?")  # in a param; in a message's text, only with an index
INDEXED_MESSAGE = re.compile(r"messages(\.(\d+))")


def in_responses_terms(e: ApiError, origins: list[str]) -> ApiError:
    """The chat path's error `e` naming what the client sent: its param and message renamed."""

    def origin(m: re.Match) -> str:
        k = int(m.group(2)) if m.group(2) is not None else None
        return origins[k] if k is not None and k < len(origins) else "input"

    def rename(text: str, messages: re.Pattern) -> str:
        for pattern, new in RENAMES:
            text = pattern.sub(new, text)
        return messages.sub(origin, text)

    e.message = rename(e.message, INDEXED_MESSAGE)
    e.args = (e.message,)
    if e.param is not None:
        e.param = rename(e.param, MESSAGE)
    return e
