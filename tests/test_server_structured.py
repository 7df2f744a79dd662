"""Structured outputs through a real `pagedrl serve` process and the official `openai` client:
OpenAI's `response_format`, vLLM's `structured_outputs` and its older `guided_*` fields, streamed and
not, and the 400s (naming the field) for constraints that do not compile, after which the server
keeps serving. The model is random: only the mask makes its answers valid."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema_rs
import pytest
from pydantic import BaseModel
from server_process import running_server

CHAT = [{"role": "user", "content": "describe a pet"}]
SCHEMA = {"type": "object", "properties": {
    "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer",
                                                                                     "minimum": 0, "maximum": 20}},
            "required": ["kind", "age"], "additionalProperties": False},
    "tags": {"type": "array", "items": {"enum": ["calm", "loud"]}, "maxItems": 2},
    "vaccinated": {"type": "boolean"}},
    "required": ["pet", "tags", "vaccinated"], "additionalProperties": False}
LIST_SCHEMA = {"type": "array", "minItems": 1, "maxItems": 3, "items": {
    "type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "labels": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2}},
    "required": ["id", "labels"], "additionalProperties": False}}
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}  # a random model would pad with spaces


@pytest.fixture(scope="module")
def server(tiny_train_model, tmp_path_factory):
    with running_server(tiny_train_model, tmp_path_factory.mktemp("serve-structured"),
                        "--kv-cache-tokens", "4096") as s:
        yield s


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}


@pytest.mark.parametrize("schema", [SCHEMA, LIST_SCHEMA])
def test_chat_json_schema_validates_streamed_and_not(client, model, schema) -> None:
    validator = jsonschema_rs.validator_for(schema)
    for seed in (0, 1, 2):
        resp = client.chat.completions.create(model=model, messages=CHAT, max_tokens=80, seed=seed,
                                              response_format=json_schema_format(schema), extra_body=COMPACT)
        choice = resp.choices[0]
        assert choice.finish_reason == "stop" and validator.is_valid(json.loads(choice.message.content))
        stream = client.chat.completions.create(model=model, messages=CHAT, max_tokens=80, seed=seed, stream=True,
                                                response_format=json_schema_format(schema), extra_body=COMPACT)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == choice.message.content  # the same seed: the same answer, streamed


class Owner(BaseModel):
    title: Literal["mr", "ms", "dr"]


class Pet(BaseModel):
    kind: Literal["cat", "dog"]
    vaccinated: bool
    owner: Owner


def test_openai_parse_with_a_pydantic_model(client, model) -> None:
    """The client's own path: `parse` turns the model into a strict json_schema (with `$defs`) and
    reads the answer back into it."""
    for seed in (0, 1):
        resp = client.chat.completions.parse(model=model, messages=CHAT, response_format=Pet, max_tokens=60,
                                             seed=seed, extra_body=COMPACT)
        assert isinstance(resp.choices[0].message.parsed, Pet)


def test_json_object_and_completions_with_vllm_fields(client, model) -> None:
    resp = client.chat.completions.create(model=model, messages=CHAT, max_tokens=60, temperature=1.0, seed=1,
                                          response_format={"type": "json_object"}, extra_body=COMPACT)
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    else:
        assert resp.choices[0].message.content.startswith("{")
    choices = ["positive", "negative", "neutral"]
    chat = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10,
                                          extra_body={"structured_outputs": {"choice": choices}})
    assert chat.choices[0].message.content in choices
    comp = client.completions.create(model=model, prompt="the cat", max_tokens=10, n=3, temperature=1.0, seed=4,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}})
    assert all(re.fullmatch("[0-9]{2}:[0-9]{2}", c.text) for c in comp.choices)
    legacy = client.completions.create(model=model, prompt="the cat", max_tokens=10,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert legacy.choices[0].text in ("yes", "no")
    legacy = client.completions.create(model=model, prompt="the cat", max_tokens=80,
                                       extra_body={"guided_json": SCHEMA, **COMPACT})
    assert jsonschema_rs.validator_for(SCHEMA).is_valid(json.loads(legacy.choices[0].text))
    regex = client.completions.create(model=model, prompt="the cat", max_tokens=10,
                                      extra_body={"guided_regex": "(ab|cd)+!"})
    assert re.fullmatch("(ab|cd)+!", regex.choices[0].text) or regex.choices[0].finish_reason == "length"
    grammar = client.completions.create(model=model, prompt="the cat", max_tokens=10,
                                        extra_body={"guided_grammar": 'root ::= "a" [0-9] "z"'})
    assert re.fullmatch("a[0-9]z", grammar.choices[0].text)


@pytest.mark.parametrize(("body", "param"), [
    ({"response_format": json_schema_format({"type": "bogus"})}, "response_format.json_schema.schema"),
    ({"response_format": json_schema_format({"$ref": "#/nowhere"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"guided_regex": "[z-a]"}, "guided_regex"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json"),
    ({"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regexp": "a+"}}, "structured_outputs.regexp"),  # a typo: never free text
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_json": {"type": "object"}, "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
])
def test_bad_constraints_are_400_naming_the_field_and_the_server_keeps_serving(server, model, body, param) -> None:
    for path, base in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "hi"})):
        r = httpx.post(server.base_url + path, json={"model": model, "max_tokens": 5, **base, **body}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param, error
        assert param.split(".")[0] in error["message"]
    ok = httpx.post(server.base_url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2},
                    timeout=30)
    assert ok.status_code == 200


def test_openapi_declares_the_structured_output_fields(server) -> None:
    schemas = httpx.get(server.base_url + "/openapi.json").json()["components"]["schemas"]
    for name in ("ChatCompletionRequest", "CompletionRequest"):
        props = schemas[name]["properties"]
        for field in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar"):
            assert field in props, (name, field)
    assert set(schemas["ResponseFormat"]["properties"]["type"]["enum"]) == {"text", "json_object", "json_schema"}
    assert {"json", "regex", "choice", "grammar", "json_object"} <= set(schemas["StructuredOutputsRequest"]["properties"])
    assert "schema" in schemas["JsonSchemaFormat"]["properties"]
