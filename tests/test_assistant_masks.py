"""Which tokens of a conversation the assistant wrote: the spans a template's `{% generation %}` blocks
render, mapped onto tokens, against transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)`
on the tiny test tokenizer, with templates of our own and TRL's training templates (multi-turn, a system
message, reasoning, tool calls, an empty answer, tokens straddling a span's edges)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trl
from tiny_train import CHAT_TEMPLATE_GENERATION

from pagedrl.model.chat_template import assistant_token_mask, has_generation_block, render_chat_template_spans

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"

CHATML_GENERATION = CHAT_TEMPLATE_GENERATION  # tiny_train's ChatML, assistant turns marked
# The spans start and end inside tokens (" th|ree", "s|ev|en"), so tokens straddle both edges.
STRADDLING = (
    "{% for m in messages %}{% if m.role == 'assistant' %}plus th{%- generation -%}{{ m.content }}"
    "{%- endgeneration -%}en<|im_end|>{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "what is two plus three"}, {"role": "assistant", "content": "five"}],
    [{"role": "system", "content": "red green blue"},
     {"role": "user", "content": "hello there"}, {"role": "assistant", "content": "the cat sat on the mat"},
     {"role": "user", "content": "what is two plus three"}, {"role": "assistant", "content": "the answer is five"}],
    [{"role": "user", "content": "one two"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "three"}, {"role": "assistant", "content": "four five six"}],
    [{"role": "system", "content": "a dog ran"}, {"role": "user", "content": "what is two plus three"},
     {"role": "assistant", "content": "five", "reasoning_content": "two plus three"},
     {"role": "user", "content": "and one plus one"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
         "name": "add", "arguments": {"a": 1, "b": 1}}}]},
     {"role": "tool", "content": "2"}, {"role": "assistant", "content": "<think>\nsum\n</think>\n\ntwo"}],
]


def _templates() -> dict[str, str]:
    return {"chatml": CHATML_GENERATION,
            "qwen3_training": (TRL_TEMPLATES / "qwen3_training.jinja").read_text(encoding="utf-8"),
            "llama3_training": (TRL_TEMPLATES / "llama3_training.jinja").read_text(encoding="utf-8")}


@pytest.mark.parametrize("name", sorted(_templates()))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_assistant_masks_equal_transformers(tok, hf_tok, name: str, conversation: int) -> None:
    template, messages = _templates()[name], CONVERSATIONS[conversation]
    want = hf_tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    ids, mask = tok.chat_assistant_mask(messages, chat_template=template)
    assert ids == want["input_ids"]
    assert mask == want["assistant_masks"]
    assert 0 < sum(mask) < len(mask)  # both kinds of token are there to tell apart


def test_tokens_straddling_a_span_edge_are_the_assistants_as_in_transformers(tok, hf_tok) -> None:
    messages = [{"role": "user", "content": "what is two plus three"},
                {"role": "assistant", "content": "ree the answer is sev"}]
    want = hf_tok.apply_chat_template(messages, chat_template=STRADDLING, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True)
    ids, mask = tok.chat_assistant_mask(messages, chat_template=STRADDLING)
    assert (ids, mask) == (want["input_ids"], want["assistant_masks"])
    text, spans = render_chat_template_spans(STRADDLING, messages)
    assert [text[s:e] for s, e in spans] == ["ree the answer is sev"]
    # the masked tokens reach past the span on both sides: the straddling tokens are in
    assert tok.decode([i for i, m in zip(ids, mask, strict=True) if m]) == " three the answer is seve"


def test_spans_are_where_the_generation_blocks_wrote(tok) -> None:
    text, spans = render_chat_template_spans(CHATML_GENERATION, CONVERSATIONS[1])
    assert [text[s:e] for s, e in spans] == ["the cat sat on the mat<|im_end|>", "the answer is five<|im_end|>"]
    assert text == tok.apply_chat_template(CONVERSATIONS[1], chat_template=CHATML_GENERATION)


def test_a_template_without_generation_blocks_masks_nothing(tok, hf_tok) -> None:
    messages = CONVERSATIONS[1]
    ids, mask = tok.chat_assistant_mask(messages)  # tiny_train's plain ChatML template
    want = hf_tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert (ids, mask) == (want["input_ids"], want["assistant_masks"])
    assert not any(mask)
    assert not has_generation_block(tok.chat_template)


@pytest.mark.parametrize(("source", "found"), [
    ("{% generation %}x{% endgeneration %}", True), ("{%- generation -%}x{%- endgeneration %}", True),
    ("{%generation%}x{%endgeneration%}", True), ("{{ 'generation' }}", False), ("{% if generation %}{% endif %}", False),
])
def test_has_generation_block_reads_the_tag_as_trl_does(source: str, found: bool) -> None:
    from trl.chat_template_utils import has_generation_markers

    assert has_generation_block(source) is found is has_generation_markers(source)


def test_mask_rule_on_offsets() -> None:
    """A token is the assistant's when its characters overlap a span: touching an edge is not overlapping,
    an empty span holds no token."""
    offsets = [(0, 3), (3, 5), (5, 9), (9, 9), (9, 12), (12, 14)]
    assert assistant_token_mask(offsets, [(3, 9)]) == [0, 1, 1, 0, 0, 0]
    assert assistant_token_mask(offsets, [(4, 6)]) == [0, 1, 1, 0, 0, 0]
    assert assistant_token_mask(offsets, [(9, 9), (13, 20)]) == [0, 0, 0, 0, 0, 1]
    assert assistant_token_mask(offsets, []) == [0] * 6
