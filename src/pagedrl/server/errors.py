"""Errors in OpenAI's JSON shape, `{"error": {"message", "type", "param", "code"}}`, with the right status.

Every failure a client can cause ends here as a 4xx with a message that names what was wrong;
nothing a client sends reaches the engine unvalidated, so no input can stop the process or wedge the
engine. Reading the body is here too, because its size limit (413) and its parsing (400) are the
first two errors a request can hit.
"""

from __future__ import annotations

import json
import re
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from pagedrl.server.protocol import ErrorInfo, ErrorResponse

T = TypeVar("T", bound=BaseModel)

# An oversized body is still read (and thrown away) up to this much more, so that the client, which
# is usually still sending, gets the 413 instead of a reset connection.
DRAIN_LIMIT_BYTES = 64 << 20


class ApiError(Exception):
    """An error answered to the client as-is."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


_PARAM_IN_MESSAGE = re.compile(r"^SamplingParams\.(\w+)|^(max_tokens|prompt|stop|n)\b")


def from_value_error(e: ValueError, renames: dict[str, str] | None = None) -> ApiError:
    """A ValueError from validation (sampling parameters, prompt, context length) as a 400."""
    message = str(e)
    if "max_model_len" in message or "KV cache" in message:
        return bad_request(message, param="prompt", code="context_length_exceeded")
    match = _PARAM_IN_MESSAGE.match(message)
    param = (match.group(1) or match.group(2)) if match else None
    if param and renames:
        param = renames.get(param, param)
    return bad_request(message, param=param)


_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}


def from_validation_error(e: ValidationError) -> ApiError:
    """The first problem pydantic found, with its location as `param` (e.g. `messages.0.content`)."""
    first = e.errors()[0]
    loc = [str(x) for x in first["loc"] if not (isinstance(x, str) and ("[" in x or x in _UNION_TAGS))]
    param = ".".join(loc) or None
    got = repr(first.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    where = f"'{param}'" if param else "request body"
    return bad_request(f"invalid {where}: {first['msg']} (got {got})", param=param)


async def read_json(request: Request, model: type[T], max_bytes: int) -> T:
    """The request body as `model`: 413 over `max_bytes`, 400 when not JSON or of the wrong shape."""
    declared = request.headers.get("content-length")
    size, chunks, too_big = 0, [], False
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        too_big = True
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            too_big = True
            if size > max_bytes + DRAIN_LIMIT_BYTES:
                break
        if not too_big:
            chunks.append(chunk)
    if too_big:
        raise ApiError(413, f"request body is {declared or 'over ' + str(size)} bytes; the limit is {max_bytes} "
                       "bytes", code="request_too_large")
    try:
        obj = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON in the request body: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None
