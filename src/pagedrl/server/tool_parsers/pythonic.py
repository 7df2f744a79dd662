"""`pythonic` (and `llama4_pythonic`): the Python call lists of Llama 3.2 and Llama 4 (and ToolACE-style models),
`[get_weather(city="Paris"), f(x=1)]`, each argument a keyword and each value a Python literal (strings,
numbers, True/False/None, lists, dicts, tuples read as lists), given as JSON.

As vLLM's: a list holding anything but such calls (a positional argument, a name, an expression) is
not a call list, and stays in the content as written. vLLM reads a call list only at the start of the
answer; here one may follow text, which stays the content, as with the other parsers (a list of calls
in prose is rare; `[1, 2]` or a markdown link is not one, and is given out as soon as that shows).
"""

from __future__ import annotations

import ast
import json
import re

from pagedrl.server.tool_parsers.reader import WAIT, CallReader, Step, called, content_until, fail, hold, skip

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
CALL_START = re.compile(r"\[\s*(?:[A-Za-z_]\w*\s*(\()?)?")


def python_calls(text: str) -> tuple[tuple[str, str], ...] | None:
    """The (name, arguments as JSON text) of a Python list of keyword-only calls of plain names; None
    when the text is anything else. A call whose values are no JSON (bytes, a set, 1e999) is left out
    and its siblings kept, as vLLM does; a list left with none is not a call list."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts or not all(
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
            and all(k.arg is not None for k in node.keywords) for node in tree.elts):
        return None
    calls = []
    for node in tree.elts:
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            continue
    return tuple(calls) or None


class PythonicReader(CallReader):
    def scan(self, text: str, final: bool) -> Step:
        if not text.startswith("["):
            return content_until(text, final, "[")
        start = CALL_START.match(text)
        if start.group(1) is None:  # not `[name(` (yet)
            return WAIT if start.end() == len(text) else fail(1)
        end = self.closing(text, 0, python=True)
        if end is None:
            return WAIT
        calls = python_calls(text[:end])
        return fail(end) if calls is None else called(end, *calls)


class Llama4PythonicReader(PythonicReader):
    """`llama4_pythonic`: Llama 4's call lists, which it may wrap in `<|python_start|>` and `<|python_end|>`
    (special tokens: decoded with them, the markers are dropped around calls and kept elsewhere)."""

    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> Step:
        if text.startswith(PYTHON_START):
            return hold(len(PYTHON_START))
        if text.startswith(PYTHON_END) and self.after_call:
            return skip(len(PYTHON_END))
        if text.startswith("["):
            return super().scan(text, final)
        return content_until(text, final, "[", PYTHON_START, PYTHON_END)
