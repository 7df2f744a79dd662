"""KTO's data: TRL's unpaired preference rows `{"prompt", "completion", "label"}`, each completion judged
desirable (`label: true`) or undesirable on its own, plain text or chat messages, tokenized as TRL 1.16's
KTOTrainer tokenizes them (`tokenize_prompt_completion`: EOS text after a plain completion, the split where
prompt and prompt + completion part), and each row's KL completion: the completion of the row before it in
its block of `per_device_train_batch_size` rows, the block's first taking the block's last (`pair_kl`), as
TRL draws them, so that the mismatched pairs that estimate KTO's KL term reuse the block's own completions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.data import BadRow, DataReport, Row, Truncation, kind_of
from pagedrl.train.examples import (
    TEMPLATE_COLUMNS,
    extra_columns,
    fit_length,
    refuse_media,
    samekind_of,
    template_kwargs,
    text_field,
)
from pagedrl.train.tokenization import tokenize_prompt_completion


@dataclass
class Unpaired:
    """One KTO row: the completion cut to max_length with its prompt, whether it is desirable, and the whole
    completion (a neighbour's KL completion is cut against this row's prompt, not its own)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    desirable: bool
    where: str
    whole_completion_ids: list[int]
    kl_completion_ids: list[int] = field(default_factory=list)  # set by `pair_kl`
    columns: dict[str, Any] = field(default_factory=dict)


class UnpairedRows:
    """Row converter for `{"prompt", "completion", "label"}`; `max_length` bounds prompt + completion as
    the config's `truncation` says (TRL 1.16 keeps the start)."""

    def __init__(self, tokenizer: Tokenizer, max_length: int | None, truncation: Truncation = "truncate") -> None:
        self.tokenizer, self.max_length, self.truncation = tokenizer, max_length, truncation

    def __call__(self, row: Row, report: DataReport) -> Unpaired | None:
        refuse_media(row)
        if "completion" not in row.values and ("chosen" in row.values or "rejected" in row.values):
            raise BadRow("completion", "missing: KTO reads unpaired rows {prompt, completion, label}; a paired "
                         "{prompt, chosen, rejected} row is two of them, the chosen answer with label true and the "
                         "rejected one with label false", "paired row")
        template = template_kwargs(row)
        prompt = text_field(row, "prompt", allow_empty=True)
        completion = text_field(row, "completion")
        samekind_of(row, {"prompt": prompt, "completion": completion})
        if "label" not in row.values:
            raise BadRow("label", "missing: each row needs label true (a desirable completion) or false",
                         "missing 'label'")
        label = row.values["label"]
        if not isinstance(label, bool):
            raise BadRow("label", f"expected true or false, got {kind_of(label)} {label!r}", "wrong type of 'label'")
        prompt_ids, completion_ids = tokenize_prompt_completion(self.tokenizer, prompt, completion, template)
        if not completion_ids:
            raise BadRow("completion", "tokenizes to nothing after the prompt", "empty 'completion'")
        fitted = fit_length(prompt_ids, completion_ids, self.max_length, self.truncation, "completion")
        if fitted is None:
            report.skip(f"longer than max_length={self.max_length}", row.where)
            return None
        if len(fitted[1]) < len(completion_ids):
            report.truncated += 1
        return Unpaired(fitted[0], fitted[1], label, row.where, completion_ids,
                        columns=extra_columns(row, ("prompt", "completion", "label", *TEMPLATE_COLUMNS)))


def pair_kl(rows: Sequence[Unpaired], block: int, max_length: int | None) -> None:
    """Give each row its KL completion: in each block of `block` rows (in dataset order; the last may be
    shorter), row i takes row i-1's whole completion and the first row the last's, TRL 1.16's
    (x₁, y_n), (x₂, y₁), …, (x_n, y_{n-1}); cut so that prompt + KL completion fits `max_length`, as TRL's
    collator cuts the KL sequence."""
    for start in range(0, len(rows), block):
        chunk = rows[start:start + block]
        for i, row in enumerate(chunk):
            ids = chunk[i - 1].whole_completion_ids
            room = None if max_length is None else max(max_length - len(row.prompt_ids), 0)
            row.kl_completion_ids = list(ids if room is None else ids[:room])
