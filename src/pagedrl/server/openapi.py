"""What `/openapi.json` says about each route: its request body, its responses and their content types.

Handlers read their bodies themselves (`read_json`: the size limit, strict types, and the checks a
tokenizer needs come before pydantic), so FastAPI cannot infer the bodies from their signatures. The
routes declare them here instead, as references to the same pydantic models, and `install` adds those
models' schemas to the document's components; schema-driven clients and fuzzers then see every body,
every error (OpenAI's error object) and every content type (JSON, server-sent events, Prometheus text).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from pagedrl.server.protocol import LOGPROBS_MARK, TOKEN_ID_KEY_MARK, TOKEN_ID_MARK
from pagedrl.server.response_bodies import ErrorResponse

REF = "#/components/schemas/{model}"
ERROR_DESCRIPTIONS = {
    400: "Invalid request: the message names the field (`param`)",
    401: "Missing or incorrect API key",
    404: "Unknown model or route",
    413: "Request body over the server's limit",
    499: "The client closed the connection before the answer was ready",
    500: "The engine could not finish the request: its logits went NaN or infinite (`code` generation_error)",
    503: "Overloaded (retry after `Retry-After` seconds), shutting down, or the engine has stopped",
}


def request_body(model: type[BaseModel]) -> dict[str, Any]:
    """`openapi_extra` for a route whose JSON body is `model`."""
    return {"requestBody": {"required": True, "content": {
        "application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses` entries for the error statuses a route can answer, each an OpenAI error object."""
    return {s: {"model": ErrorResponse, "description": ERROR_DESCRIPTIONS[s]} for s in statuses}


def json_or_events(model: type[BaseModel], description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is `model` as JSON, or with `"stream": true` server-sent events of its chunks."""
    event = {"type": "object", "required": ["data"], "description": "One server-sent event",
             "properties": {"data": {"type": "string", "description": "A chunk as JSON; then `[DONE]`. An error "
                                     "ends the stream with an error object before `[DONE]`"}}}
    return {200: {"model": model, "description": description, "content": {"text/event-stream": {"schema": event}}}}


def decimal_below(limit: int) -> str:
    """A regular expression for the decimal numbers 0 .. limit - 1, without leading zeros: a JSON
    object key's schema can bound a token id only as a pattern."""
    top = str(limit - 1)
    if len(top) == 1:
        return f"^[0-{top}]$"
    # every shorter number, then those of top's length that leave top at some digit, then top itself
    shorter = "[0-9]" if len(top) == 2 else "0|[1-9][0-9]{0," + str(len(top) - 2) + "}"
    same = []
    for i, digit in enumerate(top):
        low, high = (1 if i == 0 else 0), int(digit) - 1
        if high >= low:
            rest = len(top) - i - 1
            same.append(top[:i] + (f"[{low}-{high}]" if high > low else str(low))
                        + (f"[0-9]{{{rest}}}" if rest else ""))
    same.append(top)
    return "^(" + "|".join([shorter, *same]) + ")$"


def bound_token_ids(node: Any, vocab_size: int | None, max_logprobs: int = -1) -> None:
    """Give every token-id schema (marked in protocol.py) the served vocabulary's bound, so that a
    schema-valid id is one the model has (as a number, or as an object's key), and every count of
    alternatives the engine's `max_logprobs` (-1: none)."""
    todo = [node]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            if item.pop(TOKEN_ID_MARK, False) and vocab_size is not None:
                item["maximum"] = vocab_size - 1
            if item.pop(TOKEN_ID_KEY_MARK, False) and vocab_size is not None:
                item["pattern"] = decimal_below(vocab_size)
            if item.pop(LOGPROBS_MARK, False) and max_logprobs != -1:
                item["maximum"] = max_logprobs
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)


def install(app: FastAPI, request_models: list[type[BaseModel]], vocab_size: int | None = None,
            rules: dict[str, dict[str, Any]] | None = None, max_logprobs: int = -1) -> None:
    """Generate the document once, with the request models among its component schemas (token ids
    bounded by `vocab_size` when given, counts of alternatives by `max_logprobs`). `rules` adds to a model's schema what holds on this server
    only (one that refuses tools without a tool_choice says so), in its `allOf`."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                              description=app.description)
            _, defs = models_json_schema([(m, "validation") for m in request_models], ref_template=REF)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, schema in defs.get("$defs", {}).items():
                schemas.setdefault(name, schema)
            bound_token_ids(schemas, vocab_size, max_logprobs)
            for name, rule in (rules or {}).items():
                schemas[name].setdefault("allOf", []).append(rule)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
