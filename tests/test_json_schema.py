"""How a JSON schema is read before it is compiled (`engine/json_schema.py`): objects closed unless
they say otherwise, `#...` pointers relocated with their schema, and the schemas no finite value
matches found before any request holds them; then the same rules seen through the grammar compiler
with the default model's tokenizer."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from pagedrl.engine.grammar import GrammarCompiler
from pagedrl.engine.json_schema import endless_ref, relocated, strict_objects
from pagedrl.engine.structured_outputs import StructuredOutputsParams

LANGCHAIN = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
             "required": ["city"]}


class Point(BaseModel):
    x: int


class Shape(BaseModel):
    corners: list[Point]
    name: str | None = None


@pytest.fixture(scope="module")
def compiler(default_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(default_tokenizer.backend.to_str(), 49152, [default_tokenizer.eos_token_id])


def test_objects_allow_only_their_listed_properties_unless_they_say_otherwise() -> None:
    """vLLM's default reading (xgrammar's strict mode), for every schema whichever field carries it."""
    assert strict_objects(LANGCHAIN) == {**LANGCHAIN, "additionalProperties": False}
    assert "additionalProperties" not in LANGCHAIN  # a copy, the client's schema untouched
    for other in (True, {"type": "integer"}):
        assert strict_objects({**LANGCHAIN, "additionalProperties": other})["additionalProperties"] == other
    pydantic = strict_objects(Shape.model_json_schema())
    assert pydantic["additionalProperties"] is False and pydantic["$defs"]["Point"]["additionalProperties"] is False
    # data is not a schema; parts of an intersection are left open (closing each would refuse the others' keys)
    data = {"const": {"type": "object", "properties": {}}}
    assert strict_objects({"type": "object", "properties": {"k": data}})["properties"]["k"] == data
    split = {"allOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}
    assert strict_objects(split) == split
    assert strict_objects({"$ref": "#/$defs/A", "properties": {"b": {}}}) == {"$ref": "#/$defs/A", "properties": {"b": {}}}
    pair = {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}
    assert strict_objects(pair) == {**pair, "items": False}
    either = strict_objects({"anyOf": [{"type": "object", "properties": {"a": {}}}, {"type": "null"}]})
    assert either["anyOf"][0]["additionalProperties"] is False


def test_relocated_pointers_keep_their_meaning() -> None:
    schema = {"$ref": "#", "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"$ref": "other.json#/x"}},
              "$defs": {"A": {"items": [{"$ref": "#/$defs/A"}]}}}
    assert relocated(schema, "#/$defs/tool0") == {
        "$ref": "#/$defs/tool0", "properties": {"a": {"$ref": "#/$defs/tool0/$defs/A"}, "b": {"$ref": "other.json#/x"}},
        "$defs": {"A": {"items": [{"$ref": "#/$defs/tool0/$defs/A"}]}}}


@pytest.mark.parametrize(("schema", "endless"), [
    ({"$ref": "#"}, "#"),
    ({"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}, "#"),
    ({"type": "array", "minItems": 1, "items": {"$ref": "#"}}, "#"),
    ({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"$ref": "#/$defs/A"}}, "$ref": "#/$defs/A"}, "#/$defs/A"),
    ({"type": "object", "properties": {"x": {"$ref": "#/$defs/L"}}, "$defs": {"L": {"$ref": "#/$defs/L"}}},
     "#/$defs/L"),  # optional, but the model may start it and never finish
    ({"type": "object", "properties": {"me": {"$ref": "#"}}}, None),
    ({"anyOf": [{"$ref": "#"}, {"type": "null"}]}, None),
    ({"type": "array", "items": {"$ref": "#"}}, None),
    ({"$defs": {"A": {"$ref": "#/$defs/B"}, "B": {"anyOf": [{"$ref": "#/$defs/A"}, {"type": "integer"}]}},
      "$ref": "#/$defs/A"}, None),
    (Shape.model_json_schema(), None),
])
def test_endless_refs_are_found(schema, endless) -> None:
    assert endless_ref(schema) == endless


def accepts(compiler: GrammarCompiler, tokenizer, schema: dict, text: str) -> bool:
    return accepts_with(compiler, tokenizer, StructuredOutputsParams(json=schema, disable_any_whitespace=True), text)


def accepts_with(compiler: GrammarCompiler, tokenizer, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the constraint's grammar takes `text`'s tokens one by one and is complete after them."""
    matcher = compiler.matcher(params)
    try:
        for token in tokenizer.encode(text):
            matcher.accept(token)
    except RuntimeError:
        return False
    return matcher.is_accepting


def test_the_grammar_refuses_an_unlisted_key(compiler, default_tokenizer) -> None:
    assert accepts(compiler, default_tokenizer, LANGCHAIN, '{"city":"Oslo","unit":"c"}')
    assert not accepts(compiler, default_tokenizer, LANGCHAIN, '{"city":"Oslo","b":1}')
    assert accepts(compiler, default_tokenizer, {**LANGCHAIN, "additionalProperties": True}, '{"city":"Oslo","b":1}')
    assert not accepts(compiler, default_tokenizer, Shape.model_json_schema(), '{"corners":[{"x":1,"y":2}]}')


@pytest.mark.parametrize(("params", "reason"), [
    (StructuredOutputsParams(json={"$ref": "#"}), "no finite JSON value matches it"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"me": {"$ref": "#"}}, "required": ["me"]}),
     "no finite JSON value matches it"),
    (StructuredOutputsParams(grammar="start: a\na: a"), "its grammar fails before the first token"),
])
def test_a_constraint_that_can_never_be_met_is_refused_when_compiled(compiler, params, reason) -> None:
    with pytest.raises(ValueError, match=f"structured_outputs.{params.kind} cannot be enforced: {reason}"):
        compiler.check(params)


def regex_accepts(compiler: GrammarCompiler, tokenizer, regex: str, text: str) -> bool:
    return accepts_with(compiler, tokenizer, StructuredOutputsParams(regex=regex), text)


@pytest.mark.parametrize(("regex", "ascii_text", "other"), [
    (r"\d{3}-\d{4}", "555-0123", "١٢٣-٤٥٦٧"), (r"[\d]+", "42", "４２"), (r"\w+", "snake_case9", "日本"),
    (r"a\sb", "a b", "a\u2003b"), (r"\D", "x", "5"),
])
def test_regex_classes_are_ascii_as_in_json_schema_patterns(compiler, default_tokenizer, regex, ascii_text,
                                                            other) -> None:
    """`\\d`, `\\w`, `\\s` as vLLM's grammar back-ends and JSON Schema's `pattern` read them: ASCII."""
    assert regex_accepts(compiler, default_tokenizer, regex, ascii_text)
    assert not regex_accepts(compiler, default_tokenizer, regex, other)
    assert regex_accepts(compiler, default_tokenizer, r"\\d", "\\d")  # an escaped backslash stays one


def test_an_object_requiring_a_key_it_does_not_list_stays_open(compiler, default_tokenizer) -> None:
    needs_a = {"type": "object", "required": ["a"]}
    assert strict_objects(needs_a) == needs_a  # closing it would refuse "a" itself
    assert accepts(compiler, default_tokenizer, needs_a, '{"a":1}')
    assert not accepts(compiler, default_tokenizer, needs_a, '{"b":1}')
    partly = {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["a", "b"]}
    assert "additionalProperties" not in strict_objects(partly)
