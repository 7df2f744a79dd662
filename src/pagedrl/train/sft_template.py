"""The chat template an SFT run renders its chat rows with: TRL's `chat_template_path`, and how
`assistant_only_loss` finds the assistant's tokens in it.

`chat_template_path` is what TRL 1.16's SFTTrainer takes: a `.jinja` (or `.j2`) file, whose text becomes
the tokenizer's chat template, or a tokenizer folder, whose (default) chat template and end-of-sequence
token are taken, the model's config and generation config then naming that token as the end (TRL's
`clone_chat_template`). The template replaces the model folder's for the run and is saved with the
trained model (`chat_template.jinja`), so the model is served with the format it was trained on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagedrl.model.chat_template import (
    ChatTemplateError,
    compile_chat_template,
    has_generation_block,
    select_chat_template,
)
from pagedrl.model.chat_turns import NotPrefixPreserving
from pagedrl.model.tokenizer import Tokenizer

TEMPLATE_SUFFIXES = (".jinja", ".j2")  # the files TRL reads as a template's text


def read_chat_template_path(path: str, tokenizer: Tokenizer) -> tuple[str, Tokenizer | None]:
    """(the template's text, the folder's tokenizer or None for a file), checked: it compiles, and a folder's
    tokens are all in the model's vocabulary."""
    where = Path(path).expanduser()
    if where.is_file() and where.suffix in TEMPLATE_SUFFIXES:
        try:
            text, source = where.read_text(encoding="utf-8"), None
        except UnicodeDecodeError:
            raise ValueError(f"chat_template_path: {where} is not UTF-8 text") from None
    elif where.is_dir():
        try:
            source = Tokenizer.from_folder(where)
            text = select_chat_template(source.chat_template)
        except (FileNotFoundError, ChatTemplateError) as e:
            raise ValueError(f"chat_template_path: {e}") from None
        vocab = tokenizer.get_vocab()
        missing = [t.content for t in source.backend.get_added_tokens_decoder().values() if t.content not in vocab]
        if missing:
            raise ValueError(f"chat_template_path: {where}'s tokenizer has tokens the model's vocabulary lacks "
                             f"({', '.join(map(repr, missing[:8]))}{', ...' if len(missing) > 8 else ''}); TRL adds "
                             "them and resizes the embeddings, which pagedrl does not: give a template file (.jinja) "
                             "written with the model's own tokens")
    else:
        raise ValueError(f"chat_template_path: {where}: expected a {' or '.join(TEMPLATE_SUFFIXES)} template file or "
                         "a tokenizer folder (a Hub id is not fetched: download it first, e.g. `hf download ORG/NAME`)")
    try:
        compile_chat_template(text)
    except ChatTemplateError as e:
        raise ValueError(f"chat_template_path: {where}: {e}") from None
    return text, source


def use_chat_template_path(path: str, tokenizer: Tokenizer, model_config: Any,
                           generation_config: dict[str, Any] | None) -> None:
    """Make `path`'s template the tokenizer's (so rows render with it and it is saved with the model); from a
    folder, its end-of-sequence token too, in the tokenizer, the model config and the generation config."""
    text, source = read_chat_template_path(path, tokenizer)
    tokenizer.chat_template = text
    eos = None if source is None else source.special_tokens.get("eos_token")
    if eos is None:
        return
    tokenizer.special_tokens["eos_token"] = eos
    model_config.eos_token_id = tokenizer.eos_token_id
    if generation_config is not None:
        generation_config["eos_token_id"] = tokenizer.eos_token_id


# How `assistant_only_loss` finds the assistant's tokens, as the start-up summary says it.
FROM_GENERATION_BLOCKS = "the chat template's generation blocks"
FROM_PREFIXES = ("what each assistant message adds to the chat template's renderings of the conversation's "
                 "prefixes, the template having no generation block")


def assistant_mask_source(tokenizer: Tokenizer) -> str:
    """How `assistant_only_loss` will find the assistant's tokens: the template's `{% generation %}`
    blocks where it has them, else each assistant message's part of the renderings of the conversation's
    prefixes (`assistant_spans_from_prefixes`). A tokenizer with no usable template is refused up front."""
    try:
        source = select_chat_template(tokenizer.chat_template)
    except ChatTemplateError as e:
        raise ValueError(f"assistant_only_loss: {e}; set chat_template_path to the chat template to train "
                         "with") from None
    return FROM_GENERATION_BLOCKS if has_generation_block(source) else FROM_PREFIXES


def stop_token_trained(tokenizer: Tokenizer) -> bool:
    """Whether the assistant's end-of-turn token is among its tokens (TRL's probe: a user, an assistant and
    a user message; the last non-blank assistant token must be an added token, not text), found as
    `assistant_only_loss` finds them. A template that leaves it to the next message trains a model that
    never learns to stop. A template the probe finds not prefix-preserving raises `NotPrefixPreserving`."""
    probe = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"},
             {"role": "user", "content": "dummy"}]
    try:
        ids, mask = tokenizer.chat_assistant_mask(probe, prefix_turns=True)
    except NotPrefixPreserving:
        raise
    except ChatTemplateError:
        return False
    added = set(tokenizer.backend.get_added_tokens_decoder())
    for i in reversed([i for i, m in zip(ids, mask, strict=True) if m]):
        if tokenizer.decode([i], skip_special_tokens=False).strip():
            return i in added
    return False
