"""How a message's content reaches a chat template, vLLM's `chat_template_content_format`: as a string
(most templates) or as OpenAI's list of `{"type": "text", "text": ...}` parts (templates written for
multimodal models). `auto` looks at the template, as vLLM's `_detect_content_format` does: one that loops
over a message's content gets the list, any other the text parts joined with newlines. The server's
`--chat-template-content-format` and `LLM.chat(chat_template_content_format=...)` both decide here."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import lru_cache
from typing import Literal

import jinja2
import jinja2.nodes

from pagedrl.model.chat_template import ChatTemplateError, compile_chat_template

ContentFormat = Literal["string", "openai"]
CONTENT_FORMATS = ("auto", "string", "openai")


def content_format_for(source: str, option: str = "auto") -> ContentFormat:
    """The content format for the template text `source` under `option` (`auto`, `string` or `openai`);
    ValueError naming chat_template_content_format for any other option."""
    if option in ("string", "openai"):
        return option  # type: ignore[return-value]
    if option != "auto":
        raise ValueError(f"chat_template_content_format must be one of {', '.join(CONTENT_FORMATS)}, got {option!r}")
    return detected_content_format(source)


def _loads(node: jinja2.nodes.Node, name: str, key: str | None = None) -> bool:
    """Whether `node` reads variable `name` (with `key`: its item or attribute `key`), possibly through
    filters, tests or a slice: `messages`, `messages[1:]`, `message['content'] | trim`..."""
    if isinstance(node, (jinja2.nodes.Filter, jinja2.nodes.Test)):
        return node.node is not None and _loads(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _loads(node.node, name, key)
    if key is not None:
        if isinstance(node, jinja2.nodes.Getitem):
            return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key and _loads(node.node, name)
        if isinstance(node, jinja2.nodes.Getattr):
            return node.attr == key and _loads(node.node, name)
        return False
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _aliases(root: jinja2.nodes.Template, name: str) -> Iterator[str]:
    """`name` and every variable `{% set %}` makes of it (`{% set msgs = messages[1:] %}`), transitively."""
    seen, todo = {name}, deque([name])
    yield name
    while todo:
        current = todo.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            target = assign.target
            if isinstance(target, jinja2.nodes.Name) and target.name not in seen and _loads(assign.node, current):
                seen.add(target.name)
                todo.append(target.name)
                yield target.name


def _loop_targets(root: jinja2.nodes.Template, names: list[str], key: str | None = None) -> Iterator[str]:
    """The variables of `{% for x in NAME %}` loops (with `key`: `in NAME[key]`) over any of `names`."""
    for loop in root.find_all(jinja2.nodes.For):
        if isinstance(loop.target, jinja2.nodes.Name) and any(_loads(loop.iter, n, key) for n in names):
            yield loop.target.name


@lru_cache(maxsize=32)
def detected_content_format(source: str) -> ContentFormat:
    """`openai` for a template that loops over a message's content (`{% for m in messages %}...{% for part
    in m['content'] %}`), else `string`; a template that does not parse gets `string`, as in vLLM."""
    try:
        root = compile_chat_template(source).environment.parse(source)
    except (ChatTemplateError, jinja2.exceptions.TemplateError):
        return "string"
    messages = list(_loop_targets(root, list(_aliases(root, "messages"))))
    return "openai" if next(_loop_targets(root, messages, "content"), None) is not None else "string"
