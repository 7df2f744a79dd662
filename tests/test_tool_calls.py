"""Tool calling without a server: the Hermes parser on whole answers (every parser, streamed and not:
tests/test_tool_parsers.py), the constrained encodings of `required` and a named function, what the
chat template is given, and the answers decoded with their special tokens where a parser's markers are."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from pagedrl.engine.grammar import GrammarCompiler
from pagedrl.server.errors import ApiError
from pagedrl.server.inputs import answer_decoding, chat_inputs, chat_prompt_ids
from pagedrl.server.protocol import ChatCompletionRequest, ChatMessage
from pagedrl.server.tool_parsers import ChoiceToolReader, parse_required, parse_tool_calls
from pagedrl.server.tools import tool_constraint, tool_plan

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}


def call_block(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_hermes_reads_content_and_calls() -> None:
    text = "Let me look.\n\n" + call_block("get_weather", {"city": "Paris"}) + "\n" + call_block("f", {}) + "\n"
    content, calls = parse_tool_calls("hermes", text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("f", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parse_tool_calls("hermes", "no calls, a < and <tool") == ("no calls, a < and <tool", [])
    # a block that is not a call stays text; an unclosed last block at the end of the answer is read
    assert parse_tool_calls("hermes", "<tool_call>{oops}</tool_call> ok") == ("<tool_call>{oops}</tool_call> ok", [])
    content, calls = parse_tool_calls("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]


def test_required_and_named_constraints_and_their_readers() -> None:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                                                "tool_choice": "required", "parallel_tool_calls": False})
    plan = tool_plan(req, None, False)
    schema = tool_constraint(plan, req.parallel_tool_calls).json
    assert schema["maxItems"] == 1 and schema["items"]["anyOf"][0]["properties"]["name"]["enum"] == ["get_weather"]
    assert [(c.name, c.arguments) for c in parse_required('[{"name": "get_weather", "parameters": {"city": "Rome"}}]')] \
        == [("get_weather", '{"city": "Rome"}')]
    assert parse_required('[{"name": "get_weather", "parameters": {"ci') is None
    named = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                                                  "tool_choice": {"type": "function", "function": {"name": "get_weather"}}})
    plan = tool_plan(named, None, False)
    assert tool_constraint(plan, True).json == WEATHER["function"]["parameters"]
    reader = ChoiceToolReader("named", name="get_weather")
    first = reader.feed('{"city":', False)
    assert first[0] == "" and [c.name for c in first[1]] == ["get_weather"] and first[2] == '{"city":'
    assert reader.feed('"Oslo"}', True) == ("", [], '"Oslo"}') and reader.finish_reason("stop") == "tool_calls"


class Corner(BaseModel):
    x: int


class Box(BaseModel):
    corner: Corner


class Link(BaseModel):
    label: str
    next: Link | None = None


def test_required_keeps_each_tools_defs_apart(default_tokenizer) -> None:
    """pydantic writes nested models under `$defs` and a recursive one as `#/$defs/Link`; a bare `#`
    is the tool's own root. Inside the required array of calls each still reaches its own tool's."""
    tools = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in (
        ("box", Box.model_json_schema()), ("link", Link.model_json_schema()),
        ("nest", {"type": "object", "properties": {"me": {"$ref": "#"}}}))]
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                                                "tool_choice": "required"})
    compiler = GrammarCompiler(default_tokenizer.backend.to_str(), 49152, [default_tokenizer.eos_token_id])
    matcher = compiler.matcher(tool_constraint(tool_plan(req, None, False), True))
    text = ('[{"name":"box","parameters":{"corner":{"x":1}}},{"name":"link","parameters":{"label":"a","next":'
            '{"label":"b","next":null}}},{"name":"nest","parameters":{"me":{"me":{}}}}]')
    for token in default_tokenizer.encode(text):
        matcher.accept(token)
    assert matcher.is_accepting


@pytest.mark.parametrize(("parser", "choice", "skips"), [
    ("mistral", "auto", False), ("llama3_json", "auto", False), ("hermes", "auto", False), ("deepseek_v3", "auto", False),
    ("deepseek_v31", "auto", False), ("kimi_k2", "auto", False),
    ("llama4_pythonic", "auto", False), ("pythonic", "auto", True), ("mistral", "none", True), ("mistral", "required", True)])
def test_a_parser_whose_markers_are_special_tokens_keeps_them(default_tokenizer, parser, choice, skips) -> None:
    """`[TOOL_CALLS]`, `<|python_tag|>`, `<tool_call>` are special tokens in the tokenizers of the models
    that write them: under `auto` the answer is decoded with them, as vLLM's parsers ask
    (`skip_special_tokens=False`); otherwise the request's setting stands."""
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                                                "tool_choice": choice})
    plan = tool_plan(req, parser, True)
    _, params = chat_inputs(req, default_tokenizer, plan=plan)
    _, decoding = answer_decoding(plan, None, params)
    assert decoding.skip_special_tokens is skips


@pytest.mark.parametrize(("body", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": [WEATHER]}, "tool_choice"),  # auto, but the server was not started with it
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools.1.function.name"),
])
def test_bad_tool_requests_name_the_field(body, param) -> None:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    with pytest.raises(ApiError) as e:
        tool_plan(req, "hermes", False)
    assert e.value.status == 400 and e.value.param == param


HISTORY = [ChatMessage(role="user", content="Weather in Paris?"),
           ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [{
               "id": "call_1", "type": "function",
               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}),
           ChatMessage(role="tool", content='{"temperature": 21}', tool_call_id="call_1")]


def test_a_template_without_tools_gets_them_in_hermes_format(default_tokenizer) -> None:
    """SmolLM2's template never mentions tools: they go into the system turn, past calls and tool
    results as Hermes blocks; the prompt still ends ready for the assistant."""
    text = default_tokenizer.decode(chat_prompt_ids(default_tokenizer, HISTORY, True, [WEATHER]), skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n# Tools") and json.dumps(WEATHER) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert '<|im_start|>user\n<tool_response>\n{"temperature": 21}\n</tool_response><|im_end|>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_with_tools_receives_them(tiny_train_model) -> None:
    """A Qwen2.5-style template reads `tools` and the history's calls itself; arguments arrive as objects."""
    from pagedrl.model.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(tiny_train_model)
    tokenizer.chat_template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }} {{ t.function.parameters | tojson }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]{% endfor %}"
        "{% endfor %}")
    text = tokenizer.decode(chat_prompt_ids(tokenizer, HISTORY, False, [WEATHER]))
    assert text.startswith('[tool get_weather {"type": "object"') and "[call get_weather Paris]" in text
    assert text.endswith('<tool>{"temperature": 21}')
    odd = ChatMessage.model_validate({"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                           "function": {"name": "f", "arguments": "{"}}]})
    assert tokenizer.decode(chat_prompt_ids(tokenizer, [HISTORY[0], odd], False, [WEATHER])).endswith("[call f ]")
