"""The assistant's turns of a conversation found from a chat template that does not mark them.

Most models' templates have no `{% generation %}` block, so nothing in them says which text the
assistant wrote. The template says it all the same: an assistant message's text is what the message
adds to the rendering, from the end of the conversation before it rendered with the generation prompt
(the header the model is prompted with, not the model's) to the end of the conversation through it
(the content, the end-of-turn token and what the template writes after the turn, as TRL's training
templates mark it: `<|im_end|>\n`, `<end_of_turn>\n`, `<|eot_id|>`). That holds only where both
renderings are where the whole conversation's rendering starts (the template is prefix-preserving for
it); where one is not (an earlier turn's reasoning dropped, the last assistant turn rendered otherwise),
the turn cannot be found and the conversation is refused rather than trained on the wrong tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedrl.model.chat_template import ChatTemplateError, render_chat_template

# What to set instead, for the refusals' messages.
MARKED_TEMPLATES = ("set chat_template_path to a template whose assistant turns are inside "
                    "{% generation %}...{% endgeneration %} (TRL ships such templates for Qwen3, Llama 3, Gemma, "
                    "Phi-3 and others as trl/chat_templates/*_training.jinja)")


class NotPrefixPreserving(ChatTemplateError):
    """A conversation whose assistant turns the template's renderings of its prefixes do not locate."""


def assistant_spans_from_prefixes(source: str, messages: Sequence[Mapping[str, Any]],
                                  **render: Any) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text and, for each assistant message, the characters `[start, end)` it adds:
    `start` the length of the messages before it rendered with the generation prompt, `end` the length
    of the messages through it rendered without. `render`: the keywords of `render_chat_template`
    (tools, special tokens, the template's own variables), the same for every rendering."""
    text = render_chat_template(source, messages, **render)
    spans: list[tuple[int, int]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") != "assistant":
            continue
        if i == 0:
            raise NotPrefixPreserving("chat_template_path: messages[0] is the assistant's, so no prompt renders "
                                      "before it to tell its tokens from the template's; with no {% generation %} "
                                      f"block the assistant's tokens are found from such prompts: {MARKED_TEMPLATES}")
        prompt = render_chat_template(source, messages[:i], add_generation_prompt=True, **render)
        through = render_chat_template(source, messages[:i + 1], **render)
        if not text.startswith(prompt):
            _refuse(i, "the messages before it, rendered with the generation prompt, are not how the whole "
                       "conversation's rendering begins")
        if not text.startswith(through):
            _refuse(i, "it renders otherwise once later messages follow it (an earlier turn's reasoning dropped, "
                       "the last assistant turn rendered differently, or text closing the conversation)")
        if len(through) <= len(prompt):
            _refuse(i, "it adds nothing past the generation prompt")
        spans.append((len(prompt), len(through)))
    return text, spans


def _refuse(i: int, why: str) -> None:
    raise NotPrefixPreserving(f"chat_template_path: the chat template has no {{% generation %}} block, and the "
                              f"assistant's messages[{i}] cannot be found from its renderings of the conversation: {why} "
                              f"(the template is not prefix-preserving for it); {MARKED_TEMPLATES}")
