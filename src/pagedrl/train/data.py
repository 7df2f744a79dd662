"""Training data in TRL's formats: JSONL files or Python lists, read and checked row by row, each
row turned into an example by its format's converter (`train/examples.py`).

Formats (each text field a plain string or a list of chat messages `{"role", "content"}`):
`{"prompt", "completion"}` (SFT), `{"prompt", "chosen", "rejected"}` with an optional numeric
`margin` (DPO, reward model), `{"prompt"}` (GRPO, PPO), and TRL's language-modeling rows
`{"text"}` / `{"messages"}` (SFT on every token). Other columns are kept as `columns`, for reward
functions.

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

from pagedrl.model.chat_template import ChatTemplateError, UnusableTemplate

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
                    _bad(report, on_bad_row, where, BadRow("row", f"expected a JSON object, got {kind_of(value)}",
                                                           "not a JSON object"))
                    continue
                yield Row(where, value)
        return
    if isinstance(dataset, Mapping) or not isinstance(dataset, Sequence):
        raise DataError(f"dataset: expected a JSONL path or a list of dicts, got {type(dataset).__name__}")
    for i, value in enumerate(dataset):
        report.rows += 1
        if not isinstance(value, Mapping):
            _bad(report, on_bad_row, f"dataset[{i}]", BadRow("row", f"expected a dict, got {kind_of(value)}",
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
        except UnusableTemplate as e:  # the model's, not the row's: no row would do
            raise DataError(f"{row.where}: {e}") from None
        except ChatTemplateError as e:
            _bad(report, on_bad_row, row.where, BadRow("row", str(e), "refused by the chat template"))
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
    if eval_source is None:
        return examples, report, None
    eval_examples, eval_report = load_examples(eval_source, convert, config.on_bad_row)
    for reason, n in eval_report.skipped.items():  # skipped evaluation rows are reported with the others
        report.skipped[f"eval_dataset: {reason}"] += n
        report.first_skipped[f"eval_dataset: {reason}"] = eval_report.first_skipped[reason]
    return examples, report, eval_examples


def _bad(report: DataReport, policy: BadRowPolicy, where: str, error: BadRow) -> None:
    if policy == "error":
        raise DataError(f"{where}: {error}")
    report.skip(error.reason, where)


def _check_policy(policy: str) -> None:
    if policy not in ("error", "skip"):
        raise ValueError(f"on_bad_row: expected 'error' or 'skip', got {policy!r}")


def kind_of(value: Any) -> str:
    """A JSON value's kind, as an error message names it."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "a number", float: "a number"}.get(type(value), type(value).__name__)
