"""`openai`: gpt-oss's calls, harmony messages addressed `to=functions.NAME` (`server/harmony.py` reads
the messages). Not a `CallReader`: harmony is read message by message, not by markers in a text, and
beside the `openai_gptoss` reasoning parser the two share one reading of the answer."""

from __future__ import annotations

from pagedrl.server.harmony import HarmonyAnswer
from pagedrl.server.tool_parsers.reader import ParsedCall


class OpenAIReader:
    """gpt-oss's calls, a CallReader's interface. Alone it reads the answer's harmony messages (the
    analysis then content, as without a reasoning parser); after the choice's `openai_gptoss` reasoning
    reader (`answer`), which already sorted the text, it passes on the content that reader gave and
    takes the calls it found."""

    keeps_special_tokens = True  # harmony's markers (`<|channel|>`, `<|message|>`, ...) are special tokens

    def __init__(self, answer: HarmonyAnswer | None = None) -> None:
        self.own = answer is None
        self.answer = HarmonyAnswer(reasoning=False) if answer is None else answer

    def _calls(self) -> list[ParsedCall]:
        return [ParsedCall(name, arguments) for name, arguments in self.answer.take_calls()]

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        return (self.answer.feed(delta)[1] if self.own else delta), self._calls()

    def finish(self) -> tuple[str, list[ParsedCall]]:
        return (self.answer.finish()[1] if self.own else ""), self._calls()
