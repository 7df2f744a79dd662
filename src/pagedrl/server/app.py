"""The OpenAI-compatible HTTP app over an `AsyncEngine`: `build_app(engine, served_model_name=...)`.

Handlers only translate: body -> prompts and SamplingParams (inputs.py), engine outputs -> response
bodies or server-sent events (responses.py). Every request that leaves early, whether the client
went away, the server shut down or an error was raised, aborts its engine requests on the way
out, so its KV blocks are free before the next engine step.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response

import pagedrl
from pagedrl.engine.async_engine import (
    AsyncEngine,
    EngineDead,
    EngineOverloaded,
    RequestGroup,
)
from pagedrl.engine.beam_search import step_params
from pagedrl.engine.lora_request import LoRARequest
from pagedrl.engine.outputs import RequestOutput
from pagedrl.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedrl.server.beam_search import FinishedGroup, answer_params, beam_search_params, run_beam_search
from pagedrl.server.chat_template_flags import ChatRendering
from pagedrl.server.delivery import EventStreamResponse, final_outputs_unless_disconnected, json_response
from pagedrl.server.errors import ApiError, from_value_error, install_error_handlers, read_json
from pagedrl.server.inputs import DEFAULT_MAX_N, answer_decoding, chat_inputs, completion_inputs
from pagedrl.server.logprobs import TokenText
from pagedrl.server.lora_routes import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, lora_router
from pagedrl.server.metrics import CONTENT_TYPE, ServerMetrics
from pagedrl.server.openapi import errors, json_or_events, request_body
from pagedrl.server.openapi import install as install_openapi
from pagedrl.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from pagedrl.server.reasoning_parsers import (
    ReasoningPlan,
    grammar_after_reasoning,
    reasoning_end_token,
    reasoning_plan,
)
from pagedrl.server.request_ids import RequestIdHeader, base_request_id
from pagedrl.server.request_log import RequestLog, answer_text
from pagedrl.server.response_bodies import (
    ChatCompletionResponse,
    CompletionResponse,
    ModelCard,
    ModelList,
    VersionResponse,
)
from pagedrl.server.responses import (
    Echo,
    Extras,
    chat_response,
    chat_stream,
    completion_response,
    completion_stream,
    include_usage,
)
from pagedrl.server.responses_api import responses_router
from pagedrl.server.responses_protocol import ResponsesRequest
from pagedrl.server.responses_store import ResponseStore
from pagedrl.server.served_models import LoRAModule, ServedModels
from pagedrl.server.server_load import LoadTracking, ServerLoad, load_router
from pagedrl.server.structured import structured_outputs
from pagedrl.server.tokenize_routes import DetokenizeRequest, TokenizeRequest, tokenize_router
from pagedrl.server.tools import ToolPlan, check_tool_schemas, tool_plan
from pagedrl.server.ui_routes import ui_router

logger = logging.getLogger("pagedrl.server")
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 << 20
# What /openapi.json adds to ChatCompletionRequest on a server without auto tool choice: tools without a
# tool_choice mean "auto" (OpenAI's and vLLM's default), which such a server refuses, as vLLM's does.
TOOLS_NEED_A_CHOICE = {
    "description": 'This server has no auto tool choice (--enable-auto-tool-choice): tools need a tool_choice '
                   'other than "auto" ("none", "required" or a named function)',
    "anyOf": [{"properties": {"tools": {"not": {"type": "array", "minItems": 1}}}},
              {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": ["auto", None]}}}}]}
# ... and on a server without --trust-request-chat-template, to ChatCompletionRequest and TokenizeRequest:
# a request's own template is refused, as vLLM refuses it.
NO_REQUEST_TEMPLATES = {
    "description": "This server runs no request's own chat template (--trust-request-chat-template)",
    "properties": {"chat_template": {"type": "null"},
                   "chat_template_kwargs": {"properties": {"chat_template": {"type": "null"}}}}}


@dataclass
class Draining:
    """Set by the server's shutdown (`serve.py`) when it starts to drain."""

    on: bool = False


class DrainGate:
    """ASGI middleware: while draining, every new request is answered 503 with `Connection: close`;
    those already admitted run to their end."""

    def __init__(self, app: Any, draining: Draining) -> None:
        self.app, self.draining = app, draining

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.draining.on:
            error = ApiError(503, "the server is shutting down; retry on another server", "server_error",
                             code="server_shutting_down", headers={"Connection": "close"})
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def build_app(engine: AsyncEngine, *, served_model_name: str | Sequence[str], model_root: str | None = None,
              api_key: str | None = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES, max_n: int = DEFAULT_MAX_N,
              ui: bool = True, tool_call_parser: str | None = "hermes", enable_auto_tool_choice: bool = False,
              lora_modules: Sequence[LoRAModule] = (), allow_runtime_lora_updating: bool = False,
              sampling_defaults: dict[str, Any] | None = None, max_tokens_cap: int | None = None,
              allowed_origins: Sequence[str] = (), request_id_headers: bool = False,
              responses_store_bytes: int | None = None, chat_template: str | None = None,
              chat_template_content_format: str = "auto", response_role: str = "assistant",
              enable_log_requests: bool = False, max_log_len: int | None = None, enable_log_outputs: bool = False,
              trust_request_chat_template: bool = False, fastapi_docs: bool = True,
              return_tokens_as_token_ids: bool = False, reasoning_parser: str | None = None,
              enable_prompt_tokens_details: bool = False, enable_force_include_usage: bool = False,
              enable_server_load_tracking: bool = False) -> FastAPI:
    """The app; its lifespan starts the engine thread and, at shutdown, aborts what is left and stops it.
    With `ui`, `/` answers with the chat page (`server/ui_routes.py`), a static file that calls the
    API like any client (and needs the API key like any client). With `api_key`, every route that
    would tell the served names (`/v1/...`, `/metrics`) asks for it; the others name none without it.
    Tool calls (`server/tools.py`): `tool_choice` "auto" needs `enable_auto_tool_choice` and reads calls
    with `tool_call_parser`.
    On an engine built with `enable_lora`, each of `lora_modules` is served under its name (a request's
    `model` picks it; one that does not fit raises ValueError here), and with `allow_runtime_lora_updating`
    adapters are loaded and unloaded at run time (`server/lora_routes.py`). `sampling_defaults` (the
    model's generation config, vLLM's `--generation-config auto`) stand in for unset sampling fields;
    `max_tokens_cap` (a max_new_tokens the operator chose) bounds every request's max_tokens.
    `allowed_origins` (vLLM's `--allowed-origins`): web pages of those origins may call the API from a
    browser (CORS, every method and header, no cookies); none by default, so no other site can use a
    server on a user's own machine through their browser. `request_id_headers` (vLLM's
    `--enable-request-id-headers`): every response carries `X-Request-Id` (`server/request_ids.py`).
    `responses_store_bytes`: keep /v1/responses answers in memory up to that many bytes
    (`server/responses_store.py`); None keeps none (vLLM's default). `chat_template` (the text),
    `chat_template_content_format`, `response_role` and `trust_request_chat_template` (a request may
    bring its own template) are vLLM's chat flags (`server/chat_template_flags.py`); `enable_log_requests`
    logs every request as it is accepted, its prompt cut to `max_log_len`, and with `enable_log_outputs`
    every chat and Responses answer (`server/request_log.py`); without `fastapi_docs` there is no /docs,
    /redoc or /openapi.json (vLLM's `--disable-fastapi-docs`); `return_tokens_as_token_ids` (vLLM's flag)
    names log-probs' tokens `token_id:<id>` for requests that do not say (`server/logprobs.py`);
    `reasoning_parser` (vLLM's `--reasoning-parser`) splits a thinking model's chat answers into reasoning
    and content (`server/reasoning_parsers.py`). vLLM's usage flags: `enable_prompt_tokens_details` adds
    `prompt_tokens_details.cached_tokens` to chat and completion usages, `enable_force_include_usage` ends
    every stream with a usage chunk; `enable_server_load_tracking` counts generating requests for `/load`
    (`server/server_load.py`)."""
    served = ServedModels(served_model_name, read=engine.read_lora if engine.lora_enabled else None)
    served_model_name = served.base_name  # the first of several names: what metrics and defaults use
    for module in lora_modules:
        served.load(module)
    metrics = ServerMetrics(engine, served_model_name)
    tokenizer = engine.tokenizer
    reasoning_end = reasoning_end_token(reasoning_parser, tokenizer)  # a grammar starts after it
    max_model_len = engine.max_model_len
    rendering = ChatRendering(chat_template, chat_template_content_format, trust_request_chat_template)
    if (chat_line := rendering.describe(tokenizer)) is not None:
        logger.info(chat_line)
    request_log = RequestLog(enable_log_requests, max_log_len, enable_log_outputs)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        await engine.shutdown()

    docs = {} if fastapi_docs else dict(docs_url=None, redoc_url=None, openapi_url=None)
    app = FastAPI(title="pagedrl", lifespan=lifespan, **docs)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.served = served

    install_error_handlers(app)

    def authorized(request: Request) -> bool:
        """Whether the request may do what the API key guards (always, on a server without one)."""
        if not api_key:  # none, or empty (vLLM's: no key)
            return True
        given = request.headers.get("authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode())

    async def check_api_key(request: Request) -> None:
        if not authorized(request):
            raise ApiError(401, "missing or incorrect API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    check_model = served.resolve  # the adapter a request's `model` names (None: the base); 404 if none

    async def submit(prompts: list, params: SamplingParams, renames: dict[str, str] | None = None,
                     lora: LoRARequest | None = None, log_id: str | None = None,
                     cache_salt: str | None = None, log: bool = True) -> RequestGroup:
        # DELTA for streamed and whole responses alike: no step rebuilds what came before, and every
        # request's token timings reach the metrics
        params = params.clone(output_kind=RequestOutputKind.DELTA)
        try:
            group = await engine.submit(prompts, params, lora_request=lora, cache_salt=cache_salt)
        except ValueError as e:
            raise from_value_error(e, renames) from None
        except EngineOverloaded as e:
            raise ApiError(503, str(e), "server_error", code="server_overloaded", headers={"Retry-After": "1"}) from None
        except EngineDead as e:
            raise ApiError(503, str(e), "server_error", code="engine_unavailable") from None
        if log:
            request_log.received(log_id or group.streams[0].request_id, prompts,
                                 [s.prompt_token_ids for s in group.streams], params, lora, tokenizer)
        return group

    def token_text(params: SamplingParams, req: SamplingRequest | None = None) -> TokenText:
        """How log-probs name tokens: `token_id:<id>` where the request (else the server's flag) asks."""
        as_ids = req.return_tokens_as_token_ids if req is not None else None
        return TokenText(tokenizer, params.skip_special_tokens, return_tokens_as_token_ids if as_ids is None else as_ids)

    def extras(req: SamplingRequest) -> Extras:
        """vLLM's additions the request asked for (`server/responses.py`)."""
        return Extras(token_ids=bool(req.return_token_ids),
                      continuous_usage=bool(req.stream_options and req.stream_options.continuous_usage_stats),
                      prompt_tokens_details=enable_prompt_tokens_details)

    async def start_chat(req: ChatCompletionRequest, log_id: str | None = None
                         ) -> tuple[RequestGroup, SamplingParams, ToolPlan | None, ReasoningPlan | None]:
        """A chat request's engine request, running: /v1/chat/completions and /v1/responses both start
        theirs here, so the same messages are the same prompt and sampling on either route; and how its
        answer's reasoning is told from its content."""
        lora = check_model(req.model)
        plan = tool_plan(req, tool_call_parser, enable_auto_tool_choice)
        if plan is not None:  # schemas compile off the event loop (cached: a repeated tool costs nothing)
            await asyncio.to_thread(check_tool_schemas, plan, engine.check_structured_output)
        prompt_ids, params = chat_inputs(req, tokenizer, max_n, plan, sampling_defaults, max_tokens_cap, rendering)
        thinking = chat_reasoning(req, prompt_ids, params.structured_outputs is not None and reasoning_end is None)
        plan, decoding = answer_decoding(plan, thinking, grammar_after_reasoning(thinking, params, reasoning_end))
        group = await submit([prompt_ids], decoding, {"logprobs": "top_logprobs", **structured_outputs(req)[1]}, lora,
                             log_id, req.cache_salt)
        return group, params, plan, thinking

    def chat_reasoning(req: ChatCompletionRequest, prompt_ids: list[int], constrained: bool) -> ReasoningPlan | None:
        """How a chat answer's reasoning is told from its content (None without `--reasoning-parser`):
        sampled and beam-searched answers alike, as vLLM runs both through the same parser."""
        if reasoning_parser is None:
            return None
        return reasoning_plan(reasoning_parser, req.chat_template_kwargs, constrained,
                              tokenizer.decode(prompt_ids, skip_special_tokens=False), req.include_reasoning)

    async def beam_search(request: Request, req: SamplingRequest, prompts: list, params: SamplingParams,
                          lora: LoRARequest | None, request_id: str) -> tuple[list[RequestOutput], SamplingParams]:
        """`use_beam_search` (`server/beam_search.py`): each step's beams are one group of engine requests,
        aborted if the client goes away; the answers, and the params the response builders read. The
        request is logged once, with its BeamSearchParams, as vLLM logs it, when its first step (on the
        prompts as sent) is accepted; the steps are not."""
        beam = beam_search_params(req, params, max_model_len, engine.max_logprobs)
        sampling = step_params(beam)
        first = True

        async def run_step(step_prompts: list) -> list[RequestOutput]:
            nonlocal first
            group = await submit(step_prompts, sampling, None, lora, request_id, req.cache_salt, log=False)
            if first:
                request_log.received(request_id, prompts, [s.prompt_token_ids for s in group.streams], beam, lora,
                                     tokenizer)
                first = False
            return await final_outputs_unless_disconnected(request, group)

        outputs = await run_beam_search(prompts, beam, run_step, engine.eos_token_ids, max_model_len, request_id,
                                        tokenizer)
        return outputs, answer_params(beam)

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    @v1.get("/models", response_model=None, responses={200: {"model": ModelList, "description": "The served model"},
                                                        **errors(401)})
    async def models() -> Response:
        adapters = [ModelCard(id=lora.lora_name, root=lora.lora_path, parent=lora.base_model_name or served_model_name,
                              max_model_len=max_model_len) for lora in served.adapters.values()]
        bases = [ModelCard(id=name, root=model_root, max_model_len=max_model_len) for name in served.base_names]
        return json_response(ModelList(data=[*bases, *adapters]))

    @v1.post("/completions", response_model=None, openapi_extra=request_body(CompletionRequest),
             responses={**json_or_events(CompletionResponse, "The completions, or a stream of CompletionChunk"),
                        **errors(400, 401, 404, 413, 499, 500, 503)})
    async def completions(request: Request) -> Response:
        req = await read_json(request, CompletionRequest, max_request_body_bytes)
        lora = check_model(req.model)
        prompts, params = completion_inputs(req, max_n, sampling_defaults, max_tokens_cap, tokenizer)
        echo = Echo(req.echo, req.echo and req.max_tokens == 0)
        request_id = f"cmpl-{base_request_id(request, req.request_id)}"
        model = req.model or served_model_name
        if req.use_beam_search:
            group = FinishedGroup(*await beam_search(request, req, prompts, params, lora, request_id))
            params = group.params
        else:
            group = await submit(prompts, params, structured_outputs(req)[1], lora, request_id, req.cache_salt)
        if req.stream:
            with_usage = include_usage(req.stream_options, enable_force_include_usage)
            return EventStreamResponse(completion_stream(group, request_id, model, params, with_usage,
                                                         token_text(params, req), echo, extras(req)), group.abort)
        outputs = await final_outputs_unless_disconnected(request, group)
        return json_response(completion_response(request_id, model, outputs, params, token_text(params, req), echo,
                                                  req.prompt_logprobs is not None, extras(req)))

    @v1.post("/chat/completions", response_model=None, openapi_extra=request_body(ChatCompletionRequest),
             responses={**json_or_events(ChatCompletionResponse,
                                         "The chat completion, or a stream of ChatCompletionChunk"),
                        **errors(400, 401, 404, 413, 499, 500, 503)})
    async def chat_completions(request: Request) -> Response:
        req = await read_json(request, ChatCompletionRequest, max_request_body_bytes)
        request_id = f"chatcmpl-{base_request_id(request, req.request_id)}"
        if req.use_beam_search:
            prompt_ids, params = chat_inputs(req, tokenizer, max_n, None, sampling_defaults, max_tokens_cap, rendering)
            group = FinishedGroup(*await beam_search(request, req, [prompt_ids], params, check_model(req.model),
                                                     request_id))
            params, plan, thinking = group.params, None, chat_reasoning(req, prompt_ids, False)
        else:
            group, params, plan, thinking = await start_chat(req, request_id)
        model = req.model or served_model_name
        role = response_role if req.add_generation_prompt else req.messages[-1].role  # as vLLM answers
        if req.stream:
            with_usage = include_usage(req.stream_options, enable_force_include_usage)
            return EventStreamResponse(chat_stream(group, request_id, model, params, with_usage,
                                                   token_text(params, req), plan, role, extras(req), thinking,
                                                   log=request_log), group.abort)
        outputs = await final_outputs_unless_disconnected(request, group)
        response = chat_response(request_id, model, outputs[0], params, token_text(params, req), plan, role,
                                 extras(req), thinking)
        for choice in response.choices:
            calls = [(t.function.name, t.function.arguments) for t in choice.message.tool_calls]
            request_log.generated(request_id, answer_text(choice.message.content, calls),
                                  outputs[0].outputs[choice.index].token_ids, choice.finish_reason)
        return json_response(response)

    store = ResponseStore(responses_store_bytes) if responses_store_bytes is not None else None
    v1.include_router(responses_router(start_chat, served_model_name, store, max_request_body_bytes, token_text,
                                       request_log))
    request_models = [CompletionRequest, ChatCompletionRequest, ResponsesRequest, TokenizeRequest, DetokenizeRequest]
    if allow_runtime_lora_updating and served.lora_enabled:
        v1.include_router(lora_router(served, max_request_body_bytes))
        request_models += [LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest]
    app.include_router(v1)

    if ui:
        app.include_router(ui_router())
    app.include_router(tokenize_router(tokenizer, served, max_model_len, engine.vocab_size, max_request_body_bytes,
                                       authorized, rendering))

    @app.get("/health", response_model=None, response_class=Response, responses={
        200: {"description": "The engine is running (empty body)", "content": {}}, **errors(503)})
    @app.api_route("/ping", methods=["GET", "POST"], response_model=None, response_class=Response, responses={
        200: {"description": "/health under the name SageMaker asks (empty body)", "content": {}}, **errors(503)})
    async def health() -> Response:
        if not engine.is_healthy:
            raise ApiError(503, "the engine is not running", "server_error", code="engine_unavailable")
        return Response(status_code=200)

    # its model_name labels name the served model and adapters: behind the API key where there is one
    @app.get("/metrics", response_model=None, response_class=Response, dependencies=[Depends(check_api_key)],
             responses={200: {"description": "Prometheus text exposition",
                              "content": {CONTENT_TYPE: {"schema": {"type": "string"}}}}, **errors(401)})
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    load = ServerLoad()
    app.include_router(load_router(load))

    @app.get("/version", response_model=None,
             responses={200: {"model": VersionResponse, "description": "The pagedrl version"}})
    async def version() -> Response:
        return json_response(VersionResponse(version=pagedrl.__version__))

    auto_tools = enable_auto_tool_choice and tool_call_parser is not None
    templates = [] if trust_request_chat_template else [NO_REQUEST_TEMPLATES]
    rules = {"ChatCompletionRequest": {"allOf": [*([] if auto_tools else [TOOLS_NEED_A_CHOICE]), *templates]},
             "TokenizeRequest": {"allOf": templates}}
    install_openapi(app, request_models, vocab_size=engine.vocab_size, max_logprobs=engine.max_logprobs,
                    rules={name: rule for name, rule in rules.items() if rule["allOf"]})
    app.state.draining = Draining()
    app.add_middleware(DrainGate, draining=app.state.draining)
    if request_id_headers:
        app.add_middleware(RequestIdHeader)
    if enable_server_load_tracking:
        app.add_middleware(LoadTracking, load=load)
    if allowed_origins:  # outermost: a 503 while draining carries the headers too
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    return app
