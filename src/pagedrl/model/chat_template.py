"""Chat templates: a model's Jinja template rendered exactly as transformers renders it.

A chat model only behaves if its prompt is byte-for-byte the format it was trained on, and the
template that defines that format is written against transformers' Jinja environment: a sandbox with
`trim_blocks` and `lstrip_blocks`, a `tojson` filter that does not escape HTML, and the globals
`raise_exception` and `strftime_now`. The environment below reproduces that one, so a template from the
Hub renders here to the same string it renders to there.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

ChatTemplates = str | dict[str, str]


class ChatTemplateError(ValueError):
    """A template that cannot be chosen, compiled or rendered; the message says which and why."""


class UnusableTemplate(ChatTemplateError):
    """The tokenizer's templates themselves are at fault (none, none chosen, not compilable), not the
    messages given: no conversation would render."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML, which would corrupt tool schemas in a prompt.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


# While a render records assistant spans: the text the template has put out so far and the spans found.
_TRACKING: ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = ContextVar("generation_spans", default=None)
# `{% generation %}` with or without whitespace control, as transformers and TRL look for it.
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the body rendered as is, and, while a render records
    spans (`render_chat_template_spans`), where in the text it landed, as transformers' AssistantTracker
    finds it: the length of what the template had put out before, plus the body's length."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        text = caller()
        if (tracking := _TRACKING.get()) is not None:
            blocks, spans = tracking
            start = len("".join(blocks))
            spans.append((start, start + len(text)))
        return text


def has_generation_block(source: str) -> bool:
    """Whether a template marks its assistant turns with `{% generation %}` (TRL's test, its regex)."""
    return _GENERATION_TAG.search(source) is not None


@contextmanager
def _recording(blocks: list[str], spans: list[tuple[int, int]]) -> Iterator[None]:
    token = _TRACKING.set((blocks, spans))
    try:
        yield
    finally:
        _TRACKING.reset(token)


def assistant_token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters `[start, end)` overlap an assistant span, else 0: transformers'
    rule (`apply_chat_template(return_assistant_tokens_mask=True)`), so a token straddling a span's edge
    is the assistant's, and one past a span's end is not. Spans and offsets both go left to right."""
    mask = [0] * len(offsets)
    k = 0
    for i, (start, end) in enumerate(offsets):
        while k < len(spans) and start >= spans[k][1]:
            k += 1
        if k == len(spans):
            break
        if end > spans[k][0]:
            mask[i] = 1
    return mask


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore names, as transformers' does, so no template reaches internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # no `self`: the same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


class _DictFactory:
    """`dict(...)` for templates without handing them the `dict` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile once per template text; rendering is then cheap enough for every request."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _DictFactory()
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise UnusableTemplate(f"chat_template: syntax error at line {e.lineno}: {e.message}") from None


def select_chat_template(templates: ChatTemplates | None, name: str | None = None,
                         tools: Sequence[Any] | None = None) -> str:
    """The template to use: `name` (a template's name, or template text itself), else `tool_use` when
    tools are given and one exists, else `default`."""
    if templates is None and name is not None:
        return name
    if templates is None:
        raise UnusableTemplate("chat_template: this tokenizer has no chat template (tokenizer_config.json "
                                "'chat_template' or chat_template.jinja)")
    if isinstance(templates, str):
        return templates if name is None else name
    if name is not None:
        return templates.get(name, name)
    if tools is not None and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise UnusableTemplate(f"chat_template: several templates ({', '.join(sorted(templates))}) and none is "
                            "named 'default'; pass the name of one")


# Names a message's reasoning arrives under; templates read the first (Qwen3) or `thinking` (gpt-oss).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Drop None values (OpenAI clients send content=None, templates test for absent keys) and alias the
    reasoning fields, both as transformers does before rendering."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}] must be a dict with 'role' and 'content', got {message!r}")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = False,
                         tools: Sequence[Any] | None = None, documents: Sequence[Any] | None = None,
                         special_tokens: Mapping[str, str] | None = None, continue_final_message: bool = False,
                         **kwargs: Any) -> str:
    """Render `messages` with the template text `source`.

    `special_tokens` (bos_token, eos_token, ...) are visible to the template as variables, and any
    extra keyword (e.g. `enable_thinking`) overrides them, which is the order transformers uses.
    `continue_final_message` ends the text right after the final message's own text (transformers'
    rule), so that the model goes on writing that message rather than answering it.
    """
    if continue_final_message and add_generation_prompt:
        raise ChatTemplateError("continue_final_message and add_generation_prompt cannot both be true "
                                "(send add_generation_prompt false to continue the final message)")
    text = _render(source, messages, add_generation_prompt, tools, documents, special_tokens, kwargs, None)
    return _cut_after_final_message(text, messages[-1]) if continue_final_message else text


def render_chat_template_spans(source: str, messages: Sequence[Mapping[str, Any]], *,
                               add_generation_prompt: bool = False, tools: Sequence[Any] | None = None,
                               documents: Sequence[Any] | None = None,
                               special_tokens: Mapping[str, str] | None = None,
                               **kwargs: Any) -> tuple[str, list[tuple[int, int]]]:
    """The text, and the character spans `[start, end)` of what the template's `{% generation %}`
    blocks wrote (the assistant's turns), in order; no spans when the template has no such block."""
    spans: list[tuple[int, int]] = []
    text = _render(source, messages, add_generation_prompt, tools, documents, special_tokens, kwargs, spans)
    return text, spans


def _render(source: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
            tools: Sequence[Any] | None, documents: Sequence[Any] | None, special_tokens: Mapping[str, str] | None,
            kwargs: Mapping[str, Any], spans: list[tuple[int, int]] | None) -> str:
    """One render; with `spans`, the template's output is taken piece by piece (jinja's `generate`), so
    each generation block sees how much text came before it."""
    if not messages:
        raise ChatTemplateError("messages: cannot apply a chat template to an empty conversation")
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise ChatTemplateError("tools: each tool must be a JSON schema dict")
    variables = {**(special_tokens or {}), **kwargs}
    template = compile_chat_template(source)
    context = dict(messages=_normalize_messages(messages), tools=None if tools is None else list(tools),
                   documents=None if documents is None else list(documents),
                   add_generation_prompt=add_generation_prompt, **variables)
    try:
        if spans is None:
            return template.render(**context)
        blocks: list[str] = []
        with _recording(blocks, spans):
            for block in template.generate(**context):
                blocks.append(block)
        return "".join(blocks)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"chat_template: {e}") from None


def _cut_after_final_message(text: str, final: Mapping[str, Any]) -> str:
    """`text` up to the end of the final message's own text (its last text part's), where the template
    put it; a template that trimmed the message's spaces is cut after the trimmed text."""
    content = final.get("content")
    if isinstance(content, (list, tuple)):
        content = next((part["text"] for part in reversed(content) if isinstance(part, Mapping) and "text" in part),
                       None)
    if not isinstance(content, str) or not content.strip():
        raise ChatTemplateError("continue_final_message: the final message has no text to continue")
    at = text.rfind(content.strip())
    if at < 0:
        raise ChatTemplateError("continue_final_message: the final message's text is not in the rendered prompt "
                                "(the template leaves it out)")
    kept = content.lstrip()
    return text[:at + len(kept if text[at:at + len(kept)] == kept else content.strip())]
