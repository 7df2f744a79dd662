"""`mistral`: Mistral's `[TOOL_CALLS]`, in the format of each generation of its tokenizers:

- before v11 (Mistral-7B-Instruct-v0.3, Mixtral-8x22B): `[TOOL_CALLS] [{"name": ..., "arguments":
  {...}}, ...]`, one JSON list of calls;
- v11 (Mistral-Small-3.1, Ministral, Devstral): `[TOOL_CALLS]name{...}`, once per call;
- v13 (Mistral-Small-3.2, Magistral): `[TOOL_CALLS]name[ARGS]{...}` (a `[CALL_ID]id` before `[ARGS]` is
  read past).

Text before the first `[TOOL_CALLS]` is the content, as in vLLM. A `[TOOL_CALLS]` whose calls do not
parse stays in the content as written (vLLM keeps a v11 call whose arguments are not JSON as a call with
those arguments; here the arguments of a call are always a JSON object). Call ids are 9 letters and
digits, as Mistral's chat templates and mistral-common require (vLLM's rule).
"""

from __future__ import annotations

import re
import secrets
import string

from pagedrl.server.tool_parsers.reader import (
    WAIT,
    CallReader,
    Step,
    call_from_object,
    called,
    content_until,
    fail,
    loads,
    object_text,
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
ALPHANUMERIC = string.ascii_letters + string.digits
# after the marker: a v11/v13 call's name, then its optional call id and [ARGS], up to where `{` must be
NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)(?:\[CALL_ID\][A-Za-z0-9]*)?(?:\[ARGS\])?\s*")


def mistral_call_id() -> str:
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))


def listed_calls(text: str) -> tuple[tuple[str, str], ...] | None:
    """The calls of a pre-v11 JSON list of `{"name", "arguments"}`; None if it is not one."""
    items = loads(text)
    if not isinstance(items, list) or not items:
        return None
    calls = tuple(call_from_object(item, needs_arguments=True) for item in items)
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


class MistralReader(CallReader):
    keeps_special_tokens = True  # `[TOOL_CALLS]` and `[ARGS]` are special tokens (vLLM's mistral parser)

    def new_id(self) -> str:
        return mistral_call_id()

    def scan(self, text: str, final: bool) -> Step:
        if not text.startswith(TOOL_CALLS):
            return content_until(text, final, TOOL_CALLS)
        rest = text[len(TOOL_CALLS):]
        start = len(TOOL_CALLS) + len(rest) - len(rest.lstrip())
        if start == len(text):
            return WAIT
        if text[start] == "[":  # before v11: one JSON list
            end = self.closing(text, start)
            if end is None:
                return WAIT
            calls = listed_calls(text[start:end])
            return fail(end) if calls is None else called(end, *calls)
        named = NAMED.match(text, len(TOOL_CALLS))
        if named is None:
            return fail(len(TOOL_CALLS))
        start = named.end()
        if start == len(text) or (text[start] == "[" and text.find("]", start) < 0
                                  and (ARGS.startswith(text[start:]) or CALL_ID.startswith(text[start:]))):
            return WAIT  # the name, the id or the [ARGS] marker may go on
        if text[start] != "{":
            return fail(start)
        end = self.closing(text, start)
        if end is None:
            return WAIT
        arguments = object_text(text[start:end])
        return fail(end) if arguments is None else called(end, (named.group(1).strip(), arguments))
