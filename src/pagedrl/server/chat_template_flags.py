"""vLLM's chat-template flags for `pagedrl serve`: `--chat-template`, `--chat-template-content-format`,
`--response-role` and `--trust-request-chat-template`.

An operator whose model ships no template, or a wrong one, gives the server its own; every route that
renders messages (`/v1/chat/completions`, `/v1/responses`, `/tokenize`, and the chat page, which calls
the first) then uses it, as vLLM does. The flag takes a file or the template itself, told apart by
vLLM's rule: a value that cannot be opened as a file is the template, unless it has none of `{`, `}`
or a newline, when it was meant as a path and the server refuses it rather than rendering every prompt
as that one line. A template is compiled before the model loads, so a syntax error costs no minutes.

Templates read a message's `content` in one of two shapes: a string (most) or OpenAI's list of
`{"type": "text", "text": ...}` parts (those written for multimodal models). `auto` looks at the
template, as vLLM's `_detect_content_format` does: one that loops over a message's content gets the
list, any other the text parts joined with newlines.

A request may bring its own template (`chat_template`, or `chat_template_kwargs.chat_template`, which
wins, as in vLLM) only on a server started with `--trust-request-chat-template`: a template is code the
server runs (in Jinja's sandbox, as every template here), so by default it is refused with vLLM's 400.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedrl.model.chat_template import ChatTemplateError, ChatTemplates, compile_chat_template
from pagedrl.model.content_format import CONTENT_FORMATS, ContentFormat, content_format_for
from pagedrl.server.errors import bad_request

logger = logging.getLogger("pagedrl.server")

# A value holding none of these cannot be a template worth serving: it was meant as a file (vLLM's rule).
JINJA_CHARS = "{}\n"
UNTRUSTED = ("Chat template is passed with request, but --trust-request-chat-template is not set. Refused request "
             "with untrusted chat template.")  # vLLM's words
NO_TEMPLATE = ("this model has no chat template: give the server one with --chat-template (a file or the "
               "template itself), or use /v1/completions")


def add_chat_template_arguments(group: argparse._ArgumentGroup) -> None:
    """The flags, with vLLM's names and defaults."""
    group.add_argument("--chat-template", default=None, metavar="TEMPLATE",
                       help="a Jinja chat template, as a file or inline, used instead of the model's on every route "
                            "that renders messages")
    group.add_argument("--chat-template-content-format", default="auto", choices=CONTENT_FORMATS,
                       help="how a message's content reaches the template: string (text parts joined with newlines), "
                            "openai (a list of {'type': 'text', 'text': ...} parts), or auto (detected from the "
                            "template: a template that loops over a message's content gets the list)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a request bring its own chat template (chat_template, or "
                            "chat_template_kwargs.chat_template); refused without this flag")
    group.add_argument("--response-role", default="assistant",
                       help="the answer's role when the request's add_generation_prompt is true (otherwise the last "
                            "message's role, as in vLLM)")


def load_chat_template(value: str) -> str:
    """The template `--chat-template VALUE` names: the file's text, else VALUE itself. ValueError, naming
    the flag, for a value that looks like a path (no `{`, `}` or newline) and cannot be read."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, ValueError, UnicodeDecodeError) as e:  # ValueError: a NUL in an inline template
        if any(c in value for c in JINJA_CHARS):
            return value
        reason = getattr(e, "strerror", None) or str(e)
        raise ValueError(f"--chat-template {value}: looks like a file path, but it could not be opened "
                         f"({reason}); give a readable file or the template itself") from None


def chat_template_problem(value: str | None) -> str | None:
    """Why `--chat-template VALUE` cannot be served (unreadable, or not a template Jinja compiles), in one
    line naming the flag and the template's line; checked before the model loads."""
    if value is None:
        return None
    try:
        text = load_chat_template(value)
    except ValueError as e:
        return str(e)
    try:
        compile_chat_template(text)
    except ChatTemplateError as e:  # "chat_template: syntax error at line N: ..."
        where = f" {value}" if text != value else ""  # a file is named; an inline template is not repeated
        return f"--chat-template{where}: {str(e).removeprefix('chat_template: ')}"
    return None


@dataclass(frozen=True)
class ChatRendering:
    """How this server turns messages into a prompt: `template` (`--chat-template`'s text) over the
    model's own, and the content format (`--chat-template-content-format`)."""

    template: str | None = None
    content_format: str = "auto"
    trust_request_templates: bool = False  # --trust-request-chat-template

    def for_request(self, template: Any, template_kwargs: dict[str, Any] | None) -> ChatRendering:
        """How one request renders: with its own template (`chat_template_kwargs.chat_template` over
        `chat_template`, vLLM's order), when the server trusts requests' templates; a 400 naming the field
        otherwise, or when the template is not one Jinja compiles."""
        kwarg = (template_kwargs or {}).get("chat_template")
        param, given = ("chat_template_kwargs.chat_template", kwarg) if kwarg is not None else ("chat_template", template)
        if given is None:
            return self
        if not self.trust_request_templates:
            raise bad_request(UNTRUSTED, param=param)
        if not isinstance(given, str):
            raise bad_request(f"{param} must be a string (a Jinja chat template)", param=param)
        try:
            compile_chat_template(given)
        except ChatTemplateError as e:
            raise bad_request(f"{param}: {str(e).removeprefix('chat_template: ')}", param=param) from None
        return ChatRendering(given, self.content_format, True)

    def templates(self, tokenizer: Any) -> ChatTemplates | None:
        """The templates a request chooses among: the server's, else the tokenizer's."""
        return self.template if self.template is not None else getattr(tokenizer, "chat_template", None)

    def format_for(self, source: str) -> ContentFormat:
        """The content format for the template text `source`."""
        return content_format_for(source, self.content_format)

    def describe(self, tokenizer: Any) -> str | None:
        """The start-up log line: which template, and which content format and why (None: no template)."""
        templates = self.templates(tokenizer)
        if templates is None:
            return None
        origin = "from --chat-template" if self.template is not None else "the model's"
        named = templates if isinstance(templates, dict) else {"": templates}
        formats = ", ".join(f"{name} {self.format_for(t)}".strip() for name, t in named.items())
        why = ("--chat-template-content-format" if self.content_format != "auto" else
               "detected from the template; --chat-template-content-format string|openai overrides")
        return f"chat template {origin}; message content reaches it as {formats} ({why})"


# What a server without the flags renders with: the model's templates, the content format detected.
MODEL_TEMPLATE = ChatRendering()
