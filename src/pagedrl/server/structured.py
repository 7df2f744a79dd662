"""A request's structured-output fields, whichever way a client spells them, as one
`StructuredOutputsParams`: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` (`json`, `regex`, `choice`, `grammar`, `json_object`) and vLLM's older
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

At most one constraint per request; `structured_outputs.disable_any_whitespace` may accompany a
`response_format`. Every error names the field the client sent: a bad schema in `response_format`
is reported as `response_format.json_schema.schema`, not under the engine's name for it.

A `json_schema` is read as vLLM reads it by default: an object allows only the properties it lists
unless it says `additionalProperties` (`engine/json_schema.py` says why); `json_object` is any object.
"""

from __future__ import annotations

from typing import Any

from pagedrl.engine.structured_outputs import StructuredOutputsParams
from pagedrl.server.errors import bad_request
from pagedrl.server.protocol import SamplingRequest

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(req: SamplingRequest) -> tuple[StructuredOutputsParams | None, dict[str, str]]:
    """The request's constraint (None for free text) and the renames from the engine's field names
    (`structured_outputs.json`, ...) to the request's, for the errors the engine raises."""
    sources: list[tuple[str, str, Any]] = []  # (request field, engine field, value)
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        sources.append(("response_format", "json_object", True))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema",
                              param="response_format.json_schema")
        sources.append(("response_format.json_schema.schema", "json", fmt.json_schema.schema_))
    whitespace = False
    so = req.structured_outputs
    if so is not None:
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(so, name) is not None:
                raise bad_request(f"structured_outputs.{name} is not supported", param=f"structured_outputs.{name}")
        whitespace = so.disable_any_whitespace
        for field, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                             ("grammar", so.grammar), ("json_object", so.json_object)):
            if value is not None and value is not False:
                sources.append((f"structured_outputs.{field}", field, value))
    if req.guided_whitespace_pattern is not None:
        raise bad_request("guided_whitespace_pattern is not supported (structured_outputs.disable_any_whitespace "
                          "is)", param="guided_whitespace_pattern")
    for name, field in GUIDED.items():
        if getattr(req, name) is not None:
            sources.append((name, field, getattr(req, name)))
    if not sources:
        return None, {}
    if len(sources) > 1:
        names = ", ".join(s[0] for s in sources)
        raise bad_request(f"give one structured-output constraint, got {len(sources)}: {names}", param=sources[1][0])
    source, field, value = sources[0]
    renames = {f"structured_outputs.{field}": source}
    try:
        params = StructuredOutputsParams(**{field: value}, disable_any_whitespace=whitespace)
    except ValueError as e:
        message = str(e).replace(f"structured_outputs.{field}", source, 1)
        raise bad_request(message, param=source) from None
    return params, renames
