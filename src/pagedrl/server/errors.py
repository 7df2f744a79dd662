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

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedrl.server.response_bodies import ErrorInfo, ErrorResponse

T = TypeVar("T", bound=BaseModel)

# An oversized body is still read (and thrown away) up to this much more, so that the client, which
# is usually still sending, gets the 413 instead of a reset connection.
DRAIN_LIMIT_BYTES = 64 << 20
# No OpenAI body nests deeper than a few levels (a JSON schema in response_format a few more).
MAX_JSON_DEPTH = 64


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


_PARAM_IN_MESSAGE = re.compile(r"^SamplingParams\.(\w+)|^(max_tokens|prompt|stop|n|structured_outputs\.\w+|logit_bias|allowed_token_ids|logprob_token_ids|bad_words|prompt_logprobs|logprobs|truncate_prompt_tokens"
                               r"|pooling_task|pooling_params|lora_request|dimensions|normalize|use_activation|activation|softmax)\b")


def from_value_error(e: ValueError, renames: dict[str, str] | None = None) -> ApiError:
    """A ValueError from validation (sampling parameters, prompt, context length) as a 400."""
    message = str(e)
    if "max_model_len" in message or "KV cache" in message:
        return bad_request(message, param="prompt", code="context_length_exceeded")
    match = _PARAM_IN_MESSAGE.match(message)
    param = (match.group(1) or match.group(2)) if match else None
    if param and renames and param in renames:
        # the message names the field as the client sent it (`response_format.json_schema.schema`)
        message = message.replace(param, renames[param], 1)
        param = renames[param]
    return bad_request(message, param=param)


_UNION_TAGS = {"str", "int", "float", "bool", "none", "dict", "list"}
# The tags of discriminated unions of list items (a Responses input item's type): pydantic puts the tag
# after the item's index, where the client sent no such key.
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _most_telling(errors: list) -> dict:
    """Of the problems with the first field that failed, the one that tells most. A union's field
    (`prompt`: text, texts, token ids, lists of token ids) fails once per branch, and the first branch
    is usually not the shape the client meant: prefer a value out of range over a wrong type (the
    branch whose shape matched), then the branch that got deepest and furthest into a list."""
    field = errors[0]["loc"][:1]

    def reach(err: dict) -> tuple:
        return (not err["type"].endswith("_type"), len(err["loc"]), [x for x in err["loc"] if isinstance(x, int)])

    return max((err for err in errors if err["loc"][:1] == field), key=reach)


def from_validation_error(e: ValidationError) -> ApiError:
    """The first field pydantic found wrong, with its location as `param` (e.g. `messages.0.content`)."""
    first = _most_telling(e.errors())
    raw = first["loc"]
    loc = [str(x) for i, x in enumerate(raw)
           if not (isinstance(x, str) and ("[" in x or x in _UNION_TAGS or x.startswith("constrained-")
                                           or (x in ITEM_TYPES and i > 0 and isinstance(raw[i - 1], int))))]
    param = ".".join(loc) or None
    got = repr(first.get("input"))
    got = got if len(got) <= 60 else got[:57] + "..."
    where = f"'{param}'" if param else "request body"
    if first["type"] == "extra_forbidden":
        return bad_request(f"unknown field '{param}'", param=param)
    return bad_request(f"invalid {where}: {first['msg']} (got {got})", param=param)


def check_json_values(obj: dict) -> None:
    """Refuse what JSON can carry but text cannot: nesting beyond `MAX_JSON_DEPTH` and strings with a
    lone UTF-16 surrogate (`"\\ud800"`), which no tokenizer can encode. One pass without recursion,
    so any depth is safe to walk; the error names the field."""
    todo: list[tuple[object, tuple[str, ...]]] = [(obj, ())]
    while todo:
        value, path = todo.pop()
        if len(path) > MAX_JSON_DEPTH:
            raise bad_request(f"the JSON in the request body is nested more than {MAX_JSON_DEPTH} levels deep",
                              param=".".join(path[:3]) + "...", code="invalid_json")
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                param = ".".join(path) or None
                raise bad_request(f"invalid '{param}': the string holds a lone UTF-16 surrogate, which is not "
                                  "valid Unicode text", param=param) from None
        elif isinstance(value, dict):
            for k, v in value.items():
                todo.append((k, path))
                todo.append((v, (*path, str(k))))
        elif isinstance(value, list):  # numbers need no check: a long list of token ids costs one pass
            todo.extend((v, (*path, str(i))) for i, v in enumerate(value) if isinstance(v, (str, list, dict)))


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
    except RecursionError:
        raise bad_request(f"the JSON in the request body is nested more than {MAX_JSON_DEPTH} levels deep",
                          code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request(f"the request body must be a JSON object, got {type(obj).__name__}")
    check_json_values(obj)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise from_validation_error(e) from None


def install_error_handlers(app: FastAPI) -> None:
    """Every error of `app` answered in OpenAI's error shape: an `ApiError` as it says, Starlette's own
    (404 route, 405 method, with their headers) by status, anything else a 500 naming it; one set for
    the generating server and the pooling one."""

    @app.exception_handler(ApiError)
    async def on_api_error(request: Request, e: ApiError) -> Response:
        return e.response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return ApiError(e.status_code, str(e.detail), kind, headers=getattr(e, "headers", None)).response()

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, e: Exception) -> Response:
        return ApiError(500, f"internal error: {e!r}", "server_error").response()
