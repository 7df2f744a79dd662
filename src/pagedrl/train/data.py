"""Training data in TRL's formats: JSONL files or Python lists, checked row by row, tokenized so
the loss falls on completion tokens only.

Formats (each text field a plain string or a list of chat messages `{"role", "content"}`):
`{"prompt", "completion"}` (SFT), `{"prompt", "chosen", "rejected"}` with an optional numeric
`margin` (DPO, reward model), `{"prompt"}` (GRPO, PPO), and TRL's language-modeling rows
`{"text"}` / `{"messages"}` (SFT on every token). Other columns are kept as `columns`, for reward
functions.

Tokenization follows TRL 1.16 (`train/tokenization.py`).

A bad row never disappears quietly: it is a `DataError` naming the file, the 1-based line and
the field, or, with `on_bad_row="skip"`, it is counted under its reason in a `DataReport` that
the trainer prints at start.
"""

from __future__ import annotations

import codecs
import json
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.tokenization import (
    Text,
    is_conversational,
    tokenize_preference,
    tokenize_prompt,
    tokenize_prompt_completion,
    with_eos,
)

BadRowPolicy = Literal["error", "skip"]
Truncation = Literal["truncate", "skip", "error"]
T = TypeVar("T")


class DataError(ValueError):
    """A dataset row pagedrl cannot train on; the message starts with `file:line` (or `dataset[i]`)."""


class BadRow(Exception):
    """Raised by a row converter: which field is wrong and why. The loader adds where."""

    def __init__(self, field_name: str, message: str, reason: str | None = None) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message
        self.reason = reason or message


@dataclass
class Row:
    where: str  # "path:line" (1-based) for files, "dataset[i]" for lists
    values: dict[str, Any]


@dataclass
class DataReport:
    """What became of each row: kept, truncated, or skipped (and why, and where first)."""

    source: str
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    skipped: Counter = field(default_factory=Counter)
    first_skipped: dict[str, str] = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        self.first_skipped.setdefault(reason, where)

    def lines(self) -> list[str]:
        out = [f"dataset {self.source}: {self.rows} rows, {self.kept} used"
               + (f", {self.truncated} truncated to max_length" if self.truncated else "")]
        for reason, n in sorted(self.skipped.items()):
            out.append(f"  skipped {n}: {reason} (first at {self.first_skipped[reason]})")
        return out


# ---------------------------------------------------------------------------------------------
# Reading rows
# ---------------------------------------------------------------------------------------------


def read_rows(dataset: str | Path | Sequence[Mapping[str, Any]], report: DataReport,
              on_bad_row: BadRowPolicy = "error") -> Iterator[Row]:
    """Rows of a JSONL file (blank lines ignored) or of a Python list of dicts, in order, so the
    first bad row in the file is the one an error names."""
    _check_policy(on_bad_row)
    if isinstance(dataset, (str, Path)):
        path = Path(dataset)
        if path.is_dir():
            raise DataError(f"dataset: {path} is a folder; expected a JSONL file")
        if not path.is_file():
            raise DataError(f"dataset: file {path} does not exist")
        with path.open("rb") as f:
            for number, raw in enumerate(f, start=1):
                if number == 1:  # a BOM before the first row is how some editors (Notepad, Excel) mark UTF-8
                    raw = raw.removeprefix(codecs.BOM_UTF8)
                if not raw.strip():
                    continue
                report.rows += 1
                where = f"{path}:{number}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    _bad(report, on_bad_row, where, BadRow(
                        "row", f"not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)", "not UTF-8"))
                    continue
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    _bad(report, on_bad_row, where, BadRow("row", f"invalid JSON ({e.msg} at column {e.colno})",
                                                           "invalid JSON"))
                    continue
                if not isinstance(value, dict):
                    _bad(report, on_bad_row, where, BadRow("row", f"expected a JSON object, got {_kind(value)}",
                                                           "not a JSON object"))
                    continue
                yield Row(where, value)
        return
    if isinstance(dataset, Mapping) or not isinstance(dataset, Sequence):
        raise DataError(f"dataset: expected a JSONL path or a list of dicts, got {type(dataset).__name__}")
    for i, value in enumerate(dataset):
        report.rows += 1
        if not isinstance(value, Mapping):
            _bad(report, on_bad_row, f"dataset[{i}]", BadRow("row", f"expected a dict, got {_kind(value)}",
                                                             "not a dict"))
            continue
        yield Row(f"dataset[{i}]", dict(value))


def load_examples(dataset: str | Path | Sequence[Mapping[str, Any]],
                  convert: Callable[[Row, DataReport], T | None],
                  on_bad_row: BadRowPolicy = "error") -> tuple[list[T], DataReport]:
    """Read and convert every row. A `BadRow` from reading or from `convert` becomes a DataError
    naming the row, or a counted skip; `convert` returning None means skipped by policy (it
    records its own reason in the report)."""
    if not isinstance(dataset, (str, Path)) and (isinstance(dataset, Mapping) or not isinstance(dataset, Sequence)):
        raise DataError(f"dataset: expected a JSONL path or a list of dicts, got {type(dataset).__name__}")
    source = str(dataset) if isinstance(dataset, (str, Path)) else f"<list of {len(dataset)} rows>"
    report = DataReport(source)
    examples: list[T] = []
    for row in read_rows(dataset, report, on_bad_row):
        try:
            out = convert(row, report)
        except BadRow as e:
            _bad(report, on_bad_row, row.where, e)
            continue
        if out is not None:
            examples.append(out)
    report.kept = len(examples)
    if not examples:
        raise DataError(f"dataset {source}: no usable rows ({report.rows} read; "
                        + (", ".join(f"{n} {r}" for r, n in report.skipped.items()) or "the dataset is empty") + ")")
    return examples, report


def load_train_and_eval(config: Any, dataset: Any, eval_dataset: Any, convert: Callable[[Row, DataReport], T | None],
                        needs: str) -> tuple[list[T], DataReport, list[T] | None]:
    """The training rows (`dataset`, else `config.dataset`) and the evaluation rows (`eval_dataset`,
    else `config.eval_dataset`, else none), both under the config's bad-row policy."""
    dataset = dataset if dataset is not None else config.dataset
    if dataset is None:
        raise ValueError(f"dataset: {needs} (a JSONL path, or a list of rows through the API)")
    examples, report = load_examples(dataset, convert, config.on_bad_row)
    eval_source = eval_dataset if eval_dataset is not None else config.eval_dataset
    eval_examples = load_examples(eval_source, convert, config.on_bad_row)[0] if eval_source is not None else None
    return examples, report, eval_examples


def _bad(report: DataReport, policy: BadRowPolicy, where: str, error: BadRow) -> None:
    if policy == "error":
        raise DataError(f"{where}: {error}")
    report.skip(error.reason, where)


def _check_policy(policy: str) -> None:
    if policy not in ("error", "skip"):
        raise ValueError(f"on_bad_row: expected 'error' or 'skip', got {policy!r}")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)


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
    raise BadRow(key, f"expected a string or a list of chat messages, got {_kind(value)}", f"wrong type of {key!r}")


def same_kind(row: Row, values: Mapping[str, Text]) -> bool:
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


def fit_length(prompt_ids: list[int], completion_ids: list[int], max_length: int | None, truncation: Truncation,
               field_name: str) -> tuple[list[int], list[int]] | None:
    """Apply `max_length` to one prompt + completion: keep the start (TRL's keep_start), skip the
    row (None: the caller counts it) or refuse it (BadRow), as `truncation` says."""
    total = len(prompt_ids) + len(completion_ids)
    if max_length is None or total <= max_length:
        return prompt_ids, completion_ids
    if truncation == "error":
        raise BadRow(field_name, f"prompt + {field_name} is {total} tokens, longer than max_length={max_length} "
                     "(set truncation to 'truncate' or 'skip', or raise max_length)", "longer than max_length")
    if truncation == "skip":
        return None
    if len(prompt_ids) >= max_length:
        raise BadRow("prompt", f"the prompt alone is {len(prompt_ids)} tokens, so truncating to max_length="
                     f"{max_length} leaves no {field_name} token to learn from", "prompt fills max_length")
    return prompt_ids, completion_ids[: max_length - len(prompt_ids)]


# ---------------------------------------------------------------------------------------------
# Examples: one converter per format
# ---------------------------------------------------------------------------------------------


@dataclass
class PromptCompletion:
    """One SFT example: loss on `completion_ids` (or on every token when `loss_on_prompt`)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    where: str
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for reward functions

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


class PromptCompletionRows:
    """Row converter for SFT: prompt-completion rows, or language-modeling rows (`text_field` or
    `messages`) as a completion with an empty prompt."""

    def __init__(self, tokenizer: Tokenizer, max_length: int | None, truncation: Truncation = "truncate",
                 text_field_name: str = "text") -> None:
        _check_truncation(truncation)
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation
        self.text_field = text_field_name

    def __call__(self, row: Row, report: DataReport) -> PromptCompletion | None:
        if "prompt" in row.values or "completion" in row.values:
            prompt = text_field(row, "prompt", allow_empty=True)
            completion = text_field(row, "completion")
            same_kind(row, {"prompt": prompt, "completion": completion})
            used = ("prompt", "completion")
            prompt_ids, completion_ids = tokenize_prompt_completion(self.tokenizer, prompt, completion)
        elif self.text_field in row.values or "messages" in row.values:
            key = self.text_field if self.text_field in row.values else "messages"
            text = text_field(row, key)
            used = (key,)
            if is_conversational(text):
                prompt_ids, completion_ids = [], list(self.tokenizer.apply_chat_template(text, tokenize=True))
            else:
                prompt_ids, completion_ids = [], self.tokenizer.encode(with_eos(text, self.tokenizer))
        else:
            raise BadRow("prompt", f"missing: expected 'prompt' and 'completion' (or {self.text_field!r} or "
                         f"'messages'), row has {', '.join(map(repr, row.values)) or 'no keys'}", "missing 'prompt'")
        if not completion_ids:
            raise BadRow(used[-1], "tokenizes to nothing after the prompt", f"empty {used[-1]!r}")
        fitted = fit_length(prompt_ids, completion_ids, self.max_length, self.truncation, used[-1])
        if fitted is None:
            report.skip(f"longer than max_length={self.max_length}", row.where)
            return None
        if len(fitted[1]) < len(completion_ids):
            report.truncated += 1
        return PromptCompletion(fitted[0], fitted[1], row.where, extra_columns(row, used))


@dataclass
class Preference:
    """One DPO / reward-model pair: a shared prompt, two answers, an optional margin."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    where: str
    margin: float | None = None
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for reward functions


class PreferenceRows:
    """Row converter for `{"prompt", "chosen", "rejected"}` (+ optional numeric `margin`).
    `prompt_ids + chosen_ids` is the whole conversation tokenized at once, which is what TRL's
    reward trainer scores; the prompt is cut where both answers leave it, as TRL's DPO does.
    `max_length` applies to each of prompt + chosen and prompt + rejected."""

    def __init__(self, tokenizer: Tokenizer, max_length: int | None, truncation: Truncation = "truncate") -> None:
        _check_truncation(truncation)
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation

    def __call__(self, row: Row, report: DataReport) -> Preference | None:
        values = {k: text_field(row, k, allow_empty=k == "prompt") for k in ("prompt", "chosen", "rejected")}
        same_kind(row, values)
        margin = row.values.get("margin")
        if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))):
            raise BadRow("margin", f"expected a number, got {_kind(margin)}", "wrong type of 'margin'")
        prompt_ids, chosen_ids, rejected_ids = tokenize_preference(self.tokenizer, *values.values())
        for key, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
            if not ids:
                raise BadRow(key, "tokenizes to nothing after the prompt", f"empty {key!r}")
        chosen = fit_length(prompt_ids, chosen_ids, self.max_length, self.truncation, "chosen")
        rejected = fit_length(prompt_ids, rejected_ids, self.max_length, self.truncation, "rejected")
        if chosen is None or rejected is None:
            report.skip(f"longer than max_length={self.max_length}", row.where)
            return None
        if len(chosen[1]) < len(chosen_ids) or len(rejected[1]) < len(rejected_ids):
            report.truncated += 1
        return Preference(prompt_ids, chosen[1], rejected[1], row.where,
                          None if margin is None else float(margin),
                          extra_columns(row, ("prompt", "chosen", "rejected", "margin")))


@dataclass
class PromptOnly:
    """One GRPO / PPO prompt: its ids, the prompt as given (for reward functions), other columns."""

    prompt_ids: list[int]
    prompt: Text
    where: str
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for reward functions


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
        prompt = text_field(row, "prompt")
        ids = tokenize_prompt(self.tokenizer, prompt)
        if self.max_length is not None and len(ids) > self.max_length:
            if self.truncation == "error":
                raise BadRow("prompt", f"{len(ids)} tokens, longer than {self.limit_name}={self.max_length}",
                             f"longer than {self.limit_name}")
            if self.truncation == "skip":
                report.skip(f"longer than {self.limit_name}={self.max_length}", row.where)
                return None
            ids = ids[-self.max_length:]
            report.truncated += 1
        return PromptOnly(ids, prompt, row.where, extra_columns(row, ("prompt",)))


def _check_truncation(truncation: str) -> None:
    if truncation not in ("truncate", "skip", "error"):
        raise ValueError(f"truncation: expected 'truncate', 'skip' or 'error', got {truncation!r}")
