"""Tool schemas as clients write them, through a real `pagedrl serve` of the default model
(SmolLM2-135M): pydantic's (nested models under `$defs`, optional fields, a recursive model) and
LangChain's (no `additionalProperties`). Under `tool_choice` "required" and a named function every
one of 20 sampled answers must end as a call whose arguments validate: a small model left free to add
unlisted keys never stops adding them. A schema no finite value matches (`{"$ref": "#"}`) is a 400
naming the request's field on every route that constrains decoding to it, before the request is admitted;
under `auto` and `none` a tool's schema constrains nothing and is not compiled."""

from __future__ import annotations

import json

import httpx
import jsonschema_rs
import pytest
from pydantic import BaseModel, Field
from server_process import running_server


class City(BaseModel):
    name: str = Field(max_length=12)


class Trip(BaseModel):
    start: City
    end: City
    nights: int = Field(ge=1, le=14)
    by_train: bool | None = None


class Step(BaseModel):
    say: str = Field(max_length=10)
    then: Step | None = None


LANGCHAIN = {"type": "object", "properties": {  # what LangChain's convert_to_openai_tool writes for a function
    "city": {"type": "string", "description": "The city"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}}, "required": ["city"]}
SCHEMAS = {"plan_trip": Trip.model_json_schema(), "get_weather": LANGCHAIN, "say_steps": Step.model_json_schema()}
ASK = {"plan_trip": "Plan a 3-night trip from Paris to Rome.", "get_weather": "What is the weather in Oslo?"}
TOOLS = [{"type": "function", "function": {"name": name, "description": name.replace("_", " "), "parameters": schema}}
         for name, schema in SCHEMAS.items()]
ENDLESS = {"$ref": "#"}


@pytest.fixture(scope="module")
def server(default_model_dir, tmp_path_factory):
    with running_server(default_model_dir, tmp_path_factory.mktemp("serve-tool-schemas"), "--kv-cache-tokens",
                        "8192", "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as s:
        yield s


def calls(client, model, name: str, choice, tools: list[dict], n: int = 20) -> list:
    """n sampled answers of the default model to the tool's question."""
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": ASK[name]}], tools=tools,
                                          tool_choice=choice, n=n, temperature=0.8, seed=0, max_tokens=100,
                                          parallel_tool_calls=False).choices


def valid(name: str, arguments: str) -> bool:
    return jsonschema_rs.validator_for(SCHEMAS[name]).is_valid(json.loads(arguments))


@pytest.mark.parametrize("name", ["plan_trip", "get_weather"])
@pytest.mark.parametrize("required", [True, False], ids=["required", "named"])
def test_every_sampled_call_ends_and_validates(client, model, name, required) -> None:
    """pydantic's nested models and optional fields, LangChain's open objects: 20 answers out of 20
    end as one call whose arguments validate."""
    choice = "required" if required else {"type": "function", "function": {"name": name}}
    for c in calls(client, model, name, choice, [t for t in TOOLS if t["function"]["name"] == name]):
        assert c.finish_reason == "tool_calls", (c.finish_reason, c.message)
        (call,) = c.message.tool_calls
        assert call.function.name == name and valid(name, call.function.arguments), call.function.arguments


def test_required_chooses_among_tools_with_defs_of_their_own(client, model) -> None:
    """Three tools, two with `$defs` (one recursive, which the model may nest until max_tokens): the
    request is served, and every call that ends is valid under its own tool's schema."""
    ended = [c for c in calls(client, model, "plan_trip", "required", TOOLS, n=8) if c.finish_reason == "tool_calls"]
    assert ended
    for c in ended:
        (call,) = c.message.tool_calls
        assert valid(call.function.name, call.function.arguments), call


def tool(schema: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": schema}}]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
NAMED = {"type": "function", "function": {"name": "f"}}
REFUSED = [
    ("chat/completions", {**CHAT, "tools": tool(ENDLESS), "tool_choice": "required"}, "tools.0.function.parameters"),
    ("chat/completions", {**CHAT, "tools": tool(ENDLESS), "tool_choice": NAMED}, "tools.0.function.parameters"),
    ("chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": ENDLESS}}}, "response_format.json_schema.schema"),
    ("chat/completions", {**CHAT, "structured_outputs": {"json": ENDLESS}}, "structured_outputs.json"),
    ("completions", {"prompt": "hi", "max_tokens": 4, "guided_json": ENDLESS}, "guided_json"),
    ("completions", {"prompt": "hi", "max_tokens": 4, "structured_outputs": {"json": ENDLESS}},
     "structured_outputs.json"),
    ("completions", {"prompt": "hi", "max_tokens": 4, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}}}},
     "response_format.json_schema.schema"),
]


@pytest.mark.parametrize(("route", "body", "param"), REFUSED)
def test_a_schema_no_finite_value_matches_is_400_on_every_route(server, model, route, body, param) -> None:
    r = httpx.post(f"{server.base_url}/v1/{route}", json={"model": model, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and "finite" in error["message"], error
    assert server.wait_idle()["pagedrl:num_requests_running"] == 0
    ok = httpx.post(f"{server.base_url}/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2},
                    timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("choice", ["auto", "none", {"type": "function", "function": {"name": "g"}}])
def test_tools_that_constrain_nothing_are_not_compiled(server, model, choice) -> None:
    """Under auto and none (and a named choice of another tool) a tool's schema constrains nothing: one
    the grammar could not build (`uniqueItems`, or no finite value) is no reason to refuse, as in vLLM."""
    tools = [*tool({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"},
                                                              "uniqueItems": True}}}),
             {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {}}}},
             {"type": "function", "function": {"name": "h", "parameters": ENDLESS}}]
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json={"model": model, **CHAT, "tools": tools,
                                                                    "tool_choice": choice}, timeout=60)
    assert r.status_code == 200, r.text
