"""gpt-oss's harmony answers read as vLLM reads them (`--reasoning-parser openai_gptoss`, `--tool-call-parser
openai`), on the cases of vLLM's own tests (tests/reasoning/test_gptoss_reasoning_parser.py's answers and
tests/tool_use/test_openai_tool_parser.py's conversations, written out as openai_harmony renders them)
and on answers written by hand after openai/harmony's docs/format.md: each whole answer splits into
reasoning, content and calls, and the same answer streamed in pieces of every size (one character at a
time included, so a marker arrives cut anywhere) joins to the whole split, no part of a marker or a
header in any delta."""

from __future__ import annotations

import json

import pytest

from pagedrl.server.harmony import MARKERS, Header, read_header, split_harmony
from pagedrl.server.reasoning_parsers import ReasoningPlan
from pagedrl.server.tool_parsers import ChoiceToolReader, parse_tool_calls

# vLLM's test_gptoss_reasoning_parser.py pieces
USER_MESSAGE_START = "<|start|>user<|message|>"
REASONING_SECTION_START = "<|end|><|start|>assistant<|channel|>analysis<|message|>"
END = "<|end|>"
ASSISTANT_START = "<|start|>assistant"
CONTENT_PREFIX = END + ASSISTANT_START + "<|channel|>final"
CONTENT_START = CONTENT_PREFIX + "<|message|>"
# (answer, reasoning, content): vLLM's test answers, split by channel as vLLM's openai tool parser and its
# Responses API read messages (analysis: reasoning, final: content, another role's message: neither); its
# parse_chat_output, which counts every message but the last as reasoning, agrees where the answer is the
# assistant's alone
REASONING_CASES = [
    (REASONING_SECTION_START + "This is reasoning" + CONTENT_START + "This is the rest", "This is reasoning",
     "This is the rest"),
    (REASONING_SECTION_START + "This is reasoning" + "<|end|>", "This is reasoning", None),
    (REASONING_SECTION_START + "This is reasoning" + CONTENT_PREFIX, "This is reasoning", None),  # a header cut off
    (REASONING_SECTION_START + "This is reasoning" + "<|message|>", "This is reasoning", None),
    (REASONING_SECTION_START + "This is reasoning" + CONTENT_PREFIX + "<|constrain|> JSON ", "This is reasoning", None),
    (REASONING_SECTION_START + "This is reasoning" + CONTENT_PREFIX + "<|constrain|> JSON <|message|>",
     "This is reasoning", ""),
    (REASONING_SECTION_START + "This is reasoning" + CONTENT_PREFIX + "<|constrain|> JSON <|message|>This is the rest",
     "This is reasoning", "This is the rest"),
    (REASONING_SECTION_START + "This is reasoning" + CONTENT_PREFIX + "<|constrain|>ReplyAction <|message|>"
     "This is the rest", "This is reasoning", "This is the rest"),
    # the user's turns are not the answer's
    (USER_MESSAGE_START + "1st turn user message" + REASONING_SECTION_START + "1st turn reasoning" + CONTENT_START
     + "1st turn response" + END + USER_MESSAGE_START + "2nd turn user message" + END + ASSISTANT_START,
     "1st turn reasoning", "1st turn response"),
    # as gpt-oss answers after its generation prompt (`<|start|>assistant`), and cut off
    ("<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>4", "Two and two.",
     "4"),
    ("<|channel|>analysis<|message|>Two and", "Two and", None),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>final<|message|>c<|return|>", "a\nb", "c"),
    ("<|channel|>final<|message|>only an answer", None, "only an answer"),
    # the model leaves out `<|start|>assistant` (vLLM's BASIC_NO_REASONING_ASSISTANT)
    ("<|channel|>analysis<|message|>r<|end|><|channel|>final<|message|>c", "r", "c"),
    # a partial marker the answer ends in is text
    ("<|channel|>final<|message|>x <|en", None, "x <|en"),
    ("", None, None),
]

# vLLM's test_openai_tool_parser.py conversations, as openai_harmony renders them for completion
SYSTEM = "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.<|end|>"
WEATHER = '<|start|>user<|message|>What is the weather in Tokyo?<|end|>'
ANALYSIS = ('<|start|>assistant<|channel|>analysis<|message|>User asks: "What is the weather in Tokyo?" We need to '
            'use get_current_weather tool.<|end|>')


def call(name: str, body: str, content_type: str | None = "json") -> str:
    constrain = f" <|constrain|>{content_type}" if content_type else ""
    return f"<|start|>assistant<|channel|>commentary to=functions.{name}{constrain}<|message|>{body}<|call|>"


TOOL_CASES = [
    (SYSTEM + "<|start|>developer<|message|># Instructions\n\nTalk like a pirate!<|end|>"
     "<|start|>user<|message|>Arrr, how be you?<|end|><|start|>assistant<|channel|>final<|message|>This is a test"
     "<|end|><|start|>assistant", None, "This is a test", []),
    (WEATHER + ANALYSIS + call("get_current_weather", '{"location": "Tokyo"}') + ASSISTANT_START,
     'User asks: "What is the weather in Tokyo?" We need to use get_current_weather tool.', None,
     [("get_current_weather", json.dumps({"location": "Tokyo"}))]),
    (WEATHER + ANALYSIS + call("get_current_weather", '{\n"location": "Tokyo"\n}') + ASSISTANT_START,
     'User asks: "What is the weather in Tokyo?" We need to use get_current_weather tool.', None,
     [("get_current_weather", json.dumps({"location": "Tokyo"}))]),
    (WEATHER + ANALYSIS + call("get_current_weather", '{"location": "Tokyo"}')
     + call("get_user_location", '{"location": "Tokyo"}') + call("no_content_type", '{"location": "Tokyo"}', None)
     + call("not_json_no_content_type", "foo", None) + call("empty_args", "{}") + call("no_args", "")
     + ASSISTANT_START,
     'User asks: "What is the weather in Tokyo?" We need to use get_current_weather tool.', None,
     [("get_current_weather", json.dumps({"location": "Tokyo"})), ("get_user_location", json.dumps({"location": "Tokyo"})),
      ("no_content_type", json.dumps({"location": "Tokyo"})), ("not_json_no_content_type", "foo"),
      ("empty_args", "{}"), ("no_args", "")]),
    (WEATHER + ANALYSIS + call("get_current_weather", '{"location": "Tokyo"}')
     + "<|start|>assistant<|channel|>final<|message|>This tool call will get the weather.<|end|>" + ASSISTANT_START,
     'User asks: "What is the weather in Tokyo?" We need to use get_current_weather tool.',
     "This tool call will get the weather.", [("get_current_weather", json.dumps({"location": "Tokyo"}))]),
    # as gpt-oss writes them after its generation prompt: the recipient before the channel, a preamble (commentary
    # without a recipient: content, not a call), a call the answer's end (its <|call|> is a stop token) closes
    ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
     "Let me look.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
     '{"city":"Paris"}', "Need the weather.", "Let me look.", [("get_weather", '{"city": "Paris"}')]),
    # a built-in tool's message is reasoning (vLLM's Responses API); a tool's answer is not the assistant's
    ("<|channel|>analysis to=python code<|message|>print(1)<|call|><|start|>python to=assistant<|channel|>commentary"
     "<|message|>1<|end|><|start|>assistant<|channel|>final<|message|>1", "print(1)", "1", []),
    # arguments that are not JSON stay as written
    ("<|channel|>commentary to=functions.f <|constrain|>json<|message|>{oops", None, None, [("f", "{oops")]),
]


def whole(text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    return split_harmony(text)


def streamed(text: str, size: int) -> tuple[str | None, str | None, list[tuple[str, str]], list[str]]:
    """`text` through a chat choice's readers (`openai_gptoss` then `openai`), `size` characters at a time:
    the joined reasoning and content, the calls, and every delta."""
    from pagedrl.server.responses import answer_readers, split_delta
    from pagedrl.server.tools import ToolPlan

    thinker, reader = answer_readers(ToolPlan("auto", parser="openai"), ReasoningPlan("openai_gptoss"))
    reasoning, content, calls, deltas = "", "", [], []
    pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
    for i, piece in enumerate(pieces):
        r, t = split_delta(thinker, piece, i == len(pieces) - 1)
        c, new, _ = reader.feed(t, i == len(pieces) - 1)
        reasoning, content, deltas = reasoning + r, content + c, deltas + [r, c]
        calls += [(call.name, call.arguments) for call in new]
    return (reasoning if "reasoning" in thinker.used else None, content if "content" in thinker.used else None,
            calls, deltas)


@pytest.mark.parametrize(("text", "reasoning", "content"), REASONING_CASES)
def test_whole_answers_split_as_vllms_parser(text, reasoning, content) -> None:
    assert whole(text)[:2] == (reasoning, content)
    assert ReasoningPlan("openai_gptoss").split(text) == (reasoning, content)


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), TOOL_CASES)
def test_tool_calls_as_vllms_openai_parser(text, reasoning, content, calls) -> None:
    assert whole(text) == (reasoning, content, calls)


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"),
                         [(*c, []) for c in REASONING_CASES] + TOOL_CASES)
def test_streamed_deltas_join_to_the_whole_split(text, reasoning, content, calls) -> None:
    for size in range(1, len(text) + 2):
        got_reasoning, got_content, got_calls, deltas = streamed(text, size)
        assert (got_reasoning or None, got_content, got_calls) == (reasoning or None, content, calls), size
        if not text.endswith("<|en"):  # a marker the answer never completed is text
            assert not any("<|" in d for d in deltas), (size, deltas)


def test_the_reasoning_streams_before_the_answer_ends() -> None:
    _, _, _, deltas = streamed("<|channel|>analysis<|message|>abcdef<|end|>", 4)
    assert [d for d in deltas if d] == ["ab", "cdef"]  # each piece as it arrived, the end marker held back


def test_headers_name_channel_recipient_and_content_type_in_either_order() -> None:
    assert read_header("assistant to=functions.f<|channel|>commentary json") == Header("commentary", "functions.f", "json")
    assert read_header("<|channel|>commentary to=functions.f <|constrain|>json") == Header(
        "commentary", "functions.f", "json")
    assert read_header("<|channel|>final") == Header("final")
    assert read_header("functions.f to=assistant<|channel|>commentary").role == "functions.f"
    assert read_header("<|channel|><|channel|>analysis") == Header("analysis")


def test_without_the_tool_parser_a_call_is_content_and_without_the_reasoning_parser_so_is_the_analysis() -> None:
    text = "<|channel|>analysis<|message|>r<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}"
    assert ReasoningPlan("openai_gptoss").split(text) == ("r", "{}")
    content, calls = parse_tool_calls("openai", text)
    assert content == "r" and [(c.name, c.arguments) for c in calls] == [("f", "{}")]
    reader = ChoiceToolReader("auto", "openai")
    got, new, _ = reader.feed(text, finished=True)
    assert got == "r" and [c.name for c in new] == ["f"] and reader.finish_reason("stop") == "tool_calls"
    assert not any(m in got for m in MARKERS)


def test_only_answers_read_for_special_tokens_are_decoded_with_them() -> None:
    """The engine request keeps special tokens in the text where the answer is read as harmony; the
    request's own params (which name its log-probs' tokens) are not changed, and an answer a grammar
    writes is not read as harmony: the `openai` parser then reads nothing of it."""
    from pagedrl.engine.sampling_params import SamplingParams
    from pagedrl.engine.structured_outputs import StructuredOutputsParams
    from pagedrl.server.inputs import answer_decoding
    from pagedrl.server.tools import ToolPlan

    params = SamplingParams(max_tokens=8)
    auto = ToolPlan("auto", parser="openai")
    for plan, thinking in [(auto, None), (None, ReasoningPlan("openai_gptoss")), (auto, ReasoningPlan("openai_gptoss"))]:
        got_plan, decoding = answer_decoding(plan, thinking, params)
        assert got_plan is plan and decoding.skip_special_tokens is False and params.skip_special_tokens is True
    for plan, thinking in [(None, None), (ToolPlan("auto", parser="pythonic"), ReasoningPlan("qwen3")),
                           (None, ReasoningPlan("openai_gptoss", thinking=False))]:
        assert answer_decoding(plan, thinking, params) == (plan, params)
    constrained = params.clone(structured_outputs=StructuredOutputsParams(regex="a"))
    got_plan, decoding = answer_decoding(auto, None, constrained)
    assert got_plan.parser is None and decoding is constrained
    reader = ChoiceToolReader(got_plan.mode, got_plan.parser)
    assert reader.feed('{"a": 1}', finished=True) == ('{"a": 1}', [], "")


def test_gpt_oss_is_read_as_harmony_unless_the_server_names_another_parser():
    from pagedrl.server.reasoning_parsers import served_reasoning_parser

    assert served_reasoning_parser(None, "gpt_oss") == "openai_gptoss"
    assert served_reasoning_parser("deepseek_r1", "gpt_oss") == "deepseek_r1"
    assert served_reasoning_parser(None, "llama") is None and served_reasoning_parser("qwen3", "qwen3") == "qwen3"
