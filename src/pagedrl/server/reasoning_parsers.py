"""Telling a thinking model's reasoning from its answer: vLLM's `--reasoning-parser`, read from the text.

`deepseek_r1`, `deepseek_v3`, `kimi_k2` and `qwen3` all read `<think>...</think>`, by the rules of vLLM's
parsers (`vllm/reasoning/basic_parsers.py`, `deepseek_r1_reasoning_parser.py`, `deepseek_v3_reasoning_parser.py`,
`kimi_k2_reasoning_parser.py`, `qwen3_reasoning_parser.py`):
- the templates of these families usually write `<think>` into the prompt, so the answer opens inside
  the reasoning; a `<think>` the model writes itself is dropped, and text before it stays reasoning
  (`"abc<think>def</think>ghi"` is reasoning `abcdef`, content `ghi`). This is what vLLM's streaming
  gives (it skips the tag's token); vLLM's whole answer instead drops all text before the first
  `<think>` (reasoning `def`). Here the whole answer follows the stream, so that the two agree;
- what comes before the first `</think>` is the reasoning, what follows it the content (None when
  nothing follows);
- an answer without `</think>` was cut off while thinking: all of it is reasoning;
- `qwen3` also ends the reasoning at a `<tool_call>` followed by `<function=` or `<function ` (the
  Qwen3.5 and Qwen3-Coder call format, which a model may open without closing its thinking first), and
  `kimi_k2` at `<|tool_calls_section_begin|>` (Kimi K2's calls), the marker then the content's;
- an answer not meant to think is all content, as it is written, tags included: qwen3 with
  `enable_thinking: false` in the request's `chat_template_kwargs`, kimi_k2 with `thinking: false` there
  (vLLM's identity parser), deepseek_v3 without `thinking: true`
  (or `enable_thinking: true`) there (vLLM's `DeepSeekV3ReasoningParser` then reads with its identity
  parser; with it, with deepseek_r1's), and an answer a grammar writes from its first token (see
  `grammar_after_reasoning`: where the reasoning's end is one token, the grammar starts after it, as
  vLLM's does, and the answer is split as any). vLLM would still split at a `</think>` there, which a
  stream can only do by holding the whole answer back; here such answers stream as they are written;
- a prompt that already closed the reasoning (its last `</think>` after its last `<think>`: the
  empty think block Qwen3's template writes for `enable_thinking: false`) leaves the whole answer
  content, as vLLM's streaming code checks the prompt's tokens (here whole answers too, so that a
  stream and a whole answer always agree).

vLLM matches the tags as single tokens; here they are matched in the text, which for these models'
tokenizers (both tags are one added token each) finds the same places.

Streaming: `ReasoningReader` gives each delta's reasoning and content as soon as they are known,
holding back only text that may still turn into a tag (a partial `<think>` or `</think>`,
`<tool_call>` before its `<function`), so no part of a tag reaches either field and the deltas join
to the whole split.

`mistral` reads Magistral's `[THINK]...[/THINK]` instead (`server/mistral_reasoning.py`), and
`openai_gptoss` gpt-oss's harmony messages: its analysis channel is the reasoning, its final channel
the content (`server/harmony.py`, which also reads its tool calls).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from pagedrl.server.harmony import HarmonyAnswer, split_harmony
from pagedrl.server.mistral_reasoning import (
    END_THINK,
    MistralReasoningReader,
    held_back,
    prompt_ends_mistral_reasoning,
    split_mistral,
)

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL = "<tool_call>"
TOOL_SECTION = "<|tool_calls_section_begin|>"  # Kimi K2's calls, which end its reasoning
FUNCTION_OPEN = re.compile(r"<function[\s=]")
FUNCTION_PREFIX = "<function"
HARMONY = "openai_gptoss"
MISTRAL = "mistral"
REASONING_PARSERS = ("deepseek_r1", "deepseek_v3", "kimi_k2", MISTRAL, "qwen3", HARMONY)  # --reasoning-parser NAME


def split_reasoning(parser: str, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole answer, as `ReasoningReader` streams it. Without `thinking`
    (qwen3's `enable_thinking: false`, or a grammar that writes the whole answer) all of it is content."""
    if not thinking:
        return None, text
    if parser == "kimi_k2" and 0 <= text.find(TOOL_SECTION) < (text + THINK_END).find(THINK_END):
        at = text.find(TOOL_SECTION)
        return text[:at].replace(THINK_START, ""), text[at:]
    if THINK_END in text:
        reasoning, _, content = text.partition(THINK_END)
        return reasoning.replace(THINK_START, ""), content or None
    if parser == "qwen3":
        at = text.find(TOOL_CALL)
        if at >= 0 and FUNCTION_OPEN.match(text[at + len(TOOL_CALL):].lstrip()):
            return text[:at].replace(THINK_START, "") or None, text[at:] or None
    return text.replace(THINK_START, ""), None


def prompt_ends_reasoning(prompt: str, parser: str = "deepseek_r1") -> bool:
    """Whether the prompt closed the reasoning already (vLLM's `is_reasoning_end` of the prompt's tokens;
    kimi_k2's also closes at a tool call section)."""
    end = max(prompt.rfind(THINK_END), prompt.rfind(TOOL_SECTION) if parser == "kimi_k2" else -1)
    return end >= 0 and end > prompt.rfind(THINK_START)


class ReasoningReader:
    """`feed(delta)` -> (reasoning, content) to send now; `finish()` -> the same at the end of the answer."""

    def __init__(self, parser: str, thinking: bool = True, prompt_ended: bool = False) -> None:
        self.parser = parser
        self.state = "reasoning" if thinking and not prompt_ended else "content"
        self.pending = ""
        self.tool_checked = parser != "qwen3"  # qwen3 looks at the first <tool_call> once
        self.tags = (THINK_START, THINK_END, {"qwen3": TOOL_CALL, "kimi_k2": TOOL_SECTION}.get(parser, THINK_END))

    def feed(self, delta: str) -> tuple[str, str]:
        self.pending += delta
        reasoning, content = "", ""
        while True:
            if self.state == "content":
                content, self.pending = content + self.pending, ""
                return reasoning, content
            found = {tag: self.pending.find(tag) for tag in self.tags if tag != TOOL_CALL or not self.tool_checked}
            found = {tag: at for tag, at in found.items() if at >= 0}
            tag = min(found, key=found.get) if found else None
            if tag == THINK_START:  # the tag is dropped, what came before it stays reasoning
                at = found[tag]
                reasoning += self.pending[:at]
                self.pending = self.pending[at + len(THINK_START):]
                continue
            if tag == THINK_END:
                at = found[tag]
                reasoning += self.pending[:at]
                self.pending, self.state = self.pending[at + len(THINK_END):], "content"
                continue
            if tag == TOOL_SECTION:  # kimi_k2's calls end the reasoning; the marker is the content's
                reasoning += self.pending[:found[tag]]
                self.pending, self.state = self.pending[found[tag]:], "content"
                continue
            if tag == TOOL_CALL:
                call = found[tag]
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
            tags = tuple(t for t in self.tags if t != TOOL_CALL or not self.tool_checked)
            cut = len(self.pending) - held_back(self.pending, tags)
            reasoning += self.pending[:cut]
            self.pending = self.pending[cut:]
            return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: the rest of the reasoning (a partial tag that never completed is text)."""
        rest, self.pending = self.pending, ""
        return ("", rest) if self.state == "content" else (rest, "")


ThinkingReader = ReasoningReader | MistralReasoningReader | HarmonyAnswer  # one choice's, as its plan reads it


@dataclass(frozen=True)
class ReasoningPlan:
    """How one request's answers are split: the server's parser, and what the request and its prompt say."""

    parser: str
    thinking: bool = True  # qwen3's enable_thinking, deepseek_v3's thinking; false also where a grammar
    # writes the whole answer: then all of the answer is content
    prompt_ended: bool = False  # the prompt closed the reasoning: all of the answer is content
    include: bool = True  # vLLM's include_reasoning: false leaves the reasoning out of the answer

    @property
    def harmony(self) -> bool:
        """Whether the answers are read as harmony messages (not those a grammar writes: plain text)."""
        return self.parser == HARMONY and self.thinking

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the answer is decoded with its special tokens, where the markers read are: harmony's,
        and Mistral's `[THINK]` and `[/THINK]` (`server/inputs.py`'s `answer_decoding` applies it)."""
        return self.harmony or (self.parser == MISTRAL and self.thinking and not self.prompt_ended)

    def split(self, text: str) -> tuple[str | None, str | None]:
        if self.harmony:
            return split_harmony(text, calls=False)[:2]
        if self.parser == MISTRAL:
            return split_mistral(text, not self.thinking or self.prompt_ended)
        return split_reasoning(self.parser, text, self.thinking and not self.prompt_ended)

    def reader(self) -> ThinkingReader:
        if self.harmony:
            return HarmonyAnswer(calls=False)
        if self.parser == MISTRAL:
            return MistralReasoningReader(not self.thinking or self.prompt_ended)
        return ReasoningReader(self.parser, self.thinking, self.prompt_ended)


def thinks(parser: str, template_kwargs: dict | None) -> bool:
    """Whether the request's `chat_template_kwargs` leave the model thinking, as vLLM's parser reads them:
    qwen3 unless `enable_thinking` is false, kimi_k2 unless `thinking` is false; deepseek_v3 (DeepSeek-V3.1 and V3.2, whose templates think
    only when asked) only where `thinking` or `enable_thinking` is true; the others always."""
    kwargs = template_kwargs or {}
    if parser == "qwen3":
        return bool(kwargs.get("enable_thinking", True))
    if parser == "kimi_k2":
        return bool(kwargs.get("thinking", True))
    if parser == "deepseek_v3":
        return bool(kwargs.get("thinking", False)) or bool(kwargs.get("enable_thinking", False))
    return True


def reasoning_plan(parser: str | None, template_kwargs: dict | None, constrained: bool, prompt: str,
                   include: bool = True) -> ReasoningPlan | None:
    """A chat request's plan (None without a parser): whether it thinks (`thinks`). `constrained`: a grammar
    (`tool_choice` required or named, `response_format`, structured outputs) holds the output from its
    first token (where the reasoning's end is no single token: see `grammar_after_reasoning`), so its
    answer is all content, streamed as it is written."""
    if parser is None:
        return None
    thinking = not constrained and thinks(parser, template_kwargs)
    if parser == MISTRAL:
        ended = prompt_ends_mistral_reasoning(prompt)
    else:
        ended = parser != HARMONY and prompt_ends_reasoning(prompt, parser)
    return ReasoningPlan(parser, thinking, ended, include)


def reasoning_end_token(parser: str | None, tokenizer: Any) -> int | None:
    """The id of the token that ends the parser's reasoning (`</think>`, Mistral's `[/THINK]`), where the tag
    is one token of the tokenizer, as it is in these models' (None otherwise, and for harmony, whose
    reasoning ends at a channel header rather than a token)."""
    if parser is None or parser == HARMONY or tokenizer is None:
        return None
    ids = tokenizer.encode(END_THINK if parser == MISTRAL else THINK_END, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def grammar_after_reasoning(plan: ReasoningPlan | None, params: Any, end_token: int | None) -> Any:
    """The sampling parameters whose grammar starts after the reasoning, as vLLM's structured outputs do
    (its manager advances the grammar once the reasoning parser sees the reasoning end): the output is
    free until the model samples `end_token`, then held to the grammar. A request that does not think
    (its plan's `thinking` false) or whose prompt ended the reasoning is held from the first token."""
    constraint = params.structured_outputs
    if constraint is None or plan is None or end_token is None or not plan.thinking or plan.prompt_ended:
        return params
    return params.clone(structured_outputs=dataclasses.replace(constraint, reasoning_end_token_ids=(end_token,)))


def served_reasoning_parser(flag: str | None, model_type: str) -> str | None:
    """The parser a server reads its chat answers with: `--reasoning-parser`'s, else for gpt-oss
    `openai_gptoss`: it always answers in harmony messages, whose channel names and roles would otherwise
    reach the content as text (vLLM reads a gpt-oss answer as harmony whatever its flags)."""
    return HARMONY if flag is None and model_type == "gpt_oss" else flag
