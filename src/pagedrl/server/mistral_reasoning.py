"""Magistral's reasoning, `[THINK]...[/THINK]`: vLLM's `--reasoning-parser mistral`, read from the text.

The rules are those of vLLM's `MistralReasoningParser` (`vllm/reasoning/mistral_reasoning_parser.py`,
its cases in tests/reasoning/test_mistral_reasoning_parser.py). Unlike `deepseek_r1`, Mistral's templates
do not open the reasoning in the prompt: the model writes `[THINK]` itself, so
- text before the first `[THINK]` is content (a well prompted model writes none), what follows it up to
  the first `[/THINK]` the reasoning, and what follows that content again (`"Before[THINK]r[/THINK]c"` is
  reasoning `r`, content `Beforec`);
- an answer without `[THINK]` is all content (None as its reasoning), and one that never closes its
  `[THINK]` was cut off while thinking: all after the tag is reasoning;
- no tag reaches either field: a `[/THINK]` without a `[THINK]` before it, or a second `[THINK]`, is
  dropped, as vLLM's streaming drops every lone tag token (vLLM's whole answer keeps a tag after the
  first pair in the content; here the whole answer follows the stream, so that the two agree);
- a prompt whose last turn (after its last `[/INST]` or `[/TOOL_RESULTS]`) opened and closed a reasoning
  already (a continued final message) leaves the whole answer content, as written; a `[THINK]` block
  of an earlier turn or of the system prompt's example says nothing (vLLM's `is_reasoning_end`).

Both tags are special tokens of Mistral's tokenizers, which a chat answer's text leaves out, so the
server decodes the answers it reads this way with them kept (`ReasoningPlan.keeps_special_tokens`).
"""

from __future__ import annotations

BEGIN_THINK, END_THINK = "[THINK]", "[/THINK]"
TAGS = (BEGIN_THINK, END_THINK)
TURN_ENDS = ("[/INST]", "[/TOOL_RESULTS]")


def held_back(text: str, tags: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that may begin one of `tags`."""
    for n in range(min(len(text), max(len(t) for t in tags) - 1), 0, -1):
        if any(t.startswith(text[-n:]) for t in tags):
            return n
    return 0


def prompt_ends_mistral_reasoning(prompt: str) -> bool:
    """Whether the prompt's last turn opened and closed its reasoning (vLLM's `is_reasoning_end`)."""
    turn = prompt[max(prompt.rfind(end) + len(end) if end in prompt else 0 for end in TURN_ENDS):]
    begin = turn.rfind(BEGIN_THINK)
    return begin >= 0 and END_THINK in turn[begin:]


class MistralReasoningReader:
    """`feed(delta)` -> (reasoning, content) to send now; `finish()` -> the same at the end of the answer.
    `thought` says whether the answer opened a reasoning (its reasoning is None otherwise)."""

    def __init__(self, prompt_ended: bool = False) -> None:
        self.state = "as_written" if prompt_ended else "before"  # before -> reasoning -> after
        self.pending = ""

    @property
    def thought(self) -> bool:
        return self.state in ("reasoning", "after")

    def feed(self, delta: str) -> tuple[str, str]:
        if self.state == "as_written":
            return "", delta
        self.pending += delta
        reasoning, content = "", ""
        while True:
            found = {tag: at for tag in TAGS if (at := self.pending.find(tag)) >= 0}
            tag = min(found, key=found.get) if found else None
            cut = found[tag] if tag else len(self.pending) - held_back(self.pending, TAGS)
            if self.state == "reasoning":
                reasoning += self.pending[:cut]
            else:
                content += self.pending[:cut]
            if tag is None:
                self.pending = self.pending[cut:]
                return reasoning, content
            self.pending = self.pending[cut + len(tag):]
            if tag == BEGIN_THINK and self.state == "before":
                self.state = "reasoning"
            elif tag == END_THINK and self.state == "reasoning":
                self.state = "after"

    def finish(self) -> tuple[str, str]:
        """What was held back: the rest of the field (a partial tag that never completed is text)."""
        rest, self.pending = self.pending, ""
        return (rest, "") if self.state == "reasoning" else ("", rest)


def split_mistral(text: str, prompt_ended: bool = False) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer: the streaming reader run over it at once. As vLLM's whole
    answer: without a reasoning the content is the text as it is (empty included), after one it is
    None when empty."""
    reader = MistralReasoningReader(prompt_ended)
    reasoning, content = reader.feed(text)
    more_reasoning, more_content = reader.finish()
    reasoning, content = reasoning + more_reasoning, content + more_content
    return (reasoning, content or None) if reader.thought else (None, content)
