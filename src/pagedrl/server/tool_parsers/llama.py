"""`llama3_json` (also `llama4_json`): Llama 3.1/3.2/3.3's JSON tool calls, `{"name": ..., "parameters":
{...}}` (or `"arguments"`), optionally after `<|python_tag|>`, several separated by `;` (or whitespace).

As vLLM's whole-answer reading, a call is any JSON object with a name and arguments (or parameters)
wherever it starts; an object that is not one (no name, no arguments, or JSON that does not parse) stays
in the content as written. Unlike vLLM, which drops the text around the calls of a whole answer (and
streams an answer that does not open with a call as content only), the text around them is the
content, streamed or not. The `;` and whitespace between and after calls are not content.
"""

from __future__ import annotations

import re

from pagedrl.server.tool_parsers.reader import (
    WAIT,
    CallReader,
    Step,
    called,
    content_until,
    fail,
    hold,
    json_call,
)

PYTHON_TAG = "<|python_tag|>"
SEPARATORS = re.compile(r"[\s;]*")


class Llama3JsonReader(CallReader):
    keeps_special_tokens = True  # `<|python_tag|>` is a special token: decoded, it marks the calls

    def scan(self, text: str, final: bool) -> Step:
        if self.after_call and (gap := SEPARATORS.match(text).end()):
            return hold(gap)
        if not text.startswith(("{", PYTHON_TAG)):
            return content_until(text, final, "{", PYTHON_TAG)
        start = len(PYTHON_TAG) if text.startswith(PYTHON_TAG) else 0
        start += len(text[start:]) - len(text[start:].lstrip())
        if start == len(text):
            return WAIT
        if text[start] != "{":  # the tag before something else (a built-in tool's code): content
            return fail(start)
        body = text[start + 1:].lstrip()
        if not body:
            return WAIT
        if body[0] != '"':  # `{` in prose, not a JSON object with keys
            return fail(start + 1)
        end = self.closing(text, start)
        if end is None:
            return WAIT
        call = json_call(text[start:end], needs_arguments=True)
        return fail(end) if call is None else called(end, call)
