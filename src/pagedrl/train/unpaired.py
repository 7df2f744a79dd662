"""KTO's data: TRL's unpaired preference rows `{"prompt", "completion", "label"}`, each completion judged
desirable (`label: true`) or undesirable on its own, plain text or chat messages, tokenized as TRL 1.16's
KTOTrainer tokenizes them (`tokenize_prompt_completion`: EOS text after a plain completion, the split where
prompt and prompt + completion part). A dataset of paired rows `{"prompt", "chosen", "rejected"}` (or the
prompt implicit, split off as DPO's) is unpaired as TRL's `unpair_preference_dataset` does it (`unpair`):
in each block of 1000 rows, every chosen answer (label true), then every rejected one. Then each row's KL
completion: the completion of the row before it in
its block of `per_device_train_batch_size` rows, the block's first taking the block's last (`pair_kl`), as
TRL draws them, so that the mismatched pairs that estimate KTO's KL term reuse the block's own completions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.data import BadRow, DataError, DataReport, Row, Truncation, kind_of
from pagedrl.train.examples import (
    TEMPLATE_COLUMNS,
    extra_columns,
    fit_length,
    preference_texts,
    refuse_media,
    samekind_of,
    template_kwargs,
    text_field,
)
from pagedrl.train.tokenization import Text, tokenize_prompt_completion

UNPAIR_BLOCK = 1000  # the rows of one `datasets.map` batch, in which TRL's unpair_preference_dataset orders them


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

    def __call__(self, row: Row, report: DataReport) -> Unpaired | tuple[Unpaired, ...] | None:
        refuse_media(row)
        template = template_kwargs(row)
        if "completion" not in row.values and ("chosen" in row.values or "rejected" in row.values):
            return self.paired(row, template, report)
        prompt = text_field(row, "prompt", allow_empty=True)
        completion = text_field(row, "completion")
        samekind_of(row, {"prompt": prompt, "completion": completion})
        if "label" not in row.values:
            raise BadRow("label", "missing: each row needs label true (a desirable completion) or false",
                         "missing 'label'")
        label = row.values["label"]
        if not isinstance(label, bool):
            raise BadRow("label", f"expected true or false, got {kind_of(label)} {label!r}", "wrong type of 'label'")
        return self.example(row, prompt, completion, label, "completion", template, report)

    def paired(self, row: Row, template: dict[str, Any], report: DataReport) -> tuple[Unpaired, ...] | None:
        """A `{prompt, chosen, rejected}` row as TRL unpairs it: the chosen answer desirable, the rejected one
        not, each with the prompt (split off their shared start where the row has none)."""
        if "label" in row.values:
            raise BadRow("label", "a paired row's answers are labelled by being chosen or rejected; give either "
                         "{prompt, completion, label} or {prompt, chosen, rejected}", "paired row with a label")
        values = preference_texts(row)
        out = (self.example(row, values["prompt"], values[key], key == "chosen", key, template, report)
               for key in ("chosen", "rejected"))
        return tuple(e for e in out if e is not None) or None

    def example(self, row: Row, prompt: Text, completion: Text, label: bool, key: str, template: dict[str, Any],
                report: DataReport) -> Unpaired | None:
        prompt_ids, completion_ids = tokenize_prompt_completion(self.tokenizer, prompt, completion, template)
        if not completion_ids:
            raise BadRow(key, "tokenizes to nothing after the prompt", f"empty {key!r}")
        fitted = fit_length(prompt_ids, completion_ids, self.max_length, self.truncation, key)
        if fitted is None:
            report.skip(f"longer than max_length={self.max_length}", row.where)
            return None
        if len(fitted[1]) < len(completion_ids):
            report.truncated += 1
        used = ("prompt", "completion", "label", "chosen", "rejected", *TEMPLATE_COLUMNS)
        return Unpaired(fitted[0], fitted[1], label, row.where, completion_ids, columns=extra_columns(row, used))


def unpair(items: Sequence[Unpaired | tuple[Unpaired, ...]], source: str) -> list[Unpaired]:
    """The rows in TRL's order: unpaired rows as they come; a dataset of paired rows block by block of
    `UNPAIR_BLOCK` rows, each block's chosen answers first, then its rejected ones. Both kinds in one dataset
    are refused (TRL unpairs by its first row's kind)."""
    paired = bool(items) and isinstance(items[0], tuple)
    odd = next((i for i in items if isinstance(i, tuple) != paired), None)
    if odd is not None:
        where = odd[0].where if isinstance(odd, tuple) else odd.where
        kinds = ("{prompt, completion, label}", "paired {prompt, chosen, rejected}")
        raise DataError(f"{where}: a {kinds[not paired]} row in a dataset of {kinds[paired]} rows (the first row's "
                        f"kind); give {source} rows of one kind")
    if not paired:
        return list(items)  # type: ignore[arg-type]
    pairs: list[tuple[Unpaired, ...]] = list(items)  # type: ignore[arg-type]
    out: list[Unpaired] = []
    for start in range(0, len(pairs), UNPAIR_BLOCK):
        block = [r for p in pairs[start:start + UNPAIR_BLOCK] for r in p]
        out += [r for r in block if r.desirable] + [r for r in block if not r.desirable]
    return out


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
