"""Request bodies in OpenAI's shapes (plus vLLM's extra sampling fields); the responses' are in
`server/response_bodies.py`.

Requests are validated strictly: a wrong JSON type is an error (HTTP 400), never silently coerced
("2" is not 2; 2.0 is, as JSON Schema says). Unknown fields are ignored, since OpenAI clients send fields this server has no
use for (`user`, `store`, `metadata`, ...); fields that would change the result but are not
implemented are declared and refused by the serving code instead of being ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from pagedrl.engine.sampling_params import MAX_LOGPROB_TOKEN_IDS


class OpenAIBase(BaseModel):
    # Python's JSON reader accepts Infinity and NaN; no field of a request may hold them.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


# ---------------------------------------------------------------------------- requests
class StreamOptions(OpenAIBase):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far, not only the last one
    continuous_usage_stats: bool | None = None


def _integral(value: Any) -> Any:
    """An integral float (`1.0`) as the int it is: JSON Schema counts it as an integer, and so do
    OpenAI's and vLLM's servers. Anything else is left to the strict check, which refuses it."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


INTEGRAL = BeforeValidator(_integral)  # on every integer field of a request (after its Field, so the
# schema keeps the range as minimum / maximum)


TOKEN_ID_MARK = "x-token-id"
TOKEN_ID_KEY_MARK = "x-token-id-key"  # a token id written as a JSON object's key (a decimal string)
LOGPROBS_MARK = "x-logprobs"  # a count of alternatives, bounded by the engine's max_logprobs (--max-logprobs)


# Ranges a value must be in, declared so that /openapi.json tells clients (and fuzzers) what is valid;
# SamplingParams checks the same ranges for offline use.
NonEmptyStr = Annotated[str, Field(min_length=1)]
# A token id; `/openapi.json` bounds it by the served model's vocabulary (server/openapi.py).
TokenId = Annotated[int, Field(ge=0, json_schema_extra={TOKEN_ID_MARK: True}), INTEGRAL]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
DECIMAL = r"^(0|[1-9][0-9]*)$"
# A token id as an object's key; its schema (`propertyNames`) is bounded by the vocabulary too.
TokenIdKey = Annotated[str, Field(pattern=DECIMAL, json_schema_extra={TOKEN_ID_KEY_MARK: True, "pattern": DECIMAL})]
# A count of alternatives; `/openapi.json` bounds it by the engine's max_logprobs, which the engine checks.
TopLogprobs = Annotated[int, Field(ge=0, json_schema_extra={LOGPROBS_MARK: True}), INTEGRAL]
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0)]


JsonSchemaDoc = dict[str, Any]  # a JSON schema


class JsonSchemaFormat(OpenAIBase):
    """OpenAI's `response_format.json_schema`: the output must validate against `schema`."""

    model_config = ConfigDict(populate_by_name=True)
    name: str
    description: str | None = None
    schema_: JsonSchemaDoc | None = Field(None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not


class ResponseFormat(OpenAIBase):
    """`{"type": "text"}`, `{"type": "json_object"}` (any JSON object) or `{"type": "json_schema",
    "json_schema": {...}}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(OpenAIBase):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    json_: JsonSchemaDoc | str | None = Field(None, alias="json")
    regex: NonEmptyStr | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: NonEmptyStr | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # declared so that they are refused rather than ignored, and out of the schema, which lists what is supported
    whitespace_pattern: SkipJsonSchema[str | None] = None
    structural_tag: SkipJsonSchema[str | None] = None

    # every key changes the output, so a misspelt one is refused (it would silently return free text)
    model_config = ConfigDict(populate_by_name=True, extra="forbid")


class SamplingRequest(OpenAIBase):
    """Fields shared by /v1/completions and /v1/chat/completions (vLLM's names for the extras)."""

    model: str | None = None
    n: Annotated[int, Field(ge=1), INTEGRAL] = 1
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1), INTEGRAL] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**64 - 1), INTEGRAL] | None = None
    stop: str | list[str] | None = None  # an empty stop string is refused by SamplingParams, naming `stop`
    stop_token_ids: list[Annotated[int, Field(ge=0), INTEGRAL]] | None = None  # any id; one never sampled never stops
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0), INTEGRAL] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id (a decimal string, as JSON keys are) -> bias in OpenAI's range
    logit_bias: dict[TokenIdKey, LogitBias] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    bad_words: list[Annotated[str, Field(pattern=r"\S")]] | None = None  # a word is not blank
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    request_id: str | None = None  # vLLM's: the response's id (after cmpl- / chatcmpl-) unless X-Request-Id names one
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs, and vLLM's older guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: JsonSchemaDoc | str | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    guided_grammar: NonEmptyStr | None = None
    guided_whitespace_pattern: SkipJsonSchema[str | None] = None  # refused rather than ignored; not in the schema
    # vLLM's extras not implemented: declared only to be refused (inputs.UNSUPPORTED_EXTRAS), not in the schema
    prompt_logprobs: TopLogprobs | None = None  # vLLM's: each prompt token's log-prob and k alternatives
    # vLLM's: only the prompt's last k tokens (-1: as many as the context holds)
    truncate_prompt_tokens: Annotated[int, Field(ge=1), INTEGRAL] | Literal[-1] | None = None
    # vLLM's: which end truncate_prompt_tokens cuts; only "left" (the prompt's start goes) is built
    truncation_side: Literal["left"] | None = None
    # vLLM's; any other than 0 needs its priority scheduling, which this server (first come, first served) lacks
    priority: Annotated[Literal[0], INTEGRAL] = 0
    # vLLM's: the answer carries the prompt's and the completion's token ids (server/responses.py)
    return_token_ids: bool | None = None
    # vLLM's: log-probs name each token `token_id:<id>`; unset, the server's --return-tokens-as-token-ids
    return_tokens_as_token_ids: bool | None = None
    # vLLM's: prefix-cache blocks are shared only with requests of the same salt; the answer is the same.
    # Empty is refused and 1024 characters are the most, as vLLM's protocol (check_cache_salt_support) has it
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    # vLLM's beam search (server/beam_search.py): n beams, ranked by cumulative log-prob / length ** length_penalty.
    # use_beam_search is left out of /openapi.json, as best_of is: with it, fields that sampling takes are refused
    # and n is bounded by max_logprobs / 2, rules between fields the schema does not state
    use_beam_search: SkipJsonSchema[bool] = False
    length_penalty: float = 1.0
    # vLLM's: with logprobs on, the log-probs of exactly these ids (and the sampled one's) at every output token,
    # in place of the top ones; empty: the top ones
    logprob_token_ids: Annotated[list[TokenId], Field(max_length=MAX_LOGPROB_TOKEN_IDS)] | None = None
    # vLLM's fields that would change the answer and are not built: refused when set (inputs.UNSUPPORTED_EXTRAS)
    prompt_embeds: SkipJsonSchema[Any] = None
    repetition_detection: SkipJsonSchema[Any] = None
    thinking_token_budget: SkipJsonSchema[Any] = None
    watermarking: SkipJsonSchema[Any] = None


COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's default on /v1/completions


# Rules of both routes between `stream` (false unless given) and the fields that depend on it: stream_options
# only with stream true, prompt_logprobs only without (as in vLLM).
STREAM_RULES = [
    {"anyOf": [{"not": {"required": ["stream_options"]}}, {"properties": {"stream_options": {"type": "null"}}},
               {"required": ["stream"], "properties": {"stream": {"const": True}}}]},
    {"anyOf": [{"not": {"required": ["prompt_logprobs"]}}, {"properties": {"prompt_logprobs": {"type": "null"}}},
               {"not": {"required": ["stream"]}}, {"properties": {"stream": {"const": False}}}]}]


class CompletionRequest(SamplingRequest):
    # max_tokens 0 (the prompt alone) only with echo; min_tokens over the default max_tokens only with a
    # max_tokens (as in vLLM; that min_tokens <= a given max_tokens is beyond what a schema can say)
    model_config = ConfigDict(json_schema_extra={"allOf": [{"anyOf": [
        {"properties": {"max_tokens": {"not": {"const": 0}}}}, {"required": ["echo"], "properties": {"echo": {"const": True}}}]},
        {"anyOf": [{"required": ["max_tokens"]}, {"properties": {"min_tokens": {"maximum": COMPLETION_MAX_TOKENS}}}]},
        *STREAM_RULES]})
    prompt: (NonEmptyStr | Annotated[list[NonEmptyStr], Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
    max_tokens: Annotated[int, Field(ge=0), INTEGRAL] | None = COMPLETION_MAX_TOKENS  # 0 only with echo
    logprobs: TopLogprobs | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens (a BOS) around a text prompt
    suffix: SkipJsonSchema[str | None] = None  # not supported: refused, and not in the schema
    # Legacy, and accepted only equal to `n`: a rule between fields the schema cannot state, so the
    # field is left out of /openapi.json rather than declared with values the server then refuses
    # (as are the unsupported fields, which are refused when sent rather than ignored).
    best_of: SkipJsonSchema[Annotated[int, Field(ge=1), INTEGRAL] | None] = None


def _text_part_schema(schema: dict[str, Any]) -> None:
    # The schema states what is accepted (a text part); validation keeps `type` a free string so that
    # another part's refusal can name its type ("image_url is not supported") in inputs.py.
    schema["properties"]["type"] = {"const": "text", "title": "Type", "type": "string"}
    schema["properties"]["text"] = {"title": "Text", "type": "string"}
    schema["required"] = ["type", "text"]


class ContentPart(OpenAIBase):
    model_config = ConfigDict(json_schema_extra=_text_part_schema)
    type: str
    text: str | None = None


class FunctionCall(OpenAIBase):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(OpenAIBase):
    """A call the model made: in an assistant message of a response, and of the history sent back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIBase):
    # Only an assistant turn may make tool calls, or leave its content out or null (it may carry calls instead).
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"role": {"const": "assistant"}}},
        {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}, "tool_calls": {"type": "null"}}}]})
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a `tool` turn: which call this is the result of
    # an assistant turn's reasoning, sent back as the answer gave it (vLLM's name, and its earlier one):
    # the template gets it, as vLLM passes it; on other roles it is ignored, as vLLM ignores it
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(OpenAIBase):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
    description: str | None = None
    parameters: JsonSchemaDoc | None = None  # a JSON schema of the arguments object
    strict: bool | None = None  # calls always follow the schema under `required` or a named tool


class ChatTool(OpenAIBase):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBase):
    name: str


class NamedToolChoice(OpenAIBase):
    type: Literal["function"]
    function: NamedFunction


# Continuing the final message needs add_generation_prompt false, whose default is true (vLLM's rule).
CONTINUE_RULE = {"anyOf": [
    {"not": {"required": ["continue_final_message"], "properties": {"continue_final_message": {"const": True}}}},
    {"required": ["add_generation_prompt"], "properties": {"add_generation_prompt": {"const": False}}}]}
CONTINUE_NEEDS_NO_GENERATION_PROMPT = ("continue_final_message and add_generation_prompt cannot both be true "
                                       "(send add_generation_prompt: false to continue the final message)")


class ChatCompletionRequest(SamplingRequest):
    # a tool_choice other than "none" needs tools to choose from; CONTINUE_RULE
    model_config = ConfigDict(json_schema_extra={"allOf": [{"anyOf": [
        {"not": {"required": ["tool_choice"]}}, {"properties": {"tool_choice": {"enum": ["none", None]}}},
        {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}]}, CONTINUE_RULE,
        *STREAM_RULES]})
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    continue_final_message: bool = False  # vLLM's: the prompt ends inside the final (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the chat template
    chat_template: str | None = None  # vLLM's: this request's own template (--trust-request-chat-template)
    # vLLM's: template variables too (a RAG template's documents; a reasoning model's effort)
    documents: list[dict[str, str]] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    add_special_tokens: bool = False  # vLLM's: the tokenizer's special tokens around the rendered prompt
    include_reasoning: bool = True  # vLLM's: with --reasoning-parser, false leaves the reasoning out
    # not implemented: declared only to be refused (inputs.UNSUPPORTED_EXTRAS), not in the schema
    functions: SkipJsonSchema[Any] = None  # OpenAI's deprecated function calling (use tools)
    function_call: SkipJsonSchema[Any] = None
    echo: SkipJsonSchema[Any] = None  # vLLM's echo of the last message on chat
