"""A config value checked against its field's type hint: the few lossless conversions YAML and
`key=value` overrides need (an int where a float is expected, `1e-5` that YAML 1.1 reads as text, a
scalar for a one-element list), and nothing else, so a wrong type is caught at load with its key.
"""

from __future__ import annotations

import json
import re
import types
from typing import Any, Literal, Union, get_args, get_origin

import yaml

# PyYAML follows YAML 1.1, where `1e-5` (no dot) is a string; a float field takes it anyway.
FLOAT_TEXT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
MISSING = object()


def describe(hint: Any) -> str:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):
        if len(args) == 2 and args[1] == list[args[0]]:  # one value or a list of them (DPO's loss_type)
            return f"{describe(args[0])}, or a list of them"
        return " or ".join("null" if a is type(None) else describe(a) for a in args)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of {describe(args[0])}"
    if origin is dict:
        return "a mapping of key: value (or its JSON text)"
    return getattr(hint, "__name__", str(hint))


def coerce(value: Any, hint: Any) -> Any:
    """`value` as an instance of `hint`, or MISSING. Only lossless conversions: int to float,
    float text to float (see FLOAT_TEXT), a scalar to a one-element list, null or JSON text to a mapping."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is type(None):
        return None if value is None else MISSING
    if origin in (Union, types.UnionType):
        for arm in args:
            out = coerce(value, arm)
            if out is not MISSING:
                return out
        return MISSING
    if origin is Literal:
        return value if any(value == a and type(value) is type(a) for a in args) else MISSING
    if origin is list:
        items = value if isinstance(value, list) else [value]
        out = [coerce(v, args[0]) for v in items]
        return MISSING if any(v is MISSING for v in out) else out
    if origin is dict:  # transformers' dict fields: null for none, a mapping, or its JSON text (as its CLI takes)
        if value is None:
            return {}
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                return MISSING
        return dict(value) if isinstance(value, dict) and all(isinstance(k, str) for k in value) else MISSING
    if hint is bool:
        return value if isinstance(value, bool) else MISSING
    if hint is int:
        return value if isinstance(value, int) and not isinstance(value, bool) else MISSING
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        return float(value) if isinstance(value, str) and FLOAT_TEXT.match(value.strip()) else MISSING
    if hint is str:
        return value if isinstance(value, str) else MISSING
    raise TypeError(f"config fields of type {hint!r} are not supported by load_config")


class _UniqueKeys(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (the loader would keep the last
    quietly: a config with `learning_rate` twice trains at whichever came second)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} appears twice (lines {seen[key]} and {line})", key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep)


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, with a key given twice in a mapping refused (yaml.YAMLError naming both lines)."""
    return yaml.load(text, Loader=_UniqueKeys)
