"""How a prompt and its completion(s) become token ids, following TRL 1.16.

Plain text is `prompt` and `prompt + completion` tokenized as they are (EOS text appended to a
completion that lacks it); chat is the prompt rendered with the generation prompt and the whole
conversation rendered without it. The completion starts where the two token lists first differ,
which is after the prompt except when a template renders the prompt differently alone or tokens
merge across the boundary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedrl.model.tokenizer import Tokenizer

Text = str | list[dict[str, Any]]  # a plain string, or a list of chat messages {"role", "content"}
NO_KWARGS: Mapping[str, Any] = {}


def is_conversational(value: Text) -> bool:
    return isinstance(value, list)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def with_eos(text: str, tokenizer: Tokenizer) -> str:
    """A plain-text completion ends with the EOS token's text, as TRL appends it."""
    eos = tokenizer.special_tokens.get("eos_token")
    return text if eos is None or text.endswith(eos) else text + eos


def tokenize_prompt(tokenizer: Tokenizer, prompt: Text, chat: Mapping[str, Any] = NO_KWARGS) -> list[int]:
    """A prompt alone: chat rendered with the generation prompt, plain text with special tokens.
    `chat`: the row's keywords for the chat template (`tools`, `chat_template_kwargs`), which TRL
    gives only to chat rows."""
    if is_conversational(prompt):
        return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, **chat))
    return tokenizer.encode(prompt)


def tokenize_full(tokenizer: Tokenizer, prompt: Text, completion: Text,
                  chat: Mapping[str, Any] = NO_KWARGS) -> list[int]:
    """Prompt and completion as one sequence (the completion already carries EOS if plain)."""
    if is_conversational(prompt):
        return list(tokenizer.apply_chat_template(list(prompt) + list(completion), tokenize=True, **chat))
    return tokenizer.encode(prompt + completion)


def tokenize_prompt_completion(tokenizer: Tokenizer, prompt: Text, completion: Text,
                               chat: Mapping[str, Any] = NO_KWARGS) -> tuple[list[int], list[int]]:
    """(prompt ids, completion ids), split where the prompt's tokens stop matching the whole's."""
    if not is_conversational(completion):
        completion = with_eos(completion, tokenizer)
    prompt_ids = tokenize_prompt(tokenizer, prompt, chat)
    full = tokenize_full(tokenizer, prompt, completion, chat)
    n = common_prefix_length(prompt_ids, full)
    return full[:n], full[n:]


def tokenize_assistant_masked(tokenizer: Tokenizer, prompt: Text | None, completion: Text,
                              chat: Mapping[str, Any] = NO_KWARGS) -> tuple[list[int], list[int], list[bool]]:
    """A chat row for `assistant_only_loss`: (prompt ids, completion ids, which tokens of prompt +
    completion the assistant wrote). `prompt` None: a `messages` row, all completion. The mask is the
    whole conversation's, rendered at once (`Tokenizer.chat_assistant_mask`), as TRL takes it from
    the prompt + completion's rendering; the split is `tokenize_prompt_completion`'s. A template without
    `{% generation %}` blocks has each assistant message's tokens found from the renderings of the
    conversation's prefixes, as TRL's training templates mark them."""
    if prompt is None:
        ids, mask = tokenizer.chat_assistant_mask(completion, prefix_turns=True, **chat)  # type: ignore[arg-type]
        return [], ids, [bool(m) for m in mask]
    prompt_ids = tokenize_prompt(tokenizer, prompt, chat)
    full, mask = tokenizer.chat_assistant_mask(list(prompt) + list(completion), prefix_turns=True, **chat)
    n = common_prefix_length(prompt_ids, full)
    return full[:n], full[n:], [bool(m) for m in mask]


def tokenize_preference(tokenizer: Tokenizer, prompt: Text, chosen: Text, rejected: Text,
                        chat: Mapping[str, Any] = NO_KWARGS) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids), one shared prompt cut where both answers diverge."""
    if not is_conversational(chosen):
        chosen, rejected = with_eos(chosen, tokenizer), with_eos(rejected, tokenizer)
    prompt_ids = tokenize_prompt(tokenizer, prompt, chat)
    full_c = tokenize_full(tokenizer, prompt, chosen, chat)
    full_r = tokenize_full(tokenizer, prompt, rejected, chat)
    n = min(common_prefix_length(prompt_ids, full_c), common_prefix_length(prompt_ids, full_r))
    return full_c[:n], full_c[n:], full_r[n:]


def extract_prompt(chosen: Text, rejected: Text) -> tuple[Text, Text, Text]:
    """(prompt, chosen, rejected) of a pair whose prompt is implicit, the start both answers share,
    split as TRL 1.16's `extract_prompt` splits it, so a dataset TRL's DPOTrainer reads trains on the
    same prompt here: at the first character (or message) where they differ, moved back before a
    space that precedes it; when one answer starts with all of the other, the last shared element
    stays in both answers, so neither is left empty. One difference: TRL, finding the answers differ
    from their first character, reads the character before it as the answer's last (Python's index
    -1), which cuts all but the last character into the prompt when chosen ends with a space; here a
    pair that shares nothing has an empty prompt, which is what TRL gives otherwise."""
    n = min(len(chosen), len(rejected))
    cut = n - 1
    for i in range(n):
        if chosen[i] != rejected[i]:
            cut = i - 1 if i > 0 and chosen[i - 1] == " " else i
            break
    return chosen[:cut], chosen[cut:], rejected[cut:]
