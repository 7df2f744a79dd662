"""The tool parsers of `--tool-call-parser`, against vLLM's own test cases (tests/tool_parsers/ in vLLM:
the model outputs and the calls it expects of them), whole and cut into stream deltas every way
(hypothesis: a streamed reading always equals the whole one, so no piece of a call reaches a content
delta). Where pagedrl departs from vLLM on purpose the case says so (docs/serving.md, tool calling)."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedrl.server.tool_parsers import TOOL_PARSERS, parse_tool_calls

CALLS = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"


SECTION = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"


def kimi_call(call_id: str, arguments: str) -> str:
    return f"<|tool_call_begin|>{call_id} <|tool_call_argument_begin|>{arguments}<|tool_call_end|>"


def deepseek_call(name: str, arguments: str) -> str:
    return f"{CALL[0]}function<｜tool▁sep｜>{name}\n```json\n{arguments}\n```{CALL[1]}"


SIMPLE = "get_weather(city='San Francisco', metric='celsius')"
MORE_TYPES = ("register_user(name='John Doe', age=37, address={'city': 'San Francisco', 'state': 'CA'}, role=None, "
              "passed_test=True, aliases=['John', 'Johnny'])")
WEATHER = ("get_weather", {"city": "San Francisco", "metric": "celsius"})
USER = ("register_user", {"name": "John Doe", "age": 37, "address": {"city": "San Francisco", "state": "CA"},
                          "role": None, "passed_test": True, "aliases": ["John", "Johnny"]})
SF = {"city": "San Francisco", "state": "CA", "unit": "celsius"}
BASH = {"command": "print(\"hello world!\")\nre.compile(r'{}')"}

# (parser, model output, content, [(name, arguments)]): vLLM's cases, with vLLM's expectations unless marked
CASES = [
    # llama3_json (vLLM: test_llama3_json_tool_parser.py)
    ("llama3_json", 'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know more?',
     "Here is the result: Would you like to know more?", [("getOpenIncidentsTool", {})]),  # vLLM: content None
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}', None,
     [("searchTool", {"query": "test query", "limit": 10})]),
    ("llama3_json", "This is just some text without any tool calls", "This is just some text without any tool calls", []),
    ("llama3_json", '{"name": "invalidTool", "parameters": {invalid json}',
     '{"name": "invalidTool", "parameters": {invalid json}', []),
    ("llama3_json", '{"name": "searchTool", "arguments": {"query": "test"}}', None, [("searchTool", {"query": "test"})]),
    *[("llama3_json", sep.join(['{"name": "searchTool", "parameters": {"query": "test1"}}',
                                '{"name": "getOpenIncidentsTool", "parameters": {}}',
                                '{"name": "searchTool", "parameters": {"query": "test2"}}']), None,
       [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {}), ("searchTool", {"query": "test2"})])
      for sep in ("; ", " ; ", ";", ";\n", "\n")],
    ("llama3_json", 'Here are the results: {"name": "searchTool", "parameters": {"query": "test1"}}; '
     '{"name": "getOpenIncidentsTool", "parameters": {}} Would you like to know more?',
     "Here are the results: Would you like to know more?",  # vLLM: content None
     [("searchTool", {"query": "test1"}), ("getOpenIncidentsTool", {})]),
    ("llama3_json", '{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}}',
     None, [("complexTool", {"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}})]),
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test {value} [complex]","nested": {"inner": '
     '"more {brackets}"}}}', None,
     [("searchTool", {"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}})]),
    ("llama3_json", '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}', None,
     [("parserTool", {"text": 'He said "Hello {world}"'})]),
    ("llama3_json", '{"parameters": {}}', '{"parameters": {}}', []),
    ("llama3_json", '{"name": "toolWithoutParams"}', '{"name": "toolWithoutParams"}', []),
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test"}} I used {searchTool} for this.',
     " I used {searchTool} for this.", [("searchTool", {"query": "test"})]),  # vLLM: content None
    ("llama3_json", '{"name": "searchTool", "parameters": {"query": "test"}} The arguments I passed were {"query": "test"}',
     ' The arguments I passed were {"query": "test"}', [("searchTool", {"query": "test"})]),  # vLLM: content None
    ("llama3_json", 'Sure.<|python_tag|>{"name": "f", "parameters": {"x": 1}}', "Sure.", [("f", {"x": 1})]),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    # pythonic (vLLM: test_pythonic_tool_parser.py)
    ("pythonic", "How can I help you today?", "How can I help you today?", []),
    ("pythonic", f"[{SIMPLE}]", None, [WEATHER]),
    ("pythonic", f"[{MORE_TYPES}]", None, [USER]),
    ("pythonic", "[get_weather()]", None, [("get_weather", {})]),
    ("pythonic", "[do_something_cool(additional_data={})]", None, [("do_something_cool", {"additional_data": {}})]),
    ("pythonic", "[do_something_cool(steps=[])]", None, [("do_something_cool", {"steps": []})]),
    ("pythonic", r"[get_weather(city='Martha\'s Vineyard', metric='\"cool units\"')]", None,
     [("get_weather", {"city": "Martha's Vineyard", "metric": '"cool units"'})]),
    ("pythonic", f"[{SIMPLE}, {MORE_TYPES}]", None, [WEATHER, USER]),
    ("pythonic", f"[bad(x=b'z'), {SIMPLE}]", None, [WEATHER]),
    ("pythonic", f"[calc(x=1e999), {SIMPLE}]", None, [WEATHER]),
    ("pythonic", "[f(a='x 'y' 'z), g(b='p 'q' 'r)]", "[f(a='x 'y' 'z), g(b='p 'q' 'r)]", []),
    ("pythonic", "[foo(x=1])]", "[foo(x=1])]", []),
    ("pythonic", "Let me check. [f(x=-1, t=(1, 2))]", "Let me check.", [("f", {"x": -1, "t": [1, 2]})]),  # vLLM: text
    ("pythonic", "[1, 2] is a [link](url); [f(1)]", "[1, 2] is a [link](url); [f(1)]", []),
    # llama4_pythonic (vLLM: test_llama4_pythonic_tool_parser.py)
    ("llama4_pythonic", "How can I help you today?", "How can I help you today?", []),
    ("llama4_pythonic", "<|python_start|>[get_weather(city='LA', metric='C')]<|python_end|>", None,
     [("get_weather", {"city": "LA", "metric": "C"})]),
    ("llama4_pythonic", "<|python_start|>[get_weather(city='LA', metric='C'),register_user(name='Doe', age=9)]", None,
     [("get_weather", {"city": "LA", "metric": "C"}), ("register_user", {"name": "Doe", "age": 9})]),
    ("llama4_pythonic", "[get_weather(city='LA',metric='C'),register_user(name='Doe',age=9)]", None,
     [("get_weather", {"city": "LA", "metric": "C"}), ("register_user", {"name": "Doe", "age": 9})]),
    ("llama4_pythonic", "<|python_start|>[bad(x=b'z'), get_weather(city='LA', metric='C')]<|python_end|>", None,
     [("get_weather", {"city": "LA", "metric": "C"})]),
    ("llama4_pythonic", "<|python_start|>[foo(x=1])]<|python_end|>", "<|python_start|>[foo(x=1])]<|python_end|>", []),
    # mistral (vLLM: test_mistral_tool_parser.py), before v11
    ("mistral", "This is a test", "This is a test", []),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]', None, [("add", {"a": 3.5, "b": 4})]),
    ("mistral", '[TOOL_CALLS]  [ {"name":"add" , "arguments" : {"a": 3, "b": 4} } ]', None, [("add", {"a": 3, "b": 4})]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", '
     '"unit": "celsius"}}]', None, [("get_current_weather", SF)]),
    ("mistral", '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]', None,
     [("get_age", {"name": "John Doe"})]),
    ("mistral", '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": "get_current_weather", '
     '"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}}]', None,
     [("add", {"a": 3.5, "b": 4}), ("get_current_weather", SF)]),
    ("mistral", 'Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]', "Hello", [("add", {"a": 1, "b": 2})]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas", "state": "TX", '
     '"unit": "fahrenheit"}}]\nextra trailing data', "\nextra trailing data",  # vLLM's stream; its whole: None
     [("get_current_weather", {"city": "Dallas", "state": "TX", "unit": "fahrenheit"})]),
    ("mistral", "[TOOL_CALLS] not json at all", "[TOOL_CALLS] not json at all", []),  # vLLM: "not json at all"
    # v11 and v13
    ("mistral", '[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', None, [("add_this_and_that", {"a": 3.5, "b": 4})]),
    ("mistral", '[TOOL_CALLS]add{"a": 3.5, "b": 4}[TOOL_CALLS]multiply{"a": 3, "b": 6}', None,
     [("add", {"a": 3.5, "b": 4}), ("multiply", {"a": 3, "b": 6})]),
    ("mistral", 'bla[TOOL_CALLS]add_this_and_that{"a": 3.5, "b": 4}', "bla", [("add_this_and_that", {"a": 3.5, "b": 4})]),
    ("mistral", """hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r'{}')"}""", "hi{hi",
     [("bash", BASH)]),
    ("mistral", """hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r'{}')\"""",  # cut off:
     """hi{hi[TOOL_CALLS]bash{"command": "print(\\"hello world!\\")\\nre.compile(r'{}')\"""", []),  # vLLM: a call
    ("mistral", "[TOOL_CALLS]toolname_no_args", "[TOOL_CALLS]toolname_no_args", []),  # vLLM: no call, content None
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]now[CALL_ID]a1b2c3d4e[ARGS]{}', None,
     [("get_weather", {"city": "Paris"}), ("now", {})]),
    # deepseek_v3 (vLLM: test_deepseekv3_tool_parser.py)
    ("deepseek_v3", "How can I help you today? I can check weather for you.",
     "How can I help you today? I can check weather for you.", []),
    ("deepseek_v3", CALLS[0] + deepseek_call("get_weather", '{"city": "Tokyo", "unit": "celsius"}') + CALLS[1], None,
     [("get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    ("deepseek_v3", CALLS[0] + deepseek_call("get_weather", '{"city": "Tokyo", "unit": "celsius"}')
     + deepseek_call("search_hotels", '{"location": "Tokyo", "check_in": "2025-01-15"}') + CALLS[1], None,
     [("get_weather", {"city": "Tokyo", "unit": "celsius"}), ("search_hotels", {"location": "Tokyo", "check_in": "2025-01-15"})]),
    ("deepseek_v3", CALLS[0] + deepseek_call("test_function", '{"string_field": "hello", "int_field": 42, "float_field": '
     '3.14, "bool_field": true, "null_field": null, "array_field": ["a", "b", "c"], "object_field": {"nested": "value"}, '
     '"empty_array": [], "empty_object": {}}') + CALLS[1], None,
     [("test_function", {"string_field": "hello", "int_field": 42, "float_field": 3.14, "bool_field": True,
                         "null_field": None, "array_field": ["a", "b", "c"], "object_field": {"nested": "value"},
                         "empty_array": [], "empty_object": {}})]),
    ("deepseek_v3", CALLS[0] + deepseek_call("get_current_time", "{}") + CALLS[1], None, [("get_current_time", {})]),
    ("deepseek_v3", "Let me check the weather for you." + CALLS[0] + deepseek_call("get_weather", '{"city": "Paris"}')
     + CALLS[1], "Let me check the weather for you.", [("get_weather", {"city": "Paris"})]),
    ("deepseek_v3", CALLS[0] + deepseek_call("send_message", '{"text": "He said \\"hello\\"", "path": '
     '"C:\\\\Users\\\\file", "newline": "line1\\nline2"}') + CALLS[1], None,
     [("send_message", {"text": 'He said "hello"', "path": "C:\\Users\\file", "newline": "line1\nline2"})]),
    *[("deepseek_v3", bad, bad, []) for bad in (  # malformed: vLLM reports no call
        CALLS[0] + deepseek_call("get_weather", '{"city": "Tokyo"') + CALLS[1],
        CALLS[0] + 'function<｜tool▁sep｜>get_weather\n```json\n{"city": "Tokyo"}\n```' + CALLS[1])],
    # deepseek_v31 (vLLM: test_deepseekv31_tool_parser.py)
    ("deepseek_v31", "normal text" + CALLS[0] + CALL[0] + 'foo<｜tool▁sep｜>{"x":1}' + CALL[1] + CALLS[1], "normal text",
     [("foo", {"x": 1})]),
    ("deepseek_v31", "some prefix text" + CALLS[0] + CALL[0] + 'foo<｜tool▁sep｜>{"x":1}' + CALL[1] + CALL[0]
     + 'bar<｜tool▁sep｜>{"y":2}' + CALL[1] + CALLS[1] + " some suffix text", "some prefix text some suffix text",
     [("foo", {"x": 1}), ("bar", {"y": 2})]),  # vLLM: the suffix dropped
    *[("deepseek_v31", bad, bad, []) for bad in ("Let me look that up." + CALLS[0] + "get_weather",
                                                  CALLS[0] + 'foo<｜tool▁sep｜>{"x":1}' + CALLS[1])],
    # kimi_k2 (vLLM: test_kimi_k2_tool_parser.py); vLLM keeps the space before the calls in the content
    ("kimi_k2", "This is a test", "This is a test", []),
    ("kimi_k2", "I'll check. " + SECTION[0] + kimi_call("functions.get_weather:0", '{"city": "Beijing"}') + SECTION[1],
     "I'll check.", [("get_weather", {"city": "Beijing"})]),
    ("kimi_k2", "Multiple tasks. " + SECTION[0] + kimi_call("functions.get_weather:0", '{"city": "New York"}')
     + kimi_call("functions.get_news:1", '{"topic": "technology"}') + kimi_call(
         "functions.send_email:2", '{"to": "user@example.com", "subject": "Daily Update"}') + SECTION[1],
     "Multiple tasks.", [("get_weather", {"city": "New York"}), ("get_news", {"topic": "technology"}),
                         ("send_email", {"to": "user@example.com", "subject": "Daily Update"})]),
    ("kimi_k2", "Process HTML. " + SECTION[0] + kimi_call("functions.process_html:0", '{"html": "<div>content</div>"}')
     + SECTION[1], "Process HTML.", [("process_html", {"html": "<div>content</div>"})]),
    ("kimi_k2", "Formatted. " + SECTION[0] + kimi_call("functions.process_data:0", '{\n  "name": "test",\n  "value": 123\n}')
     + SECTION[1], "Formatted.", [("process_data", {"name": "test", "value": 123})]),
    ("kimi_k2", "No prefix. " + SECTION[0] + kimi_call("get_weather:0", '{"city": "Tokyo"}') + SECTION[1], "No prefix.",
     [("get_weather", {"city": "Tokyo"})]),
    ("kimi_k2", "Help. " + SECTION[0] + kimi_call("functions.invalid.0", '{"city": "Beijing"}')
     + kimi_call("functions.valid:1", '{"city": "Shanghai"}') + SECTION[1],  # vLLM drops the first block
     "Help. " + SECTION[0] + kimi_call("functions.invalid.0", '{"city": "Beijing"}'), [("valid", {"city": "Shanghai"})]),
]


def streamed(parser: str, text: str, cuts: list[int]) -> tuple[str | None, list[tuple[str, str]]]:
    """Content and (name, arguments) of `text` fed to the parser's reader in pieces of the `cuts`' sizes."""
    reader, content, calls, at = TOOL_PARSERS[parser](), "", [], 0
    for n in cuts:
        got, new = reader.feed(text[at:at + n])
        content, calls, at = content + got, calls + new, at + n
    got, new = reader.feed(text[at:])
    rest, more = reader.finish()
    return (content + got + rest) or None, [(c.name, c.arguments) for c in calls + new + more]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), CASES,
                         ids=[f"{case[0]}-{i}" for i, case in enumerate(CASES)])
def test_vllms_cases_whole_and_streamed(parser, text, content, calls) -> None:
    whole_content, whole_calls = parse_tool_calls(parser, text)
    assert whole_content == content
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == calls
    for c in whole_calls:  # vLLM's ids: Mistral's are 9 letters and digits, Kimi's its own `functions.NAME:i`
        if parser == "mistral":
            assert c.id.isalnum() and len(c.id) == 9
        else:
            assert c.id.startswith("call_") if parser != "kimi_k2" else re.fullmatch(rf"(functions\.)?{c.name}:\d", c.id)
    whole = (whole_content, [(c.name, c.arguments) for c in whole_calls])
    for size in range(1, 9):  # every delta size, up to one character at a time
        assert streamed(parser, text, [size] * (len(text) // size)) == whole


def json_call(name: str, arguments: dict, key: str = "parameters") -> str:
    return json.dumps({"name": name, key: arguments})


ARGS = st.dictionaries(st.sampled_from(["x", "y"]), st.integers(-5, 5), max_size=2)
NAMES = st.sampled_from(["f", "get_weather"])
PIECES = {
    "hermes": [st.builds(lambda n, a: f"<tool_call>\n{json_call(n, a, 'arguments')}\n</tool_call>", NAMES, ARGS),
               st.just("<tool_call>{not json}</tool_call>"), st.just("<tool_"), st.just("</tool_call>")],
    "llama3_json": [st.builds(json_call, NAMES, ARGS), st.just("<|python_tag|>"), st.just("<|pyth"), st.just("; "),
                    st.just('{"name": "f"}'), st.just('{"x": {"y": 1}}'), st.just('{"name": "f", "parameters": ')],
    "pythonic": [st.builds(lambda n, a: f"[{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})]", NAMES, ARGS),
                 st.just("[f(x='a)b'), g(y=[1, {'k': None}])]"), st.just("[f(1)]"), st.just("[f(x="),
                 st.just("[f(code=\'\'\'x = \"a\"\'\'\')]"), st.just('[f(a="""x""")]'),
                 st.just("'''"), st.just("[link](u)")],
    "llama4_pythonic": [st.builds(lambda n, a: f"[{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})]", NAMES, ARGS),
                        st.just("<|python_start|>"), st.just("<|python_end|>"), st.just("<|python_"), st.just("[f(1)]")],
    "mistral": [st.builds(lambda n, a: f"[TOOL_CALLS]{n}{json.dumps(a)}", NAMES, ARGS),
                st.builds(lambda n, a: f"[TOOL_CALLS][{json_call(n, a, 'arguments')}]", NAMES, ARGS),
                st.builds(lambda n, a: f"[TOOL_CALLS]{n}[ARGS]{json.dumps(a)}", NAMES, ARGS),
                st.just("[TOOL_CALLS]"), st.just("[TOOL_"), st.just("[ARGS]"), st.just("[CALL_ID]ab")],
    "deepseek_v3": [st.builds(lambda n, a: deepseek_call(n, json.dumps(a)), NAMES, ARGS), st.sampled_from(CALLS + CALL),
                    st.just("<｜tool▁"), st.just("function<｜tool▁sep｜>f\n```json\n{}\n```")],
    "kimi_k2": [st.builds(lambda n, a: kimi_call(f"functions.{n}:0", json.dumps(a)), NAMES, ARGS),
                st.sampled_from(SECTION), st.just("<|tool_call_begin|>"), st.just("<|tool_call_end|>"), st.just("<|tool_")],
    "deepseek_v31": [st.builds(lambda n, a: f"{CALL[0]}{n}<｜tool▁sep｜>{json.dumps(a)}{CALL[1]}", NAMES, ARGS),
                     st.sampled_from(CALLS + CALL), st.just("<｜tool▁"), st.just("f<｜tool▁sep｜>{")],
    # gpt-oss's harmony messages (their own cases: tests/test_harmony.py)
    "openai": [st.builds(lambda n, a: f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json"
                                      f"<|message|>{json.dumps(a)}<|call|>", NAMES, ARGS),
               st.sampled_from(["<|channel|>analysis<|message|>", "<|channel|>final<|message|>", "<|end|>",
                                "<|start|>assistant", "<|return|>", "<|chan", " to=functions.f", "<|message|>"])],
}
FILLER = st.text(alphabet=st.sampled_from(list("ab <>/_\n{}[]()\"';=,|")), max_size=12)


@pytest.mark.parametrize("parser", sorted(PIECES))
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_streamed_reading_equals_the_whole_reading(parser: str, data) -> None:
    text = "".join(data.draw(st.lists(st.one_of(FILLER, *PIECES[parser]), max_size=6)))
    cuts = data.draw(st.lists(st.integers(1, 8), max_size=40))
    whole_content, whole_calls = parse_tool_calls(parser, text)
    assert streamed(parser, text, cuts) == (whole_content, [(c.name, c.arguments) for c in whole_calls])


def test_every_parser_is_tested() -> None:
    assert set(PIECES) | {"llama4_json"} == set(TOOL_PARSERS)
    # hermes' cases: tests/test_tool_calls.py; openai's: tests/test_harmony.py
    assert {case[0] for case in CASES} == set(PIECES) - {"hermes", "openai"}


@pytest.mark.parametrize(("parser", "text"), [
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": ' + "[" * 5000 + "]" * 5000 + "}}</tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": {"a": ' + "[" * 5000 + "]" * 5000 + "}}"),
    ("mistral", "[TOOL_CALLS][" + "[" * 5000 + "]" * 5000 + "]"),
    ("pythonic", "[f(x=" + "[" * 5000 + "]" * 5000 + ")]")])
def test_a_call_nested_too_deep_to_read_is_content_not_an_error(parser: str, text: str) -> None:
    assert parse_tool_calls(parser, text) == (text, [])
