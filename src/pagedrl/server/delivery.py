"""How an answer leaves the server: a JSON body, or server-sent events whose generator is closed
however the response ends, and the wait for whole outputs that gives up when the client goes away.
Each route module delivers its answers through these, so every one of them frees the engine's
requests (and their KV blocks) the moment nobody is left to read them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedrl.engine.async_engine import RequestAborted, RequestFailed, RequestGroup
from pagedrl.server.errors import ApiError


class EventStreamResponse(StreamingResponse):
    """Server-sent events whose generator is closed however the response ends (finished, client gone,
    task cancelled), so its `finally` (which aborts the engine requests) runs at once, not at GC."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self.on_close()  # also when the generator never started (client gone before the first byte)


def json_response(model: Any, status: int = 200) -> Response:
    return Response(model.model_dump_json(), status_code=status, media_type="application/json")


async def wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def final_outputs_unless_disconnected(request: Request, group: RequestGroup) -> list:
    """The final outputs; if the client goes away first, the requests are aborted instead."""
    collect = asyncio.ensure_future(group.final_outputs())
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        if collect in done:
            return collect.result()
        raise ApiError(499, "the client closed the request", code="client_closed_request")
    except RequestAborted as e:
        raise ApiError(503, str(e), "server_error", code="request_aborted") from None
    except RequestFailed as e:  # not worth a retry, unlike an abort: vLLM answers 500 too
        raise ApiError(500, str(e), "server_error", code="generation_error") from None
    finally:
        gone.cancel()
        collect.cancel()
        group.abort()
