"""vLLM's `/tokenize`, `/detokenize` and `/tokenizer_info`: the served tokenizer, its chat template included.

A chat prompt is rendered by the very function the chat route uses (`chat_prompt_ids`), its `tools`
included, so `/tokenize` counts what `/v1/chat/completions` will count as `prompt_tokens`. Like vLLM's,
these routes sit outside `/v1` and need no API key; so when a server has one, the 404 for a `model`
it does not serve names nothing that `/v1/models` would keep from a client without the key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from pagedrl.server.chat_template_flags import MODEL_TEMPLATE, ChatRendering
from pagedrl.server.errors import ApiError, bad_request, read_json
from pagedrl.server.inputs import chat_prompt_ids, tokenizer_config
from pagedrl.server.openapi import errors, request_body
from pagedrl.server.protocol import (
    CONTINUE_NEEDS_NO_GENERATION_PROMPT,
    CONTINUE_RULE,
    ChatMessage,
    ChatTool,
    OpenAIBase,
    TokenId,
)
from pagedrl.server.served_models import ServedModels
from pagedrl.server.tools import ToolPlan


class TokenizeRequest(OpenAIBase):
    """vLLM's /tokenize: a `prompt` (text) or chat `messages`, exactly one of them; `tools` go with messages."""

    model_config = ConfigDict(json_schema_extra={"allOf": [
        {"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]},
        {"anyOf": [{"required": ["messages"]}, {"properties": {"tools": {"not": {"type": "array", "minItems": 1}}}}]},
        CONTINUE_RULE]})
    model: str | None = None
    # left out, not null: a default that is not validated, so an explicit null is refused as the schema says
    prompt: str = Field(None, validate_default=False)
    messages: Annotated[list[ChatMessage], Field(min_length=1)] = Field(None, validate_default=False)
    tools: list[ChatTool] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as on the chat route, so that its prompt counts the same
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # as on the chat route: with --trust-request-chat-template only


class DetokenizeRequest(OpenAIBase):
    model: str | None = None
    tokens: list[TokenId]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """The tokenizer's configuration, equivalent to its tokenizer_config.json (vLLM's /tokenizer_info)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str


def json_response(model: BaseModel) -> Response:
    return Response(model.model_dump_json(), media_type="application/json")


def prompt_ids(tokenizer: Any, req: TokenizeRequest, rendering: ChatRendering = MODEL_TEMPLATE) -> list[int]:
    """The ids the request's prompt or messages (with their tools, rendered as for the chat route, by the
    server's template and content format) make."""
    if tokenizer is None:
        raise bad_request("this model has no tokenizer")
    if (req.prompt is None) == (req.messages is None):
        raise bad_request("give exactly one of prompt or messages", param="prompt")
    if req.messages is None:
        if req.tools:
            raise bad_request("tools are rendered by the chat template: give them with messages", param="tools")
        return tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    # whatever a chat request's tool_choice, its tools are rendered the same: as "none" renders them
    tools = ToolPlan("none", list(req.tools)).tool_dicts() if req.tools else None
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request(CONTINUE_NEEDS_NO_GENERATION_PROMPT, param="continue_final_message")
    return chat_prompt_ids(tokenizer, req.messages, req.add_generation_prompt, tools,
                           continue_final_message=req.continue_final_message, template_kwargs=req.chat_template_kwargs,
                           rendering=rendering.for_request(req.chat_template, req.chat_template_kwargs))


def tokenize_router(tokenizer: Any, served: ServedModels, max_model_len: int, vocab_size: int,
                    max_request_body_bytes: int, authorized: Callable[[Request], bool],
                    rendering: ChatRendering = MODEL_TEMPLATE) -> APIRouter:
    """The three routes; `authorized(request)` says whether the request could read /v1/models (its
    404 for an unknown model then lists the served names); `rendering`: the chat route's template."""
    router = APIRouter()

    @router.post("/tokenize", response_model=None, openapi_extra=request_body(TokenizeRequest),
                 responses={200: {"model": TokenizeResponse, "description": "The prompt's token ids"},
                            **errors(400, 404, 413)})
    async def tokenize(request: Request) -> Response:
        req = await read_json(request, TokenizeRequest, max_request_body_bytes)
        served.resolve(req.model, disclose=authorized(request))
        ids = prompt_ids(tokenizer, req, rendering)
        return json_response(TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids))

    @router.post("/detokenize", response_model=None, openapi_extra=request_body(DetokenizeRequest),
                 responses={200: {"model": DetokenizeResponse, "description": "The text of the token ids"},
                            **errors(400, 404, 413)})
    async def detokenize(request: Request) -> Response:
        req = await read_json(request, DetokenizeRequest, max_request_body_bytes)
        served.resolve(req.model, disclose=authorized(request))
        if tokenizer is None:
            raise bad_request("this model has no tokenizer")
        for i, t in enumerate(req.tokens):
            if not 0 <= t < vocab_size:
                raise bad_request(f"token {i} is {t}, outside the vocabulary [0, {vocab_size})", param=f"tokens.{i}")
        return json_response(DetokenizeResponse(prompt=tokenizer.decode(req.tokens)))

    @router.get("/tokenizer_info", response_model=None, responses={
        200: {"model": TokenizerInfoResponse, "description": "The tokenizer's configuration "
              "(tokenizer_config.json's keys, as vLLM answers)"}, **errors(404)})
    async def tokenizer_info() -> Response:
        if tokenizer is None:
            raise ApiError(404, "this model has no tokenizer", "not_found_error")
        return json_response(TokenizerInfoResponse(**tokenizer_config(tokenizer, max_model_len, rendering)))

    return router
