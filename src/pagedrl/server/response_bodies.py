"""Response bodies in OpenAI's shapes (plus vLLM's extra fields): what the server answers, streamed
or whole, and its error object. The request bodies are in `server/protocol.py`."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, computed_field, model_serializer

from pagedrl.server.protocol import ToolCall


def now_s() -> int:
    return int(time.time())


# vLLM's `return_token_ids` fields: in the answer only when the request asked for them
TokenIds = Annotated[list[int] | None, Field(exclude_if=lambda v: v is None)]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens found in the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    # vLLM's: only with --enable-prompt-tokens-details (left out otherwise, not null)
    prompt_tokens_details: Annotated[PromptTokensDetails | None, Field(exclude_if=lambda v: v is None)] = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's `Logprob` of a prompt position: the token's (or an alternative's) log-prob, rank and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# per prompt token (the first has none): token id (a JSON key) -> its entry, as vLLM's `prompt_logprobs`
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: TokenIds = None  # in a stream, on a choice's first chunk only
    token_ids: TokenIds = None  # the completion's (in a stream, each chunk's new ones), without an echoed prompt


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    """vLLM's message: with a `--reasoning-parser`, the model's reasoning in `reasoning` (vLLM's field
    now) and in `reasoning_content` (its earlier name, which many clients still read)."""

    role: str = "assistant"  # vLLM's --response-role, or the last message's role without a generation prompt
    content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)

    @computed_field
    def reasoning_content(self) -> str | None:
        return self.reasoning


class WithoutNulls(BaseModel):
    """A streamed delta: OpenAI leaves out what a delta does not carry (the role after a choice's first
    delta, a tool call's id and name after its first), rather than sending nulls."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(WithoutNulls):
    """OpenAI's streamed tool call: the first delta of call `index` has its id, type and name; later
    ones add to `function.arguments`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: TokenIds = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: TokenIds = None


class DeltaMessage(WithoutNulls):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # and as reasoning_content, as AssistantMessage
    tool_calls: list[DeltaToolCall] | None = None

    @computed_field
    def reasoning_content(self) -> str | None:
        return self.reasoning


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: TokenIds = None  # this chunk's new ones


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: TokenIds = None  # on the first chunks (each choice's role) only


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "pagedrl"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
