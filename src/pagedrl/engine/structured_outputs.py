"""What a request's output must look like: a JSON schema, any JSON object, a regex, one of a few
choices, or a grammar (vLLM's `StructuredOutputsParams`, once `GuidedDecodingParams`).

The constraint becomes a grammar in llguidance's format here (`grammar_text`), and a per-sequence
token mask in `grammar.py`; the sampler applies that mask before temperature and truncation, so the
drawn-from distribution (and its processed log-probs) is the constrained one.

A `grammar` is Lark, as llguidance reads it (`start: "yes" | "no"`), or GBNF (`root ::= ...`, the
format of llama.cpp and of vLLM's xgrammar back-end), which is converted to Lark.

A `json` schema is read as vLLM's default back-end reads it: an object allows only the properties it
lists unless it says `additionalProperties` (`json_schema.py` says why); `json_object` is any object.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedrl.engine.json_schema import endless_ref, strict_objects

KINDS = ("json", "regex", "choice", "grammar", "json_object")


def _bad(name: str, requirement: str, value: Any) -> ValueError:
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return ValueError(f"structured_outputs.{name} {requirement}, got {shown}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of `json` (a JSON schema, as a dict or its JSON text), `regex`, `choice` (the
    output is one of these strings), `grammar` (Lark or GBNF) or `json_object=True` (any JSON
    object). `disable_any_whitespace` asks for JSON without free whitespace between tokens (it
    keeps small models from filling their budget with blank lines)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # Set by the server, not the request: the grammar starts after the first of these tokens is sampled
    # (a thinking model's end of reasoning, as vLLM's structured outputs wait for its reasoning parser's
    # end); until then the output is free. Empty: the grammar holds from the first token.
    reasoning_end_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    schema = json.loads(self.json)
                except json.JSONDecodeError as e:
                    raise _bad("json", f"is not valid JSON ({e})", self.json) from None
            else:
                schema = self.json
            if not isinstance(schema, (dict, bool)) or isinstance(self.json, bool):
                raise _bad("json", "must be a JSON schema (an object)", self.json)
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise _bad("regex", "must be a non-empty string", self.regex)
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise _bad("choice", "must be a non-empty list of non-empty strings", self.choice)
            object.__setattr__(self, "choice", list(self.choice))
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise _bad("grammar", "must be a non-empty string", self.grammar)
        if self.json_object not in (None, True, False):
            raise _bad("json_object", "must be a bool", self.json_object)
        if not isinstance(self.disable_any_whitespace, bool):
            raise _bad("disable_any_whitespace", "must be a bool", self.disable_any_whitespace)
        if not all(isinstance(t, int) and t >= 0 for t in self.reasoning_end_token_ids):
            raise _bad("reasoning_end_token_ids", "must be token ids", self.reasoning_end_token_ids)

    @property
    def kind(self) -> str:
        """Which constraint this is: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """The constraint as text: equal constraints compile once. Keys keep their order, since the
        order of a schema's properties is the order the output writes them in."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.disable_any_whitespace])

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> StructuredOutputsParams:
        """From vLLM's request field `structured_outputs` (unknown keys refused, naming them)."""
        known = set(KINDS) | {"disable_any_whitespace"}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ValueError(f"structured_outputs.{unknown[0]} is not supported (known: {', '.join(sorted(known))})")
        return cls(**fields)


# vLLM's name for the same thing before it was renamed.
GuidedDecodingParams = StructuredOutputsParams


def _lark_literal(text: str) -> str:
    # Lark string literals take JSON's escapes; JSON text of a str is therefore a valid literal.
    return json.dumps(text)


def compiled_schema(params: StructuredOutputsParams) -> Any:
    """The JSON schema of a `json` constraint as it is compiled: objects allow only the properties
    they list unless they say otherwise (`json_schema.strict_objects`, vLLM's default reading)."""
    return strict_objects(json.loads(params.json) if isinstance(params.json, str) else params.json)


def unenforceable(params: StructuredOutputsParams) -> str | None:
    """Why a constraint that compiles could still never be met (a `json` schema no finite value
    matches), as the end of an error message; None when nothing is known against it."""
    if params.kind != "json":
        return None
    ref = endless_ref(compiled_schema(params))
    if ref is None:
        return None
    return (f"no finite JSON value matches it: {ref!r} refers back to itself with no way out (a value there "
            "would have to contain another one, without end)")


# `\d`, `\w` and `\s` as ASCII classes, as vLLM's grammar back-ends and JSON Schema's `pattern` read
# them (the regex engine underneath reads them as Unicode classes: `\d` would match "١٢٣" or "🯸").
_ASCII = {"d": "0-9", "w": "0-9A-Za-z_", "s": " \\t\\n\\r\\f\\v"}


def ascii_classes(pattern: str) -> str:
    r"""`pattern` with `\d \w \s` (and `\D \W \S` outside brackets) written as ASCII classes; escaped
    backslashes and everything else untouched."""
    out, i, depth = [], 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            e = pattern[i + 1]
            if e.lower() in _ASCII and (depth == 0 or e.islower()):
                chars = _ASCII[e.lower()]
                out.append(chars if depth else f"[{'^' if e.isupper() else ''}{chars}]")
            else:
                out.append(c + e)
            i += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]" and depth:
            depth -= 1
        out.append(c)
        i += 1
    return "".join(out)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (not yet checked: `grammar.GrammarCompiler` does that)."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    kind = params.kind
    options = {"whitespace_flexible": not params.disable_any_whitespace}
    if kind == "json":
        return LLMatcher.grammar_from_json_schema(compiled_schema(params), defaults=options)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(ascii_classes(params.regex))
    if kind == "choice":
        return LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_literal(c) for c in params.choice))
    try:
        lark = any_to_lark(params.grammar)
    except Exception as e:  # the converter raises its own error types for malformed GBNF
        raise _bad("grammar", f"is neither Lark nor GBNF ({e})", params.grammar) from None
    return LLMatcher.grammar_from_lark(lark)
