"""OpenAI's Responses API as vLLM serves it: `POST /v1/responses`, and with a store
(`responses_store.py`) `GET` and `DELETE /v1/responses/{id}`, background responses
(`responses_background.py`) and `POST /v1/responses/{id}/cancel`.

A Responses request is read as the chat request it means (`responses_inputs.py`) and run by the chat
route's own `start_chat`, so the prompt, the sampling, tool calls and structured outputs are the
chat route's, token for token; only the answer's shape differs (`responses_bodies.py`,
`responses_stream.py`). The routes sit under `/v1`, behind the API key, and their engine requests
count in `/metrics` as every other route's do.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pagedrl.engine.outputs import CompletionOutput, RequestOutput
from pagedrl.engine.request_stream import RequestGroup
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.server.delivery import EventStreamResponse, final_outputs_unless_disconnected, json_response
from pagedrl.server.errors import ApiError, bad_request, read_json
from pagedrl.server.logprobs import TokenText
from pagedrl.server.openapi import errors, json_or_events, request_body
from pagedrl.server.protocol import ChatCompletionRequest
from pagedrl.server.reasoning_parsers import ReasoningPlan
from pagedrl.server.request_ids import base_request_id
from pagedrl.server.request_log import RequestLog, answer_text
from pagedrl.server.response_bodies import ChatTokenLogprob
from pagedrl.server.responses import chat_message
from pagedrl.server.responses_background import BackgroundRuns, EventLog, replay, stream_query
from pagedrl.server.responses_bodies import (
    OutputFunctionCall,
    OutputMessage,
    ResponseDeleted,
    ResponseObject,
    text_logprobs,
    whole_response,
)
from pagedrl.server.responses_inputs import chat_form, in_responses_terms
from pagedrl.server.responses_protocol import ResponsesRequest
from pagedrl.server.responses_store import ResponseStore, StoredResponse
from pagedrl.server.responses_stream import EventWriter, response_stream
from pagedrl.server.tools import ToolPlan

# the chat route's path from a request to running engine requests (app.py)
# (the request, the id the request log names it by)
StartChat = Callable[[ChatCompletionRequest, str],
                     Awaitable[tuple[RequestGroup, SamplingParams, ToolPlan | None, ReasoningPlan | None]]]
# the id in the path, declared by hand: a typed handler argument would add FastAPI's own 422 body to the
# document, where every error this server answers is OpenAI's error object
BY_ID = {"parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}]}
RETRIEVE = {"parameters": [*BY_ID["parameters"],
                           {"name": "stream", "in": "query", "schema": {"type": "boolean", "default": False}},
                           {"name": "starting_after", "in": "query", "schema": {"type": "integer", "minimum": 0}}]}
NO_STORE_HINT = " (this server keeps no responses; start it with --enable-responses-store)"
NO_BACKGROUND = ("This server does not keep responses and therefore does not run them in the background; start it "
                 "with --enable-responses-store (or VLLM_ENABLE_RESPONSES_API_STORE=1).")


def assistant_turn(response: ResponseObject) -> dict[str, Any]:
    """A response's output as the chat message that continues its conversation."""
    texts = [part.text for item in response.output if isinstance(item, OutputMessage) for part in item.content]
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in response.output if isinstance(item, OutputFunctionCall)]
    turn: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def logged_text(turn: dict[str, Any]) -> str:
    """An answer as --enable-log-outputs logs it: its text, else its calls."""
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in turn.get("tool_calls", ())]
    return answer_text(turn["content"], calls)


def base_response(req: ResponsesRequest, response_id: str, model: str, params: SamplingParams,
                  stored: bool) -> ResponseObject:
    """The response before its answer: the request's settings as OpenAI says them back."""
    choice = req.tool_choice
    return ResponseObject(
        id=response_id, model=model, instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        temperature=params.temperature, top_p=params.top_p,
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []],
        tool_choice=choice.model_dump() if choice is not None and not isinstance(choice, str) else (choice or "auto"),
        parallel_tool_calls=req.parallel_tool_calls,
        text=req.text.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format
        else {"format": {"type": "text"}},
        reasoning=req.reasoning.model_dump() if req.reasoning is not None else None,
        previous_response_id=req.previous_response_id, store=stored, background=bool(req.background),
        metadata=req.metadata or {}, user=req.user,
        service_tier=req.service_tier or "default", top_logprobs=req.top_logprobs)


def responses_router(start_chat: StartChat, served_model_name: str, store: ResponseStore | None,
                     max_request_body_bytes: int, token_text: Callable[[SamplingParams], TokenText],
                     request_log: RequestLog) -> APIRouter:
    """The routes; without a `store` only `POST /responses` answers anything but 404 (vLLM's default).
    `token_text` names a request's tokens in its log-probs, as on the chat route; `request_log` logs the
    answers with --enable-log-outputs."""
    router = APIRouter()
    running = BackgroundRuns()

    def stored(response_id: str, param: str | None = None) -> StoredResponse:
        entry = store.get(response_id) if store is not None else None
        if entry is None:
            if param and running.get(response_id) is not None:
                raise bad_request(f"Previous response with id '{response_id}' is still running; continue it once "
                                  "it has finished.", param=param)
            which = "Previous response" if param else "Response"
            raise ApiError(404, f"{which} with id '{response_id}' not found.{'' if store else NO_STORE_HINT}",
                           param=param or "response_id", code="previous_response_not_found" if param else None)
        return entry

    @router.post("/responses", response_model=None, openapi_extra=request_body(ResponsesRequest),
                 responses={**json_or_events(ResponseObject, "The response (queued, with background), or a stream "
                                                             "of Responses events"),
                            **errors(400, 401, 404, 413, 499, 500, 503)})
    async def create_response(request: Request) -> Response:
        req = await read_json(request, ResponsesRequest, max_request_body_bytes)
        history = stored(req.previous_response_id, "previous_response_id").conversation \
            if req.previous_response_id is not None else []
        form = chat_form(req, history)
        if req.background and store is None:
            raise bad_request(NO_BACKGROUND, param="background")
        response_id = req.request_id or f"resp_{base_request_id(request, None)}"  # vLLM's field, else as chat's
        if running.get(response_id) is not None:
            raise bad_request(f"A background response with id '{response_id}' is still running.", param="request_id")
        try:
            group, params, plan, thinking = await start_chat(form.request, response_id)
        except ApiError as e:
            raise in_responses_terms(e, form.origins) from None
        keep = store is not None and req.store
        base = base_response(req, response_id, req.model or served_model_name, params, keep)

        def done(response: ResponseObject, events: Sequence[bytes] | None = None) -> None:
            if keep:
                store.put(response, [*form.conversation, assistant_turn(response)], events)

        names, top = token_text(params), params.logprobs

        def logprobs_of(c: CompletionOutput) -> list[ChatTokenLogprob]:
            return text_logprobs(c, names, top)

        asked = top is not None
        def streamed(response: ResponseObject) -> None:
            request_log.generated(response_id, logged_text(assistant_turn(response)), None, "streaming_complete",
                                  streaming=True)

        def whole(outputs: list[RequestOutput]) -> ResponseObject:
            c = outputs[0].outputs[0]
            message, finish_reason = chat_message(c, plan, thinking)
            response = whole_response(base, outputs[0], message, finish_reason, logprobs_of(c) if asked else None)
            request_log.generated(response_id, logged_text(assistant_turn(response)), c.token_ids, finish_reason)
            return response

        if req.background:
            log = EventLog() if req.stream else None

            async def answer() -> ResponseObject:
                if log is None:
                    return whole(await group.final_outputs())
                finals: list[ResponseObject] = []
                events = response_stream(group, base, plan,
                                         lambda r: (streamed(r), finals.append(r)), logprobs_of if asked else None,
                                         thinking, EventWriter(log.append))
                async for _ in events:
                    pass
                return finals[0]

            run = running.start(base, group, answer, done, log)
            if log is not None:  # a reader of the log: closing it leaves the answer running
                return EventStreamResponse(log.read(), lambda: None)
            return json_response(run.base)
        if req.stream:
            return EventStreamResponse(response_stream(group, base, plan, lambda r: (done(r), streamed(r)),
                                                       logprobs_of if asked else None, thinking), group.abort)
        response = whole(await final_outputs_unless_disconnected(request, group))
        done(response)
        return json_response(response)

    @router.get("/responses/{response_id}", response_model=None, openapi_extra=RETRIEVE,
                responses={**json_or_events(ResponseObject, "A stored or running response; with stream=true, a "
                                                            "background stream's events after starting_after"),
                           **errors(400, 401, 404)})
    async def get_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        stream, start = stream_query(dict(request.query_params))
        run = running.get(response_id)
        if not stream:
            return json_response(run.snapshot() if run is not None else stored(response_id).response)
        if run is not None and run.log is not None:
            return EventStreamResponse(run.log.read(start), lambda: None)
        events = stored(response_id).events if run is None else None
        if events is None:
            raise bad_request(f"Response '{response_id}' was not created with background and stream: it has no "
                              "events to stream.", param="stream")
        return EventStreamResponse(replay(events, start), lambda: None)

    @router.delete("/responses/{response_id}", response_model=None, openapi_extra=BY_ID,
                   responses={200: {"model": ResponseDeleted, "description": "The response is forgotten (and "
                                                                             "stopped, if it runs)"},
                              **errors(401, 404)})
    async def delete_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not running.cancel_now(response_id):
            stored(response_id)
        if store is not None:
            store.delete(response_id)
        return json_response(ResponseDeleted(id=response_id))

    @router.post("/responses/{response_id}/cancel", response_model=None, openapi_extra=BY_ID,
                 responses={200: {"model": ResponseObject, "description": "The background response, cancelled"},
                            **errors(400, 401, 404)})
    async def cancel_response(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        cancelled = await running.cancel(response_id)
        if cancelled is not None:
            return json_response(cancelled)
        response = stored(response_id).response  # it has ended: only a running one is cancelled
        if not response.background:
            raise bad_request("Cannot cancel a synchronous response.", param="response_id")
        raise bad_request(f"Cannot cancel a response that has already ended (status {response.status}).",
                          param="response_id")

    return router
