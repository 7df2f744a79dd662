"""What every tool parser shares: the call it reads out, and the streaming reader each one is.

A parser is a `CallReader` with one method of its own, `scan(text, final)`: at the start of the text
not yet given out (never inside a call), it says what the first piece of it is — content, a call (or
several), a would-be call that does not parse (content, as written), text held back like whitespace
(a separator between calls), or that it cannot tell until more text comes. The reader runs `scan` over
the deltas as they arrive and over a whole answer at once alike, and `scan` decides from the text it
has been shown, never from what may follow; so a streamed answer gives the same content and calls as
the whole one, whatever the deltas, and no piece of a call is ever given out as content.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, ClassVar


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=openai_call_id)


NOT_JSON = object()


def loads(text: str) -> Any:
    """`json.loads`, or NOT_JSON for text that is not JSON (or nests too deep to read)."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return NOT_JSON


def call_from_object(obj: Any, needs_arguments: bool = False) -> tuple[str, str] | None:
    """(name, arguments as JSON text) of a `{"name": ..., "arguments" (or "parameters"): {...}}`
    object; None when it is not one. Arguments written as JSON text are read as the object they hold.
    Without `needs_arguments` an object with no arguments is a call without any."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if needs_arguments and "arguments" not in obj and "parameters" not in obj:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        arguments = loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def json_call(text: str, needs_arguments: bool = False) -> tuple[str, str] | None:
    """`call_from_object` of JSON text; None when the text is not JSON."""
    return call_from_object(loads(text), needs_arguments)


def object_text(text: str) -> str | None:
    """JSON text of an object, written again as `json.dumps` writes it; None if it is not one."""
    value = loads(text)
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


@dataclass(frozen=True)
class Step:
    """What `scan` found at the start of the text: `kind` is text, call, fail (a would-be call that stays
    content as written), hold (kept back like whitespace: dropped between and after calls, content
    before text), skip (dropped) or wait (undecided until more text comes); `size` characters of it."""

    kind: str
    size: int = 0
    calls: tuple[tuple[str, ...], ...] = ()  # (name, arguments as JSON text), and the call's id where it says


WAIT = Step("wait")


def text(size: int) -> Step:
    return Step("text", size)


def fail(size: int) -> Step:
    return Step("fail", size)


def hold(size: int) -> Step:
    return Step("hold", size)


def skip(size: int) -> Step:
    return Step("skip", size)


def called(size: int, *calls: tuple[str, ...]) -> Step:
    return Step("call", size, calls)


def partial_marker(text: str, marker: str) -> int:
    """The length of the longest suffix of `text` that begins `marker`."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def content_until(text: str, final: bool, *markers: str) -> Step:
    """Text before the next of `markers` is content, as is all of it but a suffix that may begin one (a
    marker the text opens with is the caller's to read, or here plain text)."""
    found = [i for i in (text.find(m, 1) for m in markers) if i >= 0]
    if found:
        return Step("text", min(found))
    keep = 0 if final else max(partial_marker(text, m) for m in markers)
    return Step("text", len(text) - keep) if len(text) > keep else WAIT


class Brackets:
    """Where the bracket at the start of a growing text closes: JSON's strings (double quotes) or
    Python's (single, double and triple quotes), escapes included. Resumes where it stopped, so
    holding a long call back while it is written costs each character once."""

    def __init__(self, python: bool = False) -> None:
        self.python = python
        self.at = 0
        self.open: list[str] = []  # the brackets not yet closed
        self.quote = ""  # the open string's quote, "" outside strings

    def close(self, text: str) -> int | None:
        """The index just past the closing bracket (or past a bracket that closes the wrong one, which
        leaves text that does not parse); None while still open."""
        pairs = {")": "(", "]": "[", "}": "{"}
        while self.at < len(text):
            c = text[self.at]
            if self.quote:
                if c == "\\":
                    if self.at + 1 >= len(text):
                        return None
                    self.at += 2
                    continue
                if text.startswith(self.quote, self.at):
                    self.at += len(self.quote)
                    self.quote = ""
                    continue
                if len(self.quote) == 3 and len(text) - self.at < 3 and self.quote.startswith(text[self.at:]):
                    return None  # a triple quote's first one or two characters: the next text tells
                self.at += 1
                continue
            if c == '"' or (self.python and c == "'"):
                triple = c * 3
                if self.python and len(text) - self.at < 3 and triple.startswith(text[self.at:]):
                    return None  # "" or """: which, the next characters tell
                self.quote = triple if self.python and text.startswith(triple, self.at) else c
                self.at += len(self.quote)
                continue
            self.at += 1
            if c in "([{":
                self.open.append(c)
            elif c in pairs:
                if not self.open or self.open.pop() != pairs[c]:
                    return self.at  # closes the wrong bracket: the text up to here does not parse
                if not self.open:
                    return self.at
        return None


class CallReader:
    """`feed(delta)` -> (content to send now, calls completed now); `finish()` -> the same at the end.

    Whitespace is held back until text follows it, so the blank lines a model writes around its calls
    are not content; an answer without calls is given out unchanged. `keeps_special_tokens`: the
    parser's markers are special tokens in the models that write them, so a request it reads is
    decoded with them (vLLM's parsers set `skip_special_tokens=False` for the same reason)."""

    keeps_special_tokens: ClassVar[bool] = False

    def __init__(self) -> None:
        self.pending = ""  # text not yet given out: a possible marker start, or a call being written
        self.space = ""  # trailing whitespace (and separators) held back
        self.after_call = False  # the last thing read was a call
        self.brackets: Brackets | None = None  # the open call's bracket scanner, while it is written
        self.searched = 0  # how far the open call's text was searched for its end marker

    def scan(self, text: str, final: bool) -> Step:
        raise NotImplementedError

    def new_id(self) -> str:
        return openai_call_id()

    def closing(self, text: str, start: int, python: bool = False) -> int | None:
        """`Brackets.close` of the bracket at `text[start]`, resumed across feeds."""
        if self.brackets is None:
            self.brackets = Brackets(python)
        end = self.brackets.close(text[start:])
        return None if end is None else start + end

    def find_end(self, text: str, marker: str, start: int) -> int:
        """`text.find(marker, start)`, resumed across feeds where the last search stopped."""
        at = text.find(marker, max(start, self.searched - len(marker) + 1))
        self.searched = len(text) if at < 0 else 0
        return at

    def _text(self, text: str) -> str:
        if not text.strip():  # whitespace alone waits, behind what is held back already
            self.space += text
            return ""
        text = self.space + text
        body = text.rstrip()
        self.space = text[len(body):]
        if body:
            self.after_call = False
        return body

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        return self._read(delta, final=False)

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the end of the answer: an open call is read as it stands, a held-back prefix is content."""
        content, calls = self._read("", final=True)
        if not self.after_call:
            content += self.space
        self.space = ""
        return content, calls

    def _read(self, delta: str, final: bool) -> tuple[str, list[ParsedCall]]:
        self.pending += delta
        content, calls = "", []
        while self.pending:
            step = self.scan(self.pending, final)
            if step.kind == "wait":
                if not final:
                    break
                step = fail(len(self.pending))  # cut short: what was written is content
            assert step.size > 0, f"{type(self).__name__}.scan made no progress"
            piece, self.pending = self.pending[:step.size], self.pending[step.size:]
            self.brackets, self.searched = None, 0
            if step.kind in ("text", "fail"):
                content += self._text(piece)
            elif step.kind == "call":
                calls += [ParsedCall(name, arguments, given[0] if given else self.new_id())
                          for name, arguments, *given in step.calls]
                self.space, self.after_call = "", True  # whitespace between text and a call is not content
            elif step.kind == "hold":
                self.space += piece
        return content, calls
