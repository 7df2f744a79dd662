"""Reading gpt-oss's answers, written in OpenAI's "harmony" format, into reasoning, content and tool calls:
what vLLM's `--reasoning-parser openai_gptoss` and `--tool-call-parser openai` give.

An answer is a sequence of messages (openai/harmony's docs/format.md), each `{header}<|message|>{body}`
and an end: `<|end|>`, `<|return|>` (the answer is done) or `<|call|>` (a tool call is made). A header
names the channel (`<|channel|>analysis`, `final` or `commentary`), may address the message to a
recipient (`to=functions.NAME`, written before or after the channel) and may give its content type
(`<|constrain|>json`, or a bare `json`); the next message opens with `<|start|>assistant`. The generation
prompt ends in `<|start|>assistant`, so an answer opens with its first message's header:

    <|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary
    to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

The markers are special tokens, which a chat answer's text leaves out (`skip_special_tokens`), so the
server decodes the answers it reads this way with them kept (`server/app.py`) and reads them from the
text, as vLLM's parsers (which read the token ids through openai_harmony's StreamableParser) find
them. The messages are sorted as vLLM sorts them:
- the analysis channel is the reasoning (with `--reasoning-parser openai_gptoss`; without it, content,
  as every model's reasoning is content without a parser); so is a message to a built-in tool (a
  recipient other than `functions.*`: `python`, `browser.*`), which vLLM's Responses API shows as reasoning;
- a message to `functions.NAME` (commentary, as gpt-oss writes them) is a call of NAME (with
  `--tool-call-parser openai`), its body the arguments: JSON text parsed and written again (vLLM's
  `json.dumps(json.loads(body))`) when the content type is JSON or none is given, as written otherwise;
  without the tool parser the body is content;
- the final channel, and commentary without a recipient (the preamble gpt-oss writes before its calls,
  which vLLM streams to the user as content), is the content;
- several messages of one field are joined by a newline (vLLM's join of the analysis messages), each
  message counted once its header is read; a header the answer cut off says nothing and is dropped,
  and a body it cut off counts as written.

Streaming: `HarmonyReader` gives each delta's pieces as soon as they are known, holding back only text
that may still turn into a marker and the header being read, so no part of a marker or a header
reaches a field, and the deltas join to the whole answer's split (the whole answer is the reader run
once). A call is given out whole when its message ends (or the answer does), as the `hermes` parser's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL = "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
ENDS = (END, RETURN, CALL)  # what ends a message; a START or CHANNEL in a body opens the next one's header
RECIPIENT = re.compile(r"to=([^\s<]+)")
FUNCTIONS = "functions."


@dataclass(frozen=True)
class Header:
    """A message's header: its channel, recipient and content type (None where it names none)."""

    channel: str | None = None
    recipient: str | None = None
    content_type: str | None = None
    role: str = "assistant"  # the answer's first header names none: the prompt did


def read_header(text: str) -> Header:
    """The header of `text`, the markup between a message's start and its `<|message|>`: e.g.
    `assistant to=functions.f<|channel|>commentary json` or `<|channel|>commentary to=functions.f
    <|constrain|>json`."""
    recipient = RECIPIENT.search(text)
    head = text.partition(CHANNEL)[0].split()
    role = head[0] if head and not head[0].startswith("to=") else "assistant"
    _, has_channel, rest = text.rpartition(CHANNEL)  # a channel named twice: the last one
    words = [w for w in rest.replace(CONSTRAIN, " ").split() if not w.startswith("to=")]
    channel = words.pop(0) if has_channel and words else None
    return Header(channel, recipient.group(1) if recipient else None, " ".join(words) or None, role)


@dataclass
class Piece:
    """Text of one message's body as it arrives: `opens` on the first piece of a message (its text may be
    empty), `closes` on the last."""

    header: Header
    text: str = ""
    opens: bool = False
    closes: bool = False


def _held(text: str) -> int:
    """The length of the longest end of `text` that may begin one of the markers."""
    for n in range(min(len(text), max(len(m) for m in MARKERS) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in MARKERS):
            return n
    return 0


class HarmonyReader:
    """`feed(delta)` -> the pieces of message bodies it completes; `finish()` -> the rest at the answer's end."""

    def __init__(self) -> None:
        self.pending = ""
        self.header: Header | None = None  # None while a header is read

    def feed(self, delta: str) -> list[Piece]:
        self.pending += delta
        pieces: list[Piece] = []
        while True:
            if self.header is None:
                at = self.pending.find(MESSAGE)
                if at < 0:
                    return pieces
                head = self.pending[:at]
                for marker in (START, *ENDS):  # what an earlier start or end left is not this header's
                    head = head[head.rfind(marker) + len(marker):] if marker in head else head
                self.header, self.pending = read_header(head), self.pending[at + len(MESSAGE):]
                pieces.append(Piece(self.header, opens=True))
                continue
            found = [(at, m) for m in MARKERS if (at := self.pending.find(m)) >= 0]
            if found:
                at, marker = min(found)
                if marker in (MESSAGE, CONSTRAIN):  # out of place in a body: a marker all the same, not text
                    pieces.append(Piece(self.header, self.pending[:at]))
                    self.pending = self.pending[at + len(marker):]
                    continue
                pieces.append(Piece(self.header, self.pending[:at], closes=True))
                self.pending = self.pending[at + len(marker):] if marker in ENDS else self.pending[at:]
                self.header = None
                continue
            cut = len(self.pending) - _held(self.pending)
            if cut:
                pieces.append(Piece(self.header, self.pending[:cut]))
                self.pending = self.pending[cut:]
            return pieces

    def finish(self) -> list[Piece]:
        """A body the answer cut off ends as written (a partial marker is text); a header is dropped."""
        rest, self.pending = self.pending, ""
        if self.header is None:
            return []
        header, self.header = self.header, None
        return [Piece(header, rest, closes=True)]


def call_arguments(body: str, content_type: str | None) -> str:
    """A call's arguments as vLLM's openai parser gives them: JSON written again, other text as it is."""
    if content_type and "json" not in content_type.lower():
        return body
    try:
        return json.dumps(json.loads(body))
    except json.JSONDecodeError:
        return body


class HarmonyAnswer:
    """One choice's answer as it arrives, sorted into (reasoning, content) deltas, ReasoningReader's
    interface, and tool calls, (name, arguments), which `take_calls` hands to the choice's tool reader
    (`tool_parsers.OpenAIReader`).

    `reasoning`: analysis is the reasoning (else content); `calls`: messages to `functions.*` are calls
    (else their bodies are content)."""

    def __init__(self, reasoning: bool = True, calls: bool = True) -> None:
        self.reader = HarmonyReader()
        self.reasoning, self.calls = reasoning, calls
        self.used: set[str] = set()  # the fields a message has gone to: the next one starts with a newline
        self.body = ""  # the call being read
        self.found: list[tuple[str, str]] = []  # (name, arguments) of the calls not yet taken

    def field(self, header: Header) -> str | None:
        """Where a message goes: reasoning, content, a call, or nowhere (a message not the assistant's,
        such as the user's or a tool's, which an answer repeating a conversation may write)."""
        recipient = header.recipient
        if header.role != "assistant":
            return None
        if recipient is not None and recipient.startswith(FUNCTIONS):
            return "call" if self.calls else "content"
        if recipient is not None or header.channel == "analysis":
            return "reasoning" if self.reasoning else "content"
        return "content"

    def _sort(self, pieces: list[Piece]) -> tuple[str, str]:
        out = {"reasoning": "", "content": ""}
        for piece in pieces:
            field = self.field(piece.header)
            if field is None:
                continue
            if field == "call":
                self.body += piece.text
                if piece.closes:
                    name = piece.header.recipient[len(FUNCTIONS):]  # type: ignore[index]
                    self.found.append((name, call_arguments(self.body, piece.header.content_type)))
                    self.body = ""
                continue
            if piece.opens and field in self.used:
                out[field] += "\n"
            self.used.add(field)
            out[field] += piece.text
        return out["reasoning"], out["content"]

    def feed(self, delta: str) -> tuple[str, str]:
        return self._sort(self.reader.feed(delta))

    def finish(self) -> tuple[str, str]:
        return self._sort(self.reader.finish())

    def take_calls(self) -> list[tuple[str, str]]:
        calls, self.found = self.found, []
        return calls


def split_harmony(text: str, reasoning: bool = True, calls: bool = True
                  ) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(reasoning, content, calls) of a whole answer: the streaming reader run once over it, so that a
    streamed answer and a whole one agree. A field no message went to is None."""
    answer = HarmonyAnswer(reasoning, calls)
    r1, c1 = answer.feed(text)
    r2, c2 = answer.finish()
    return (r1 + r2 if "reasoning" in answer.used else None, c1 + c2 if "content" in answer.used else None,
            answer.take_calls())
