"""The reasoning parsers against the cases of vLLM's own tests (tests/reasoning/
test_deepseekr1_reasoning_parser.py, test_deepseekv3_reasoning_parser.py,
test_kimi_k2_reasoning_parser.py and test_qwen3_reasoning_parser.py; Mistral's in test_mistral_reasoning.py): each whole answer splits
into vLLM's reasoning and content, and the same answer streamed in pieces of every size (one
character at a time included, so a tag arrives cut anywhere) joins to the whole split, with no part
of a tag in either field."""

from __future__ import annotations

import pytest

from pagedrl.server.reasoning_parsers import (
    ReasoningPlan,
    ReasoningReader,
    prompt_ends_reasoning,
    reasoning_plan,
    split_reasoning,
)

# (answer, reasoning, content) as vLLM's non-streaming extract_reasoning gives them
DEEPSEEK_R1 = [
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("This is a reasoning section</think>", "This is a reasoning section", None),
    ("This is content", "This is content", None),
    ("This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("</think>This is the rest", "", "This is the rest"),
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    ("<think>This\nThat</think>This is the rest\nThat", "This\nThat", "This is the rest\nThat"),
    ("<think>This is a reasoning section", "This is a reasoning section", None),
    ("", "", None),
    # vLLM's streamed split (NEW_LINE_STREAMING in its test; its whole answer drops the text before <think>)
    ("\n<think>This is a reasoning section</think>\nThis is the rest", "\nThis is a reasoning section",
     "\nThis is the rest"),
    ("abc<think>def</think>ghi", "abcdef", "ghi"),
    ("x\n<think>r</think>c", "x\nr", "c"),
]
TOOL_CALL_BODY = "<tool_call>\n<function=bash>\n<parameter=command>\ncat /etc/hosts\n</parameter>\n</function>\n</tool_call>"
QWEN3 = [
    ("This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("This is a reasoning section</think>", "This is a reasoning section", None),
    ("<think>This is a reasoning section</think>This is the rest", "This is a reasoning section", "This is the rest"),
    ("This is the rest", "This is the rest", None),
    ("<think>This is a reasoning section</think>", "This is a reasoning section", None),
    ("<think>This is a reasoning\nsection</think>This is the rest\nThat", "This is a reasoning\nsection",
     "This is the rest\nThat"),
    ("<think>This is a reasoning section", "This is a reasoning section", None),
    ("This is a reasoning section", "This is a reasoning section", None),
    ("I need to read the file.\n\n" + TOOL_CALL_BODY, "I need to read the file.\n\n", TOOL_CALL_BODY),
    ("<think>I need to read the file.\n\n" + TOOL_CALL_BODY, "I need to read the file.\n\n", TOOL_CALL_BODY),
    # a <tool_call> not followed by <function is text of the reasoning (vLLM's lookahead)
    ("I could write <tool_call> here", "I could write <tool_call> here", None),
    ("abc<think>def</think>ghi", "abcdef", "ghi"),
    ("x\n<think>r</think>c", "x\nr", "c"),
    ("a<tool_call><think>\n<function=f>", "a<tool_call>\n<function=f>", None),
    ("<tool_call>\n{\"name\": \"f\"}</think>done", "<tool_call>\n{\"name\": \"f\"}", "done"),
]
# qwen3 with chat_template_kwargs {"enable_thinking": false}, and any answer a grammar writes: all content,
# streamed as written (vLLM's whole answer would split "thought</think>answer" at the tag)
QWEN3_NO_THINKING = [
    ("This is plain content", None, "This is plain content"),
    ("Some output without think tokens", None, "Some output without think tokens"),
    ("I need to read the file.\n\n" + TOOL_CALL_BODY, None, "I need to read the file.\n\n" + TOOL_CALL_BODY),
    ("thought</think>answer", None, "thought</think>answer"),
]
# deepseek_v3 without thinking: vLLM's IdentityReasoningParser, all content as written
DEEPSEEK_V3_NO_THINKING = [
    ("This is some output", None, "This is some output"),
    ("Hello world", None, "Hello world"),
    ("<think>r</think>c", None, "<think>r</think>c"),
]
SECTION = "<|tool_calls_section_begin|>"
KIMI_K2 = [
    ("<think>step by step reasoning</think>final answer", "step by step reasoning", "final answer"),
    ("<think></think>final answer", "", "final answer"),
    ("implicit reasoning with no tags", "implicit reasoning with no tags", None),
    ("some reasoning" + SECTION + "tool call data", "some reasoning", SECTION + "tool call data"),
    ("<think>step one</think>answer", "step one", "answer"),
    ("<think>thinking" + SECTION, "thinking", SECTION),
    # the stream ends the reasoning at whichever comes first (vLLM's whole answer prefers </think>)
    ("r" + SECTION + "x</think>y", "r", SECTION + "x</think>y"),
    ("r</think>x" + SECTION + "y", "r", "x" + SECTION + "y"),
]
CASES = ([(parser, True, *c) for parser in ("deepseek_r1", "deepseek_v3") for c in DEEPSEEK_R1]
         + [("qwen3", True, *c) for c in QWEN3] + [("qwen3", False, *c) for c in QWEN3_NO_THINKING]
         + [(parser, False, *c) for parser in ("deepseek_v3", "kimi_k2") for c in DEEPSEEK_V3_NO_THINKING]
         + [("kimi_k2", True, *c) for c in KIMI_K2])


def streamed(parser: str, text: str, size: int, thinking: bool = True, prompt_ended: bool = False
             ) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """The joined reasoning and content of `text` fed `size` characters at a time, and every delta."""
    reader = ReasoningReader(parser, thinking, prompt_ended)
    deltas = [reader.feed(text[i:i + size]) for i in range(0, len(text), size)] + [reader.finish()]
    reasoning, content = "".join(r for r, _ in deltas), "".join(c for _, c in deltas)
    return reasoning or None, content or None, deltas


@pytest.mark.parametrize("parser,thinking,text,reasoning,content", CASES)
def test_whole_answers_split_as_vllms_parsers(parser, thinking, text, reasoning, content) -> None:
    assert split_reasoning(parser, text, thinking) == (reasoning, content)


@pytest.mark.parametrize("parser,thinking,text,reasoning,content", CASES)
def test_streamed_deltas_join_to_the_whole_split(parser, thinking, text, reasoning, content) -> None:
    for size in range(1, max(len(text), 1) + 1):
        r, c, deltas = streamed(parser, text, size, thinking)
        assert (r, c) == (reasoning or None, content or None), size
        for dr, dc in deltas if thinking else []:  # no piece of a tag is sent (but as text after the reasoning)
            for piece, whole in ((dr, reasoning or ""), (dc, content or "")):
                assert all(tag not in piece or tag in whole for tag in ("<think>", "</think>"))


def test_reasoning_streams_before_the_answer_ends() -> None:
    """Reasoning goes out as it is written, holding back only what may be the start of </think>."""
    reader = ReasoningReader("deepseek_r1")
    assert reader.feed("<think>Let me") == ("Let me", "")
    assert reader.feed(" see.</th") == (" see.", "")
    assert reader.feed("ink>The answer") == ("", "The answer")
    assert reader.feed(" is 4.") == ("", " is 4.")
    assert reader.finish() == ("", "")
    qwen = ReasoningReader("qwen3")
    assert qwen.feed("hmm <tool_") == ("hmm ", "")
    assert qwen.feed("call>\n") == ("", "")  # a call may follow: held until it is known
    assert qwen.feed("<function=f>") == ("", "<tool_call>\n<function=f>")


def test_a_prompt_that_closed_the_reasoning_leaves_all_content() -> None:
    """Qwen3's template writes an empty think block for enable_thinking false: the answer is content."""
    prompt = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert prompt_ends_reasoning(prompt) and not prompt_ends_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_ends_reasoning("no tags at all")
    plan = ReasoningPlan("deepseek_r1", prompt_ended=True)
    assert plan.split("Hello</think>there") == (None, "Hello</think>there")
    assert streamed("deepseek_r1", "Hello</think>there", 3, prompt_ended=True)[:2] == (None, "Hello</think>there")


def test_an_answer_not_meant_to_think_streams_as_it_is_written() -> None:
    """A grammar-constrained answer (and qwen3's enable_thinking false) is content from its first delta:
    nothing is held back until a </think> or the end."""
    for parser in ("deepseek_r1", "qwen3"):
        reader = ReasoningPlan(parser, thinking=False).reader()
        assert reader.feed('{"a"') == ("", '{"a"')
        assert reader.feed(": 1}") == ("", ": 1}")
        assert reader.finish() == ("", "")


def test_a_think_tag_after_text_is_dropped_in_the_stream_as_in_the_whole() -> None:
    reader = ReasoningReader("deepseek_r1")
    assert reader.feed("abc<th") == ("abc", "")  # the start of a tag is held
    assert reader.feed("ink>def</think>ghi") == ("def", "ghi")


@pytest.mark.parametrize("kwargs,thinking", [
    ({"thinking": True}, True), ({"enable_thinking": True}, True), ({"thinking": False, "enable_thinking": True}, True),
    ({"thinking": False}, False), ({}, False), (None, False), ({"enable_thinking": False}, False)])
def test_deepseek_v3_thinks_only_when_the_request_asks(kwargs, thinking) -> None:
    """vLLM's DeepSeekV3ReasoningParser: deepseek_r1's reading where `thinking` or `enable_thinking` is true
    in chat_template_kwargs (DeepSeek-V3.1's template then opens <think> in the prompt), else identity."""
    plan = reasoning_plan("deepseek_v3", kwargs, False, "<｜Assistant｜><think>" if thinking else "<｜Assistant｜></think>")
    assert plan.thinking is thinking
    assert plan.split("Let me see.</think>4") == (("Let me see.", "4") if thinking else (None, "Let me see.</think>4"))
    assert not plan.keeps_special_tokens
    assert not reasoning_plan("deepseek_v3", {"thinking": True}, True, "").thinking  # a grammar writes it all


def test_kimi_k2_thinks_unless_the_request_says_not_and_its_calls_close_the_prompts_reasoning() -> None:
    """vLLM's KimiK2ReasoningParser: identity with `thinking: false`; its is_reasoning_end also ends at a
    tool call section after the last <think>."""
    assert reasoning_plan("kimi_k2", None, False, "").thinking
    assert not reasoning_plan("kimi_k2", {"thinking": False}, False, "").thinking
    assert reasoning_plan("kimi_k2", None, False, "<think>r" + SECTION + "calls").prompt_ended
    assert not reasoning_plan("deepseek_r1", None, False, "<think>r" + SECTION + "calls").prompt_ended
    assert not reasoning_plan("kimi_k2", None, False, SECTION + "calls<think>").prompt_ended
