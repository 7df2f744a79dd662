"""Rows of a dataset turned into training examples, one converter per TRL format: the fields checked
(a plain string or a list of chat messages), tokenized as TRL 1.16 does (`train/tokenization.py`), and
cut to `max_length` as the config's `truncation` says. Reading and loading rows: `train/data.py`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.data import BadRow, DataReport, Row, Truncation, kind_of
from pagedrl.train.tokenization import (
    Text,
    extract_prompt,
    is_conversational,
    tokenize_assistant_masked,
    tokenize_preference,
    tokenize_prompt,
    tokenize_prompt_completion,
    with_eos,
)

# ---------------------------------------------------------------------------------------------
# Fields
# ---------------------------------------------------------------------------------------------


def text_field(row: Row, key: str, allow_empty: bool = False) -> Text:
    """A plain string or a list of chat messages, checked."""
    if key not in row.values:
        raise BadRow(key, f"missing (row has {', '.join(map(repr, row.values)) or 'no keys'})", f"missing {key!r}")
    value = row.values[key]
    if isinstance(value, str):
        if not value and not allow_empty:
            raise BadRow(key, "empty string", f"empty {key!r}")
        return value
    if isinstance(value, list):
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
                raise BadRow(key, f"message {i} is not a {{'role': str, 'content': ...}} object",
                             f"malformed {key!r} messages")
        if not value and not allow_empty:
            raise BadRow(key, "empty list of messages", f"empty {key!r}")
        return value
    raise BadRow(key, f"expected a string or a list of chat messages, got {kind_of(value)}", f"wrong type of {key!r}")


def samekind_of(row: Row, values: Mapping[str, Text]) -> bool:
    """Whether the fields are all plain or all chat (TRL decides per row from the prompt)."""
    kinds = {k: is_conversational(v) for k, v in values.items()}
    if len(set(kinds.values())) > 1:
        chat = [k for k, c in kinds.items() if c]
        plain = [k for k, c in kinds.items() if not c]
        raise BadRow(plain[0], f"is a plain string while {', '.join(chat)} is a list of chat messages",
                     "plain and chat fields mixed")
    return next(iter(kinds.values()))


def extra_columns(row: Row, used: Sequence[str]) -> dict[str, Any]:
    return {k: v for k, v in row.values.items() if k not in used}


TEMPLATE_COLUMNS = ("tools", "chat_template_kwargs")
# Keywords the trainer itself gives the chat template: a row's chat_template_kwargs may not set them.
TRAINER_KEYWORDS = ("messages", "conversation", "add_generation_prompt", "tokenize", "return_dict")
MEDIA_COLUMNS = ("image", "images", "video", "videos")


def template_kwargs(row: Row) -> dict[str, Any]:
    """What a chat row gives its chat template, as TRL 1.16's trainers pass it: `tools` (a list of
    JSON schemas, or a JSON string of one, which is how a column of them survives Arrow) and the
    keywords in `chat_template_kwargs` (e.g. `enable_thinking`). An empty tool list is no tools, as
    TRL's `apply_chat_template` treats it (some templates write tool instructions for an empty one)."""
    tools = row.values.get("tools")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise BadRow("tools", f"a string that is not JSON ({e.msg} at column {e.colno})", "malformed 'tools'") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise BadRow("tools", f"expected a list of JSON schema objects, got {kind_of(tools)}", "malformed 'tools'")
    extra = row.values.get("chat_template_kwargs")
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise BadRow("chat_template_kwargs", f"expected an object of template keywords, got {kind_of(extra)}",
                     "malformed 'chat_template_kwargs'")
    if taken := [k for k in TRAINER_KEYWORDS if k in extra]:
        raise BadRow("chat_template_kwargs", f"{', '.join(map(repr, taken))} is the trainer's to set, not a row's",
                     "malformed 'chat_template_kwargs'")
    return {"tools": tools or None, **extra}


def refuse_media(row: Row) -> None:
    """A row with images or videos would train on its text alone, as if they were not there, so it
    is refused; an empty or null column (a text row of a mixed dataset) is fine."""
    for key in MEDIA_COLUMNS:
        value = row.values.get(key)
        if value is not None and not (isinstance(value, (list, tuple, str)) and not value):
            raise BadRow(key, "images and videos are not supported: pagedrl trains on text only (a null or empty "
                         f"{key!r} is accepted)", "has images or videos")


def fit_length(prompt_ids: list[int], completion_ids: list[int], max_length: int | None, truncation: Truncation,
               field_name: str, keep_end: bool = False) -> tuple[list[int], list[int]] | None:
    """Apply `max_length` to one prompt + completion: keep the start (TRL's keep_start) or with `keep_end`
    the last `max_length` tokens (TRL's keep_end: the prompt's start goes first, then the completion's),
    skip the row (None: the caller counts it) or refuse it (BadRow), as `truncation` says."""
    total = len(prompt_ids) + len(completion_ids)
    if max_length is None or total <= max_length:
        return prompt_ids, completion_ids
    if truncation == "error":
        raise BadRow(field_name, f"prompt + {field_name} is {total} tokens, longer than max_length={max_length} "
                     "(set truncation to 'truncate' or 'skip', or raise max_length)", "longer than max_length")
    if truncation == "skip":
        return None
    if keep_end:
        cut = total - max_length
        return prompt_ids[cut:], completion_ids[max(0, cut - len(prompt_ids)):]
    if len(prompt_ids) >= max_length:
        raise BadRow("prompt", f"the prompt alone is {len(prompt_ids)} tokens, so truncating to max_length="
                     f"{max_length} leaves no {field_name} token to learn from", "prompt fills max_length")
    return prompt_ids, completion_ids[: max_length - len(prompt_ids)]


# ---------------------------------------------------------------------------------------------
# Examples: one converter per format
# ---------------------------------------------------------------------------------------------


@dataclass
class PromptCompletion:
    """One SFT example: loss on `completion_ids` (or on every token when `loss_on_prompt`), and with
    `assistant_mask` (assistant_only_loss) only on those of its tokens the assistant wrote."""

    prompt_ids: list[int]
    completion_ids: list[int]
    where: str
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for reward functions
    # over prompt + completion: the assistant's tokens (a `wrapped` packed row's: its labelled tokens)
    assistant_mask: list[bool] | None = None

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


def label_mask(example: PromptCompletion, completion_only: bool) -> list[bool]:
    """Which tokens carry a label: the completion's, or every token without completion_only; of those, with
    an assistant mask (assistant_only_loss, or a `wrapped` packed row's labels), the mask's only, as TRL's
    labels need every mask's 1."""
    n_prompt, mask = len(example.prompt_ids), example.assistant_mask
    return [(completion_only is False or i >= n_prompt) and (mask is None or mask[i])
            for i in range(len(example.input_ids))]


# TRL 1.16's SFTTrainer's words for an example with no assistant token under assistant_only_loss.
NO_ASSISTANT_TOKENS = ("has no assistant tokens (assistant_only_loss: true). This usually means the tokenizer's chat "
                       "template doesn't generate assistant masks — it may be missing the `{% generation %}` keyword. "
                       "Please check the template and ensure it's correctly configured to support assistant masking")


class PromptCompletionRows:
    """Row converter for SFT: prompt-completion rows, or language-modeling rows (`text_field` or
    `messages`) as a completion with an empty prompt. `assistant_only`: chat rows only, each token
    marked as the assistant's or not by the chat template's `{% generation %}` blocks, or, in a template
    without them, by what each assistant message adds to the renderings of the conversation's prefixes.
    `keep_end`: a row longer than `max_length` keeps its last tokens (TRL's truncation_mode keep_end)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int | None, truncation: Truncation = "truncate",
                 text_field_name: str = "text", assistant_only: bool = False, keep_end: bool = False) -> None:
        _check_truncation(truncation)
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation
        self.text_field, self.assistant_only, self.keep_end = text_field_name, assistant_only, keep_end

    def __call__(self, row: Row, report: DataReport) -> PromptCompletion | None:
        refuse_media(row)
        template = template_kwargs(row)
        mask: list[bool] | None = None
        if "prompt" in row.values or "completion" in row.values:
            prompt = text_field(row, "prompt", allow_empty=True)
            completion = text_field(row, "completion")
            chat = samekind_of(row, {"prompt": prompt, "completion": completion})
            used: tuple[str, ...] = ("prompt", "completion")
            self._need_chat(chat, "completion")
            if self.assistant_only:
                prompt_ids, completion_ids, mask = tokenize_assistant_masked(self.tokenizer, prompt, completion,
                                                                             template)
            else:
                prompt_ids, completion_ids = tokenize_prompt_completion(self.tokenizer, prompt, completion, template)
        elif self.text_field in row.values or "messages" in row.values:
            key = self.text_field if self.text_field in row.values else "messages"
            text = text_field(row, key)
            used = (key,)
            self._need_chat(is_conversational(text), key)
            if self.assistant_only:
                prompt_ids, completion_ids, mask = tokenize_assistant_masked(self.tokenizer, None, text, template)
            elif is_conversational(text):
                prompt_ids, completion_ids = [], list(self.tokenizer.apply_chat_template(text, tokenize=True, **template))
            else:
                prompt_ids, completion_ids = [], self.tokenizer.encode(with_eos(text, self.tokenizer))
        else:
            raise BadRow("prompt", f"missing: expected 'prompt' and 'completion' (or {self.text_field!r} or "
                         f"'messages'), row has {', '.join(map(repr, row.values)) or 'no keys'}", "missing 'prompt'")
        if not completion_ids:
            raise BadRow(used[-1], "tokenizes to nothing after the prompt", f"empty {used[-1]!r}")
        if mask is not None and not any(mask):
            raise BadRow(used[-1], NO_ASSISTANT_TOKENS, "no assistant tokens")
        fitted = fit_length(prompt_ids, completion_ids, self.max_length, self.truncation, used[-1], self.keep_end)
        if fitted is None:
            report.skip(f"longer than max_length={self.max_length}", row.where)
            return None
        kept = len(fitted[0]) + len(fitted[1])
        if mask is not None:
            mask = mask[len(mask) - kept:] if self.keep_end else mask[:kept]
            if not any(mask):  # as TRL drops an example its truncation left without a label
                report.skip(f"no assistant token within max_length={self.max_length}", row.where)
                return None
        if kept < len(prompt_ids) + len(completion_ids):
            report.truncated += 1
        return PromptCompletion(fitted[0], fitted[1], row.where, extra_columns(row, (*used, *TEMPLATE_COLUMNS)), mask)

    def _need_chat(self, chat: bool, key: str) -> None:
        if self.assistant_only and not chat:
            raise BadRow(key, "is plain text, and assistant_only_loss: true needs conversational rows (lists of chat "
                         "messages), whose assistant turns the chat template renders; TRL refuses a dataset that "
                         "is not conversational too", "plain text with assistant_only_loss")


@dataclass
class Preference:
    """One DPO / reward-model pair: a shared prompt, two answers, an optional margin."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    where: str
    margin: float | None = None
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for reward functions
    # The rejected answer's own prompt, where DPO's keep_end truncation left it another part of the prompt
    # than the chosen answer's (`prompt_ids`); None: the two share `prompt_ids`.
    rejected_prompt_ids: list[int] | None = None


def preference_texts(row: Row) -> dict[str, Text]:
    """A `{prompt, chosen, rejected}` row's three texts (or message lists), the prompt split off the answers'
    shared start where the row has none, as TRL's `extract_prompt` does: read once for DPO and reward models,
    and for KTO's unpairing of such rows."""
    values = {k: text_field(row, k, allow_empty=k == "prompt") for k in ("prompt", "chosen", "rejected")
              if k != "prompt" or "prompt" in row.values}
    chat = samekind_of(row, values)
    if "prompt" not in values:
        values = dict(zip(("prompt", "chosen", "rejected"), extract_prompt(values["chosen"], values["rejected"]),
                          strict=True))
        if chat and not values["prompt"]:  # a template renders no conversation from no messages
            raise BadRow("chosen", "shares no first message with 'rejected', so there is no prompt to take "
                         "from their start (give the row a 'prompt')", "no shared prompt")
    return values


class PreferenceRows:
    """Row converter for `{"prompt", "chosen", "rejected"}` (+ optional numeric `margin`), or
    `{"chosen", "rejected"}` with the prompt implicit: the start both share, split off as TRL's
    `extract_prompt` does (TRL's DPO and reward trainers take both kinds of row).
    `prompt_ids + chosen_ids` is the whole conversation tokenized at once, which is what TRL's
    reward trainer scores; the prompt is cut where both answers leave it, as TRL's DPO does.
    `max_length` applies to each of prompt + chosen and prompt + rejected, as TRL's DPO collator cuts each:
    keeping the start, or with `keep_end` the last `max_length` tokens, which may leave the two answers
    different parts of the prompt (`Preference.rejected_prompt_ids`)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int | None, truncation: Truncation = "truncate",
                 keep_end: bool = False) -> None:
        _check_truncation(truncation)
        self.tokenizer, self.max_length, self.truncation, self.keep_end = tokenizer, max_length, truncation, keep_end

    def __call__(self, row: Row, report: DataReport) -> Preference | None:
        refuse_media(row)
        template = template_kwargs(row)
        values = preference_texts(row)
        margin = row.values.get("margin")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))):
            raise BadRow("margin", f"expected a number, got {kind_of(margin)}", "wrong type of 'margin'")
        if margin is not None and not math.isfinite(margin):  # Python's JSON reads NaN and Infinity
            raise BadRow("margin", f"expected a finite number, got {margin}", "non-finite 'margin'")
        prompt_ids, chosen_ids, rejected_ids = tokenize_preference(self.tokenizer, values["prompt"], values["chosen"],
                                                                   values["rejected"], template)
        for key, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
            if not ids:
                raise BadRow(key, "tokenizes to nothing after the prompt", f"empty {key!r}")
        chosen = fit_length(prompt_ids, chosen_ids, self.max_length, self.truncation, "chosen", self.keep_end)
        rejected = fit_length(prompt_ids, rejected_ids, self.max_length, self.truncation, "rejected", self.keep_end)
        if chosen is None or rejected is None:
            report.skip(f"longer than max_length={self.max_length}", row.where)
            return None
        if sum(map(len, chosen)) < len(prompt_ids) + len(chosen_ids) or \
                sum(map(len, rejected)) < len(prompt_ids) + len(rejected_ids):
            report.truncated += 1
        return Preference(chosen[0], chosen[1], rejected[1], row.where,
                          None if margin is None else float(margin),
                          extra_columns(row, ("prompt", "chosen", "rejected", "margin", *TEMPLATE_COLUMNS)),
                          None if len(rejected[0]) == len(chosen[0]) else rejected[0])


@dataclass
class PromptOnly:
    """One GRPO / PPO prompt: its ids, the prompt as given (for reward functions), other columns."""

    prompt_ids: list[int]
    prompt: Text
    where: str
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for reward functions
    template: dict[str, Any] = field(default_factory=dict)  # what the chat template was given with a chat prompt


class PromptRows:
    """Row converter for `{"prompt"}`. A prompt longer than `max_length` is refused ("error"),
    skipped, or cut to its last `max_length` tokens ("truncate": the end of a prompt is what
    the answer follows)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int | None, truncation: Truncation = "error",
                 limit_name: str = "max_length") -> None:
        _check_truncation(truncation)
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation
        self.limit_name = limit_name  # the config field the limit came from, for messages

    def __call__(self, row: Row, report: DataReport) -> PromptOnly | None:
        refuse_media(row)
        template = template_kwargs(row)
        prompt = text_field(row, "prompt")
        ids = tokenize_prompt(self.tokenizer, prompt, template)
        if self.max_length is not None and len(ids) > self.max_length:
            if self.truncation == "error":
                raise BadRow("prompt", f"{len(ids)} tokens, longer than {self.limit_name}={self.max_length}",
                             f"longer than {self.limit_name}")
            if self.truncation == "skip":
                report.skip(f"longer than {self.limit_name}={self.max_length}", row.where)
                return None
            ids = ids[-self.max_length:]
            report.truncated += 1
        return PromptOnly(ids, prompt, row.where, extra_columns(row, ("prompt",)), template)


def _check_truncation(truncation: str) -> None:
    if truncation not in ("truncate", "skip", "error"):
        raise ValueError(f"truncation: expected 'truncate', 'skip' or 'error', got {truncation!r}")
