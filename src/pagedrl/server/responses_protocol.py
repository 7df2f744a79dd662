"""The request body of OpenAI's Responses API (`POST /v1/responses`), as vLLM serves it.

Unlike the older routes' bodies, this one is closed: the Responses API is one fixed set of fields, so
a field this server does not know is a 400 naming it (`unknown field 'conversation'`) rather than
ignored. Fields it knows but does not implement (`max_tool_calls`, `conversation`, `prompt`) are
declared, kept out of the schema, and refused by name in `responses_inputs.py`. Input items and
tools are read leniently inside (an output item sent back as input carries `id`, `status`,
`annotations`), and an item or part of a type not served is refused naming its type.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag
from pydantic.json_schema import SkipJsonSchema

from pagedrl.server.errors import ITEM_TYPES
from pagedrl.server.protocol import INTEGRAL, JsonSchemaDoc, NonEmptyStr, OpenAIBase, TopLogprobs


def _text_part_schema(schema: dict[str, Any]) -> None:
    # what is accepted; validation keeps `type` a free string so that a refusal can name another type
    schema["properties"]["type"] = {"enum": ["input_text", "output_text"], "title": "Type", "type": "string"}
    schema["properties"]["text"] = {"title": "Text", "type": "string"}
    schema["required"] = ["type", "text"]


class InputPart(OpenAIBase):
    """A text part of an input message or a function's output: `input_text` (or `output_text`, as an
    earlier answer's message comes back); other types are refused naming theirs."""

    model_config = ConfigDict(json_schema_extra=_text_part_schema)
    type: str
    text: str | None = None


class MessageItem(OpenAIBase):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputPart]


class FunctionCallItem(OpenAIBase):
    """A call the model made, sent back before its output."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str  # JSON text


class FunctionCallOutputItem(OpenAIBase):
    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[InputPart]


class ReasoningItem(OpenAIBase):
    """An earlier answer's reasoning item (`--reasoning-parser`), sent back with its output as OpenAI's
    clients do: an assistant turn of its own with this reasoning, as vLLM passes it to the template
    (Qwen3's templates render the reasoning of turns after the last user message)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None  # refused, as vLLM refuses it
    status: str | None = None


def _item_type(value: Any) -> str | None:
    """An item's tag: its `type`, or `message` for the short form `{"role", "content"}`."""
    if isinstance(value, dict):
        kind = value.get("type", "message")
        return kind if kind in ITEM_TYPES else None
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type, custom_error_type="input_item_type",
                  custom_error_message="item type not supported here (message, function_call, function_call_output, "
                                       "reasoning)")]


class FunctionTool(OpenAIBase):
    """Responses' flat function tool, `{"type": "function", "name", "parameters", ...}`; other tool
    types (web_search, file_search, mcp, ...) are refused naming theirs."""

    type: str
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    description: str | None = None
    parameters: JsonSchemaDoc | None = None
    strict: bool | None = None


class FunctionToolChoice(OpenAIBase):
    type: Literal["function"]
    name: str


class TextFormat(OpenAIBase):
    """`text.format`: `text`, `json_object`, or `json_schema` with its schema at the top level."""

    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: JsonSchemaDoc | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class TextConfig(OpenAIBase):
    model_config = ConfigDict(extra="forbid")
    format: TextFormat | None = None


class Reasoning(OpenAIBase):
    """Accepted; `effort` reaches the chat template as `reasoning_effort` (templates that read it, such
    as gpt-oss's, follow it). Reasoning items are made by the server's `--reasoning-parser`; without
    one, what a model thinks stays in its text."""

    model_config = ConfigDict(extra="forbid")
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# OpenAI's `include` values; only the log-probs add anything here, the others name items this server never makes
OUTPUT_LOGPROBS = "message.output_text.logprobs"
Includable = Literal["file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                     "message.input_image.image_url", "computer_call_output.output.image_url",
                     "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs"]


class StreamOptions(OpenAIBase):
    include_obfuscation: bool = True  # accepted; no obfuscation field is sent


class ResponsesRequest(OpenAIBase):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True  # OpenAI's default; kept only on a server with a store (responses_store.py)
    previous_response_id: NonEmptyStr | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    user: str | None = None
    reasoning: Reasoning | None = None
    request_id: NonEmptyStr | None = None  # vLLM's: the response's id, as given
    # accepted and answered back; they change nothing here (prefix caching needs no key)
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["disabled", "auto"] | None = None  # "auto" refused: a long input is a 400, not cut
    # with OUTPUT_LOGPROBS in `include`, each output_text part's tokens and their `top_logprobs` alternatives
    # (vLLM's rule: top_logprobs alone asks for nothing)
    include: list[Includable] | None = None
    top_logprobs: TopLogprobs | None = None
    # answered at once and run apart from the request (responses_background.py); needs `store` and a store
    background: bool | None = None
    # known, not implemented: refused by name when given (responses_inputs.UNSUPPORTED), not in the schema
    max_tool_calls: SkipJsonSchema[int | None] = None
    conversation: SkipJsonSchema[Any] = None
    prompt: SkipJsonSchema[Any] = None
