"""Reading the tool calls out of what a model wrote: a registry of parsers named as vLLM's
`--tool-call-parser`, one module each (`reader.py` holds what they share), and the readers of the two
constrained encodings (`required`, named).

Every parser is a streaming reader (`reader.CallReader`): it takes the text deltas and gives back
content deltas as soon as they cannot be part of a call, and each call whole once it is complete (or
the answer ends); a whole answer is the same reader run over it at once, so a streamed answer always
reassembles to the non-streamed one.
"""

from __future__ import annotations

import json

from pagedrl.server.harmony import HarmonyAnswer
from pagedrl.server.tool_parsers.deepseek import DeepSeekV3Reader, DeepSeekV31Reader, KimiK2Reader
from pagedrl.server.tool_parsers.hermes import HermesReader
from pagedrl.server.tool_parsers.llama import Llama3JsonReader
from pagedrl.server.tool_parsers.mistral import MistralReader
from pagedrl.server.tool_parsers.openai import OpenAIReader
from pagedrl.server.tool_parsers.pythonic import Llama4PythonicReader, PythonicReader
from pagedrl.server.tool_parsers.reader import CallReader, ParsedCall, call_from_object

__all__ = ["TOOL_PARSERS", "CallReader", "ChoiceToolReader", "DeepSeekV3Reader", "DeepSeekV31Reader", "HermesReader",
           "KimiK2Reader", "Llama3JsonReader", "Llama4PythonicReader", "MistralReader", "OpenAIReader", "ParsedCall",
           "PythonicReader",
           "parse_required", "parse_tool_calls"]


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
    calls = [call_from_object(item) for item in items] if isinstance(items, list) and items else [None]
    if any(c is None for c in calls):
        return None
    return [ParsedCall(name, arguments) for name, arguments in calls]  # type: ignore[misc]


TOOL_PARSERS: dict[str, type[CallReader] | type[OpenAIReader]] = {  # --tool-call-parser NAME: its reader class (vLLM's names)
    "hermes": HermesReader,
    "llama3_json": Llama3JsonReader,
    "llama4_json": Llama3JsonReader,
    "pythonic": PythonicReader,
    "llama4_pythonic": Llama4PythonicReader,
    "mistral": MistralReader,
    "deepseek_v3": DeepSeekV3Reader,
    "deepseek_v31": DeepSeekV31Reader,
    "kimi_k2": KimiK2Reader,
    "openai": OpenAIReader,
}


class ChoiceToolReader:
    """One choice's text, as it arrives, read according to its request's tool choice: content to send
    and the tool calls found (`ParsedCall`s, each given out once). A named function's call is given
    out at the start, its arguments then streamed as the model writes them; `required` calls come at
    the end, once the array is complete; `auto` calls as the parser completes each."""

    def __init__(self, mode: str, parser: str | None = None, name: str | None = None,
                 harmony: HarmonyAnswer | None = None) -> None:
        """`harmony`: the choice's `openai_gptoss` reader, which finds the `openai` parser's calls."""
        self.mode, self.name = mode, name
        self.reader: CallReader | OpenAIReader | None = None
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
