"""The assistant's tokens of a template with no `{% generation %}` block, found from the renderings of
the conversation's prefixes: from the models' original templates, equal to the masks of TRL's training
variants of them (`trl/chat_templates/*_training.jinja`) rendered by transformers'
`apply_chat_template(..., return_assistant_tokens_mask=True)`, on multi-turn conversations, a system
message and tool calls; the default model's own ChatML against a hand-written expectation; and the
conversations a template does not render prefix-preserving refused, naming chat_template_path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import trl

from pagedrl.model.chat_turns import NotPrefixPreserving, assistant_spans_from_prefixes

TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
GENERATION_TAGS = re.compile(r"\{%-?\s*(end)?generation\s*-?%\}")

ONE = [{"role": "user", "content": "what is two plus three"}, {"role": "assistant", "content": "five"}]
MULTI = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "the cat sat on the mat"},
         {"role": "user", "content": "what is two plus three"}, {"role": "assistant", "content": " the answer is five "}]
SYSTEM = [{"role": "system", "content": "red green blue"}, *MULTI]
TOOLS = [{"role": "system", "content": "a dog ran"}, {"role": "user", "content": "what is two plus three"},
         {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
             "name": "add", "arguments": {"a": 2, "b": 3}}}]},
         {"role": "tool", "name": "add", "content": "5"}, {"role": "assistant", "content": "five"},
         {"role": "user", "content": "and one plus one"},
         {"role": "assistant", "content": "let me add", "tool_calls": [{"type": "function", "function": {
             "name": "add", "arguments": {"a": 1, "b": 1}}}]},
         {"role": "tool", "name": "add", "content": "2"}, {"role": "assistant", "content": "two"}]
REASONING = [{"role": "user", "content": "what is two plus three"},
             {"role": "assistant", "content": "five", "reasoning_content": "two plus three"},
             {"role": "user", "content": "and one plus one"}, {"role": "assistant", "content": "two"}]


def _trl(name: str) -> str:
    return (TRL_TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


def _unmarked(name: str) -> str:
    """A training template with its markers taken out: TRL's rendering, prefix-preserving, with no block."""
    return GENERATION_TAGS.sub("", _trl(name))


# (the template without markers, TRL's training template, the conversations both can render). Qwen3's
# original is not prefix-preserving (it drops earlier turns' reasoning): its training variant, unmarked, is.
CASES = {
    "llama3": (_trl("llama3"), _trl("llama3_training"), [ONE, MULTI, SYSTEM]),
    "gemma": (_trl("gemma"), _trl("gemma_training"), [ONE, MULTI]),  # no system role, turns alternate
    "phi3": (_trl("phi3"), _trl("phi3_training"), [ONE]),  # see test_text_closing_the_conversation_is_refused
    "qwen3": (_trl("qwen3"), _trl("qwen3_training"), [ONE]),
    "qwen3_training": (_unmarked("qwen3_training"), _trl("qwen3_training"), [ONE, MULTI, SYSTEM, TOOLS, REASONING]),
}
RENDER = {"bos_token": "<s>"}  # Llama 3's and Gemma's templates write it; the tiny tokenizer has none


def _trl_mask(hf_tok, messages, template) -> tuple[list[int], list[int]]:
    want = hf_tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=True,
                                      return_assistant_tokens_mask=True, **RENDER)
    return want["input_ids"], list(want["assistant_masks"])


@pytest.mark.parametrize(("name", "conversation"), [(n, i) for n, c in CASES.items() for i in range(len(c[2]))])
def test_masks_from_the_original_template_equal_trls_training_template(tok, hf_tok, name, conversation) -> None:
    original, training, conversations = CASES[name]
    messages = conversations[conversation]
    ids, mask = tok.chat_assistant_mask(messages, chat_template=original, prefix_turns=True, **RENDER)
    assert (ids, mask) == _trl_mask(hf_tok, messages, training)
    assert 0 < sum(mask) < len(mask)
    # without prefix_turns the unmarked template marks nothing, as transformers' mask does
    assert not any(tok.chat_assistant_mask(messages, chat_template=original, **RENDER)[1])


def test_qwen2_5_differs_from_trls_training_template_by_the_headers_newline_only(tok, hf_tok) -> None:
    """TRL's Qwen2.5 training template puts the newline after `<|im_start|>assistant` in the block: that
    header's last token is the one token of TRL's mask not found here (the prompt ends with it)."""
    for messages in (ONE, SYSTEM, TOOLS):
        ids, mask = tok.chat_assistant_mask(messages, chat_template=_trl("qwen2_5"), prefix_turns=True)
        want_ids, want = _trl_mask(hf_tok, messages, _trl("qwen2_5_training"))
        assert ids == want_ids
        extra = [i for i, (m, w) in enumerate(zip(mask, want, strict=True)) if m != w]
        assert all(want[i] and not mask[i] for i in extra)
        assert len(extra) == sum(m["role"] == "assistant" for m in messages)
        header = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
        assert all(ids[i - len(header) + 1:i + 1] == header for i in extra)


def test_the_default_models_chatml_marks_content_and_end_of_turn(default_tokenizer) -> None:
    """SmolLM2's template (ChatML, a default system message, no block): each assistant turn's content, its
    `<|im_end|>` and the newline after it; not the system message, the user's turns or the headers."""
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    pieces = [(system + "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n", 0),
              ("Hello! How can I help?<|im_end|>\n", 1),
              ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", 0), ("4<|im_end|>\n", 1)]
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}]
    ids, mask = default_tokenizer.chat_assistant_mask(messages, prefix_turns=True)
    want_ids = [i for text, _ in pieces for i in default_tokenizer.encode(text, add_special_tokens=False)]
    want_mask = [m for text, m in pieces for _ in default_tokenizer.encode(text, add_special_tokens=False)]
    assert ids == want_ids == default_tokenizer.encode("".join(t for t, _ in pieces), add_special_tokens=False)
    assert mask == want_mask


def test_a_template_dropping_earlier_reasoning_is_refused_naming_chat_template_path(tok) -> None:
    """Qwen3's original template drops the reasoning of assistant turns before the last user message, so
    the first turn renders otherwise once the second follows: refused, not trained on the wrong tokens."""
    with pytest.raises(NotPrefixPreserving, match=r"^chat_template_path: .*messages\[1\] cannot be found .*"
                                                  r"renders otherwise once later messages follow it .*"
                                                  r"not prefix-preserving.*_training\.jinja"):
        tok.chat_assistant_mask(REASONING, chat_template=_trl("qwen3"), prefix_turns=True)


def test_text_closing_the_conversation_is_refused(tok) -> None:
    """Phi-3's template ends a conversation with EOS, so an assistant turn followed by more messages is
    not where the rendering through it ends: refused (TRL's training variant marks the EOS last only)."""
    with pytest.raises(NotPrefixPreserving, match=r"messages\[1\] cannot be found"):
        tok.chat_assistant_mask(MULTI, chat_template=_trl("phi3"), prefix_turns=True)


def test_a_template_rendering_the_last_assistant_turn_otherwise_is_refused() -> None:
    last_differs = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if loop.last %} (final){% endif %}\n"
                    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    with pytest.raises(NotPrefixPreserving, match=r"messages\[1\] cannot be found"):
        assistant_spans_from_prefixes(last_differs, MULTI)


def test_a_conversation_opening_with_the_assistant_is_refused() -> None:
    with pytest.raises(NotPrefixPreserving, match=r"^chat_template_path: messages\[0\] is the assistant's"):
        assistant_spans_from_prefixes(_unmarked("qwen3_training"), MULTI[1:])


def test_spans_are_what_each_assistant_message_adds(tok) -> None:
    text, spans = assistant_spans_from_prefixes(tok.chat_template, SYSTEM)
    assert [text[s:e] for s, e in spans] == ["the cat sat on the mat<|im_end|>\n", " the answer is five <|im_end|>\n"]
