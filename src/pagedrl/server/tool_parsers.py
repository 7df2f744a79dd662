"""Reading the tool calls out of what a model wrote: a registry of parsers named as vLLM's
`--tool-call-parser`, and the readers of the two constrained encodings (`required`, named).

`hermes` reads `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the format of the
Hermes, Qwen2.5 and SmolLM-style templates (and of the fallback `server/tools.py` writes for a
template without tools). Text outside the blocks is the message's content; a block whose JSON does
not parse stays in the content as written rather than becoming an invented call.

`openai` reads gpt-oss's calls, harmony messages addressed `to=functions.NAME` (`server/harmony.py`).

Streaming: `HermesReader` takes the text deltas and gives back content deltas as soon as
they cannot be the start of a `<tool_call>` tag, and each call whole once its block closes (or the
answer ends); a streamed answer therefore reassembles to the non-streamed one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from pagedrl.server.harmony import HarmonyAnswer

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _call(obj: Any) -> ParsedCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(parser: str, text: str) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a whole answer: the parser's streaming reader run over it at once, so
    that a streamed answer and a whole one always agree."""
    reader = TOOL_PARSERS[parser]()
    content, calls = reader.feed(text)
    rest, more = reader.finish()
    return (content + rest) or None, calls + more


def parse_required(text: str) -> list[ParsedCall] | None:
    """The calls of a `tool_choice: "required"` answer (a JSON array of `{"name", "parameters"}`)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = [_call(item) for item in items] if isinstance(items, list) and items else [None]
    return None if any(c is None for c in calls) else calls  # type: ignore[return-value]


def _block_call(block: str) -> ParsedCall | None:
    try:
        return _call(json.loads(block))
    except json.JSONDecodeError:
        return None


class HermesReader:
    """`feed(delta)` -> (content to send now, calls completed now); `finish()` -> the same at the end.

    Content is the text outside well-formed `<tool_call>` blocks; a block that does not parse stays
    in it, tags included. Whitespace is held back until text follows it, so the blank lines a model
    writes around its calls are not content; an answer without calls is given out unchanged."""

    def __init__(self) -> None:
        self.pending = ""  # text not yet given out: a possible tag start, or an open block
        self.in_call = False
        self.space = ""  # trailing whitespace held back
        self.after_call = False  # the last thing read was a call

    def _text(self, text: str) -> str:
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body):]
        if body:
            self.after_call = False
        return body

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self.pending += delta
        content, calls = "", []
        while self.pending:
            if self.in_call:
                end = self.pending.find(TOOL_CALL_END)
                if end < 0:
                    break
                block, self.pending = self.pending[:end], self.pending[end + len(TOOL_CALL_END):]
                self.in_call = False
                call = _block_call(block)
                if call is None:
                    content += self._text(TOOL_CALL_START + block + TOOL_CALL_END)
                else:
                    calls.append(call)
                    self.space, self.after_call = "", True  # whitespace between text and a call is not content
                continue
            start = self.pending.find(TOOL_CALL_START)
            if start >= 0:
                content += self._text(self.pending[:start])
                self.pending, self.in_call = self.pending[start + len(TOOL_CALL_START):], True
                continue
            keep = _partial_tag(self.pending)  # what may be the start of "<tool_call>" waits
            cut = len(self.pending) - keep
            content += self._text(self.pending[:cut])
            self.pending = self.pending[cut:]
            break
        return content, calls

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end of the answer: an open block is read as it stands, a held-back prefix is content."""
        content, calls = "", []
        if self.in_call:
            block, self.pending, self.in_call = self.pending, "", False
            call = _block_call(block)
            if call is None:
                content = self._text(TOOL_CALL_START + block)
            else:
                calls.append(call)
                self.space, self.after_call = "", True
        content += self._text(self.pending)
        if not self.after_call:
            content += self.space
        self.pending = self.space = ""
        return content, calls


def _partial_tag(text: str) -> int:
    """The length of the longest suffix of `text` that begins `<tool_call>`."""
    for n in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-n:]):
            return n
    return 0


class OpenAIReader:
    """gpt-oss's calls, HermesReader's interface. Alone it reads the answer's harmony messages (the
    analysis then content, as without a reasoning parser); after the choice's `openai_gptoss` reasoning
    reader (`answer`), which already sorted the text, it passes on the content that reader gave and
    takes the calls it found."""

    def __init__(self, answer: HarmonyAnswer | None = None) -> None:
        self.own = answer is None
        self.answer = HarmonyAnswer(reasoning=False) if answer is None else answer

    def _calls(self) -> list[ParsedCall]:
        return [ParsedCall(name, arguments) for name, arguments in self.answer.take_calls()]

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        return (self.answer.feed(delta)[1] if self.own else delta), self._calls()

    def finish(self) -> tuple[str, list[ParsedCall]]:
        return (self.answer.finish()[1] if self.own else ""), self._calls()


TOOL_PARSERS = {"hermes": HermesReader, "openai": OpenAIReader}  # --tool-call-parser NAME: its reader class


class ChoiceToolReader:
    """One choice's text, as it arrives, read according to its request's tool choice: content to send
    and the tool calls found (`ParsedCall`s, each given out once). A named function's call is given
    out at the start, its arguments then streamed as the model writes them; `required` calls come at
    the end, once the array is complete; `auto` calls as each `<tool_call>` block closes."""

    def __init__(self, mode: str, parser: str | None = None, name: str | None = None,
                 harmony: HarmonyAnswer | None = None) -> None:
        """`harmony`: the choice's `openai_gptoss` reader, which finds the `openai` parser's calls."""
        self.mode, self.name = mode, name
        self.reader: Any = None
        if mode == "auto" and parser is not None:
            self.reader = OpenAIReader(harmony) if parser == "openai" else TOOL_PARSERS[parser]()
        self.text = ""
        self.num_calls = 0

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ParsedCall], str]:
        """(content, new calls, arguments text to add to the named call) for this delta."""
        self.text += delta
        if self.reader is not None:
            content, calls = self.reader.feed(delta)
            if finished:
                rest, more = self.reader.finish()
                content, calls = content + rest, calls + more
            self.num_calls += len(calls)
            return content, calls, ""
        if self.mode == "named":
            calls = [ParsedCall(self.name, "")] if self.num_calls == 0 else []
            self.num_calls = 1
            return "", calls, delta
        if self.mode == "required":
            if not finished:
                return "", [], ""
            calls = parse_required(self.text)
            if calls is None:  # cut short: what was written is the content
                return self.text, [], ""
            self.num_calls = len(calls)
            return "", calls, ""
        return delta, [], ""

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls else reason
