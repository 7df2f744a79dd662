"""vLLM's `--enable-server-load-tracking` and `GET /load`: how many generating requests the server holds
right now, for a load balancer that sends the next request to the least loaded server. A request counts
from when it reaches its route until its answer is sent whole (a stream's last byte), as vLLM's
`load_aware_call` counts it; without the flag nothing is counted and /load answers 0, as vLLM's does."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

# the routes that run the model (vLLM's `load_aware_call` routes that pagedrl serves)
GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


class ServerLoad:
    """The count of generating requests in flight."""

    def __init__(self) -> None:
        self.in_flight = 0


class LoadTracking:
    """ASGI middleware: counts a generating route's request until its response has been sent whole (or
    failed), so a stream counts for as long as it runs."""

    def __init__(self, app: Any, load: ServerLoad) -> None:
        self.app, self.load = app, load

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") != "POST" or not path.endswith(GENERATING):
            await self.app(scope, receive, send)
            return
        self.load.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.load.in_flight -= 1


def load_router(load: ServerLoad) -> APIRouter:
    router = APIRouter()

    @router.get("/load", response_model=None, responses={
        200: {"description": "Generating requests in flight (0 without --enable-server-load-tracking)",
              "content": {"application/json": {"schema": {"type": "object", "properties": {
                  "server_load": {"type": "integer"}}}}}}})
    async def server_load() -> JSONResponse:
        return JSONResponse({"server_load": load.in_flight})

    return router
