"""Request ids as vLLM's server handles them, so that a gateway's trace id reaches the response.

A completion's id is `cmpl-<id>` and a chat completion's `chatcmpl-<id>`, where `<id>` is the request's
`X-Request-Id` header if it has one, else the body's `request_id` (vLLM's field), else a fresh one.
With `--enable-request-id-headers` every response also carries an `X-Request-Id` header: the request's
own header echoed, else a fresh id (vLLM's `XRequestIdMiddleware`, which does not read the body).
"""

from __future__ import annotations

import uuid
from typing import Any

from starlette.datastructures import Headers, MutableHeaders
from starlette.requests import Request

HEADER = "X-Request-Id"


def new_id() -> str:
    """A fresh id: 32 hex digits, vLLM's `random_uuid()`."""
    return uuid.uuid4().hex


def base_request_id(request: Request, body_id: str | None) -> str:
    """The id a response is named by (before its `cmpl-` / `chatcmpl-`): the header wins over the body,
    as in vLLM, since a gateway sets the header and a client the body."""
    given = request.headers.get(HEADER)
    if given is not None:
        return given
    return body_id if body_id is not None else new_id()


class RequestIdHeader:
    """ASGI middleware: every HTTP response gets `X-Request-Id`, the request's own or a fresh one."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get(HEADER)
        request_id = given if given is not None else new_id()

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
