"""What a JSON schema is made to mean before llguidance compiles it, and which schemas cannot be
enforced at all.

Strictness (`strict_objects`): an object schema that does not say `additionalProperties` allows
only the properties it lists, and an array with `prefixItems` and no `items` only those items. This
is how vLLM reads schemas by default: its default back-end, xgrammar, compiles JSON schemas in
`strict_mode` (unlisted properties and items not allowed), and its llguidance back-end, which reads
them as JSON Schema does, has `disable_additional_properties` to match it. The rule applies to
every schema alike, tool parameters under `tool_choice` "required" or a named function and
`response_format` json_schema, `structured_outputs.json` and `guided_json`: one reading of a schema
whichever field carries it, the one a client tested against vLLM expects, and OpenAI's strict
structured outputs ask for `additionalProperties: false` everywhere anyway. Without it a schema that
merely leaves its objects open (LangChain's tools, pydantic's models, most hand-written schemas)
lets a small model add keys until max_tokens, and the answer never parses. A schema that wants other
keys says so (`additionalProperties: true` or a schema) and gets them. Objects whose properties are
spread over `allOf`, `$ref` siblings or `if`/`then`/`else` are left as written: closing each part
would refuse the keys of the others.

Enforceability (`endless_ref`): llguidance compiles `{"$ref": "#"}` (and any `$ref` cycle that
must be followed at least once) and only fails when a mask is asked of it, mid-request. A schema
whose every match would be infinitely deep is refused before the request is admitted instead.

Relocation (`relocated`): a schema placed inside a bigger one (the "required" tool-call array) keeps
the meaning of its own `#...` pointers when they are rewritten to start at its new place.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import unquote

# JSON Schema keywords whose values are subschemas: maps of them, single ones, lists of them.
MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
ONE_KEYWORDS = ("additionalProperties", "items", "additionalItems", "contains", "not", "if", "then", "else",
                "propertyNames", "unevaluatedItems", "unevaluatedProperties")
LIST_KEYWORDS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
# Beside these an object's properties are not all its own (the schema is an intersection with others).
SHARED_KEYWORDS = ("allOf", "$ref", "if", "then", "else", "dependentSchemas", "unevaluatedProperties")
PROPERTY_KEYWORDS = ("properties", "patternProperties", "required", "additionalProperties")


def children(node: dict[str, Any]) -> Iterator[tuple[str, str | int | None, Any]]:
    """(keyword, name or index or None, subschema) of each schema directly inside `node`; values
    that are data (`const`, `enum`, `default`, `examples`) are never entered."""
    for key, value in node.items():
        if key in MAP_KEYWORDS and isinstance(value, dict):
            for name, sub in value.items():
                yield key, name, sub
        elif key in LIST_KEYWORDS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield key, i, sub
        elif key in ONE_KEYWORDS and isinstance(value, (dict, bool)):
            yield key, None, value


def rebuilt(node: dict[str, Any], visit: Callable[[str, Any], Any]) -> dict[str, Any]:
    """A copy of `node` with each direct subschema replaced by `visit(keyword, subschema)`."""
    out = dict(node)
    for key, at, sub in children(node):
        if at is None:
            out[key] = visit(key, sub)
        else:
            if out[key] is node[key]:
                out[key] = dict(node[key]) if isinstance(node[key], dict) else list(node[key])
            out[key][at] = visit(key, sub)
    return out


def is_object_schema(node: dict[str, Any]) -> bool:
    kind = node.get("type")
    if kind is None:
        return any(k in node for k in ("properties", "patternProperties", "required"))
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def strict_objects(schema: Any) -> Any:
    """`schema` with `additionalProperties: false` on each object schema that leaves it unsaid, whose
    properties are all its own and that lists every key it requires, and `items: false` after a
    tuple's `prefixItems` (see the module's docstring); the input is not modified."""

    def visit(node: Any, closable: bool) -> Any:
        if not isinstance(node, dict):
            return node
        lists_properties = any(k in node for k in PROPERTY_KEYWORDS)

        def child(key: str, sub: Any) -> Any:
            if key in ("allOf", "if", "then", "else"):
                return visit(sub, False)  # intersected with its siblings
            if key in ("anyOf", "oneOf"):
                return visit(sub, not lists_properties)  # a branch adds to the node's own properties
            return visit(sub, True)

        out = rebuilt(node, child)
        if closable and not any(k in node for k in SHARED_KEYWORDS):
            if is_object_schema(node) and "additionalProperties" not in node and _lists_its_required(node):
                out["additionalProperties"] = False
            if isinstance(node.get("prefixItems"), list) and "items" not in node:
                out["items"] = False
        return out

    return visit(schema, True)


def _lists_its_required(node: dict[str, Any]) -> bool:
    """Whether every key `required` names is among `properties` (or matched by `patternProperties`): an
    object that requires a key it does not list leaves it open, as closing it would refuse that key."""
    required = node.get("required")
    if not isinstance(required, list) or node.get("patternProperties"):
        return True
    listed = node.get("properties") if isinstance(node.get("properties"), dict) else {}
    return all(key in listed for key in required)


def relocated(schema: Any, pointer: str) -> Any:
    """`schema` to be placed at the JSON pointer `pointer` (e.g. `#/$defs/tool0`) of another
    document: its local references (`#`, `#/...`) rewritten to start there."""

    def visit(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        out = rebuilt(node, lambda _key, sub: visit(sub))
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            out["$ref"] = pointer + ref[1:]
        return out

    return visit(schema)


def _resolve(root: Any, ref: str) -> tuple[bool, Any]:
    """(found, the schema) of a local reference; non-local ones are not ours to judge."""
    if ref != "#" and not ref.startswith("#/"):
        return False, None
    node = root
    for part in unquote(ref[2:]).split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False, None
    return True, node


def _refs(node: Any) -> Iterator[str]:
    """Every local `$ref` inside `node`, anywhere a subschema may be."""
    if not isinstance(node, dict):
        return
    ref = node.get("$ref")
    if isinstance(ref, str):
        yield ref
    for _key, _at, sub in children(node):
        yield from _refs(sub)


def _finite(node: Any, endless: set[str]) -> bool:
    """Whether some finite JSON value matches `node`, taking the references in `endless` to match
    none. Constraints other than references, required properties and least item counts are
    llguidance's to judge (it refuses what it finds unsatisfiable when it compiles)."""
    if node is False:
        return False
    if not isinstance(node, dict):
        return True
    if node.get("$ref") in endless:
        return False
    all_of, kinds = node.get("allOf"), node.get("type")
    if isinstance(all_of, list) and not all(_finite(s, endless) for s in all_of):
        return False
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches and not any(_finite(s, endless) for s in branches):
            return False
    if "const" in node or "enum" in node:
        return True
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if not isinstance(kinds, list):
        return True  # any type: a string will do
    return any(_finite_as(node, kind, endless) for kind in kinds)


def _finite_as(node: dict[str, Any], kind: Any, endless: set[str]) -> bool:
    if kind == "object":
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        other = node.get("additionalProperties", True)
        required = node.get("required") if isinstance(node.get("required"), list) else []
        return all(_finite(properties.get(name, other), endless) for name in required if isinstance(name, str))
    if kind == "array":
        least = node.get("minItems", 0)
        least = least if isinstance(least, int) else 0
        items = node.get("items", True)
        prefix = node.get("prefixItems", items if isinstance(items, list) else [])
        prefix = prefix if isinstance(prefix, list) else []
        rest = node.get("additionalItems", True) if isinstance(items, list) else items
        return all(_finite(s, endless) for s in prefix[:least]) and (least <= len(prefix) or _finite(rest, endless))
    return True


def endless_ref(schema: Any) -> str | None:
    """The first reference (`#`, `#/$defs/Node`, ...) that no finite value can match, because every
    way through it leads back to itself, or None when there is none. A least fixed point: every
    reference the schema makes starts out endless and is cleared once it can end through cleared
    ones, so a cycle with a way out (`anyOf: [{"$ref": "#"}, {"type": "null"}]`) is fine. A cycle
    behind an optional property counts too: the model may start that property and never end it."""
    referenced: list[str] = []
    todo = list(_refs(schema))
    while todo:
        ref = todo.pop()
        found, target = _resolve(schema, ref) if ref not in referenced else (False, None)
        if found:
            referenced.append(ref)
            todo.extend(_refs(target))
    endless = set(referenced)
    cleared = True
    while cleared:
        cleared = False
        for ref in sorted(endless):
            if _finite(_resolve(schema, ref)[1], endless):
                endless.discard(ref)
                cleared = True
    if endless:
        return min(endless, key=lambda r: (len(r), r))
    return None if _finite(schema, endless) else "#"
