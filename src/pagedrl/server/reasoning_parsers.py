"""Telling a thinking model's reasoning from its answer: vLLM's `--reasoning-parser`, read from the text.

`deepseek_r1` and `qwen3` both read `<think>...</think>`, by the rules of vLLM's parsers
(`vllm/reasoning/basic_parsers.py`, `deepseek_r1_reasoning_parser.py`, `qwen3_reasoning_parser.py`):
- a `<think>` the model writes is dropped (with whatever came before it); the templates of both
  families usually write it into the prompt, so the answer opens inside the reasoning;
- what comes before the first `</think>` is the reasoning, what follows it the content (None when
  nothing follows);
- an answer without `</think>` was cut off while thinking: all of it is reasoning;
- `qwen3` also ends the reasoning at a `<tool_call>` followed by `<function=` or `<function ` (the
  Qwen3.5 and Qwen3-Coder call format, which a model may open without closing its thinking first),
  and with `enable_thinking: false` in the request's `chat_template_kwargs` an answer without
  `</think>` is all content;
- a prompt that already closed the reasoning (its last `</think>` after its last `<think>`: the
  empty think block Qwen3's template writes for `enable_thinking: false`) leaves the whole answer
  content, as vLLM's streaming code checks the prompt's tokens (here whole answers too, so that a
  stream and a whole answer always agree).

vLLM matches the tags as single tokens; here they are matched in the text, which for these models'
tokenizers (both tags are one added token each) finds the same places.

Streaming: `ReasoningReader` gives each delta's reasoning and content as soon as they are known,
holding back only text that may still turn into a tag (a partial `</think>`, `<tool_call>` before
its `<function`), so no part of a tag reaches either field and the deltas join to the whole split.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL = "<tool_call>"
FUNCTION_OPEN = re.compile(r"<function[\s=]")
FUNCTION_PREFIX = "<function"
REASONING_PARSERS = ("deepseek_r1", "qwen3")  # --reasoning-parser NAME


def split_reasoning(parser: str, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer, by vLLM's `extract_reasoning` of `parser`. Without
    `thinking` (qwen3's `enable_thinking: false`) an answer that never closes a reasoning is content."""
    _, start, rest = text.partition(THINK_START)
    text = rest if start else text
    if THINK_END in text:
        reasoning, _, content = text.partition(THINK_END)
        return reasoning, content or None
    if not thinking:
        return None, text
    if parser == "qwen3":
        at = text.find(TOOL_CALL)
        if at >= 0 and FUNCTION_OPEN.match(text[at + len(TOOL_CALL):].lstrip()):
            return text[:at] or None, text[at:] or None
    return text, None


def prompt_ends_reasoning(prompt: str) -> bool:
    """Whether the prompt closed the reasoning already (vLLM's `is_reasoning_end` of the prompt's tokens)."""
    end = prompt.rfind(THINK_END)
    return end >= 0 and end > prompt.rfind(THINK_START)


def _held(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that may begin one of `tags`."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


class ReasoningReader:
    """`feed(delta)` -> (reasoning, content) to send now; `finish()` -> the same at the end of the answer."""

    def __init__(self, parser: str, thinking: bool = True, prompt_ended: bool = False) -> None:
        self.parser, self.thinking = parser, thinking
        self.state = "content" if prompt_ended else "start" if thinking else "held"
        self.pending = ""
        self.tool_checked = parser != "qwen3"  # qwen3 looks at the first <tool_call> once

    def feed(self, delta: str) -> tuple[str, str]:
        self.pending += delta
        reasoning, content = "", ""
        while True:
            if self.state == "content":
                content, self.pending = content + self.pending, ""
                return reasoning, content
            if self.state == "held":  # no thinking asked for: content unless a </think> comes
                if THINK_END not in self.pending:
                    return reasoning, content
                r, c = split_reasoning(self.parser, self.pending, thinking=False)
                reasoning, self.pending, self.state = r or "", c or "", "content"
                continue
            if self.state == "start":  # a <think> the model writes opens its answer, maybe after blank lines
                opening = self.pending.lstrip()
                if len(opening) < len(THINK_START) and THINK_START.startswith(opening):
                    return reasoning, content
                if opening.startswith(THINK_START):
                    self.pending = opening[len(THINK_START):]
                self.state = "reasoning"
            end = self.pending.find(THINK_END)
            call = -1 if self.tool_checked else self.pending.find(TOOL_CALL)
            if end >= 0 and (call < 0 or end < call):
                reasoning += self.pending[:end]
                self.pending, self.state = self.pending[end + len(THINK_END):], "content"
                continue
            if call >= 0:
                after = self.pending[call + len(TOOL_CALL):].lstrip()
                if FUNCTION_OPEN.match(after):
                    reasoning += self.pending[:call]
                    self.pending, self.state = self.pending[call:], "content"
                    continue
                if FUNCTION_PREFIX.startswith(after):  # not yet known: wait for the next delta
                    reasoning += self.pending[:call]
                    self.pending = self.pending[call:]
                    return reasoning, content
                self.tool_checked = True  # a <tool_call> in the reasoning's text, not a call
                continue
            keep = _held(self.pending, (THINK_END,) if self.tool_checked else (THINK_END, TOOL_CALL))
            cut = len(self.pending) - keep
            reasoning += self.pending[:cut]
            self.pending = self.pending[cut:]
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: the rest of the reasoning, or (without thinking) the whole answer as content."""
        rest, self.pending = self.pending, ""
        if self.state == "held":
            r, c = split_reasoning(self.parser, rest, thinking=False)
            return r or "", c or ""
        return ("", rest) if self.state == "content" else (rest, "")


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's answers are split: the server's parser, and what the request and its prompt say."""

    parser: str
    thinking: bool = True  # qwen3's enable_thinking; false also where a grammar writes the whole answer
    prompt_ended: bool = False  # the prompt closed the reasoning: all of the answer is content
    include: bool = True  # vLLM's include_reasoning: false leaves the reasoning out of the answer

    def split(self, text: str) -> tuple[str | None, str | None]:
        if self.prompt_ended:
            return None, text
        return split_reasoning(self.parser, text, self.thinking)

    def reader(self) -> ReasoningReader:
        return ReasoningReader(self.parser, self.thinking, self.prompt_ended)


def reasoning_plan(parser: str | None, template_kwargs: dict | None, constrained: bool, prompt: str,
                   include: bool = True) -> ReasoningPlan | None:
    """A chat request's plan (None without a parser). qwen3 reads `enable_thinking` from the request's
    `chat_template_kwargs`, as vLLM's parser does. A request whose output a grammar constrains
    (`tool_choice` required or named, `response_format`, structured outputs) is held to it from its
    first token here (vLLM starts the grammar after the reasoning), so its answer is content unless the
    grammar itself writes a `</think>`."""
    if parser is None:
        return None
    thinking = not constrained and (parser != "qwen3" or bool((template_kwargs or {}).get("enable_thinking", True)))
    return ReasoningPlan(parser, thinking, prompt_ends_reasoning(prompt), include)
