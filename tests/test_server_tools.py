"""Tool calling through a real `pagedrl serve --enable-auto-tool-choice` process and the official
`openai` client. The model is random, so what it calls is whatever the constraint allows:
`required` and a named function must give arguments valid under the tool's schema on every sample;
`auto` is driven to write a Hermes block by a regex constraint, and must come back parsed; streamed
tool-call deltas must reassemble to the non-streamed call of the same seed."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import pytest
from server_process import running_server

CHAT = [{"role": "user", "content": "what is the weather in a city"}]
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now", "parameters": TIME}}]
SCHEMAS = {"get_weather": CITY, "get_time": TIME}
HERMES = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "days": [1-7]\}\}</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny_train import build_model_dir

    # the tools' listing alone is ~900 of this tokenizer's tokens: a context longer than the usual 256
    model = build_model_dir(tmp_path_factory.mktemp("tools-model") / "model", max_position_embeddings=2048)
    with running_server(model, tmp_path_factory.mktemp("serve-tools"), "--kv-cache-tokens", "16384",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as s:
        yield s


def valid_call(call) -> bool:
    schema = SCHEMAS.get(call.function.name)
    return schema is not None and jsonschema_rs.validator_for(schema).is_valid(json.loads(call.function.arguments))


def reassemble(stream) -> tuple[str, list[tuple[str, str]], str | None]:
    """Content, (name, arguments) of each call, and finish reason of a streamed choice 0."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for d in delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or d.id
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
            finish = choice.finish_reason or finish
    assert all(c["id"] for c in calls.values())
    return content, [(c["name"], c["arguments"]) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_required_and_named_calls_always_validate(client, model, choice) -> None:
    """20 sampled answers each (temperature 1): every one is a call of a given tool whose arguments
    validate against its schema, with finish_reason tool_calls."""
    out = client.chat.completions.create(model=model, messages=CHAT, tools=TOOLS, tool_choice=choice, n=20,
                                         temperature=1.0, seed=3, max_tokens=60, parallel_tool_calls=False)
    assert len(out.choices) == 20
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None
        assert len(c.message.tool_calls) == 1 and valid_call(c.message.tool_calls[0]), c.message
        assert c.message.tool_calls[0].id.startswith("call_")
        if isinstance(choice, dict):
            assert c.message.tool_calls[0].function.name == "get_time"
    assert len({c.message.tool_calls[0].function.arguments for c in out.choices}) > 1  # sampled, not fixed


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_reassemble_to_the_whole_call(client, model, choice) -> None:
    args = dict(model=model, messages=CHAT, tools=TOOLS, tool_choice=choice, temperature=1.0, seed=11, max_tokens=60,
                parallel_tool_calls=False)  # a random model would add calls until max_tokens
    whole = client.chat.completions.create(**args).choices[0]
    content, calls, finish = reassemble(client.chat.completions.create(**args, stream=True))
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert (content or None, finish) == (whole.message.content, whole.finish_reason) == (None, "tool_calls")


def test_auto_parses_a_hermes_call_streamed_and_not(client, model) -> None:
    """The regex makes the random model write a Hermes block; the server reads it out as a call."""
    args = dict(model=model, messages=CHAT, tools=TOOLS, temperature=1.0, seed=5, max_tokens=200,
                extra_body={"structured_outputs": {"regex": "Checking\\. " + HERMES}})
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Checking."
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather" and valid_call(call)
    content, calls, finish = reassemble(client.chat.completions.create(**args, stream=True))
    assert (content, calls, finish) == ("Checking.", [(call.function.name, call.function.arguments)], "tool_calls")


def test_auto_and_none_without_a_call_answer_text(client, model) -> None:
    for choice in ("auto", "none"):
        out = client.chat.completions.create(model=model, messages=CHAT, tools=TOOLS, tool_choice=choice,
                                             max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
        c = out.choices[0]
        assert c.finish_reason == "length" and c.message.content and not c.message.tool_calls


def test_a_tool_result_in_the_history_is_answered(client, model) -> None:
    history = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"forecast": "sunny"}'}]
    out = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=4,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens > 50 and out.choices[0].finish_reason == "length"


@pytest.mark.parametrize(("tools", "choice", "param"), [
    ([TOOLS[0], {"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"a": {"type": "nope"}}}}}], "required", "tools.1.function.parameters"),
    ([{"type": "function", "function": {"name": "bad", "parameters": {"type": "string"}}}], "none",
     "tools.0.function.parameters"),
    ([{"type": "function", "function": {"name": "has space"}}], "none", "tools.0.function.name"),
    ([{"type": "retrieval"}], "none", "tools.0.type"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
])
def test_bad_tools_are_400_naming_the_field(server, model, tools, choice, param) -> None:
    r = httpx.post(server.base_url + "/v1/chat/completions", timeout=30,
                   json={"model": model, "messages": CHAT, "tools": tools, "tool_choice": choice, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    if param.startswith("tools.1"):
        assert "tools[1]" in error["message"]
    both = httpx.post(server.base_url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": CHAT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 2,
        "response_format": {"type": "json_object"}})
    assert both.status_code == 400 and both.json()["error"]["param"] == "tool_choice"
