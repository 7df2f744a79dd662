"""Training data in TRL's formats: JSONL files, `.json` files holding an array of rows, Parquet and
Arrow files, folders of them and `save_to_disk` folders (`train/data_arrow.py`, one split of them), or
Python sequences of rows (a list of dicts, a `datasets.Dataset`), read and checked row by row, each
row turned into an example by its format's converter (`train/examples.py`). CSV files and Hub ids
are refused with the one line that converts them: nothing is downloaded or converted at run time.

Formats (each text field a plain string or a list of chat messages `{"role", "content"}`):
`{"prompt", "completion"}` (SFT), `{"prompt", "chosen", "rejected"}` with an optional numeric
`margin`, or the prompt left implicit in `chosen` and `rejected` (DPO, reward model), `{"prompt"}`
(GRPO, PPO), and TRL's language-modeling rows `{"text"}` / `{"messages"}` (SFT on every token). A
chat row's `tools` and `chat_template_kwargs` go to the chat template. Other columns are kept as
`columns`, for reward functions.

A bad row never disappears quietly: it is a `DataError` naming the file, the 1-based line (a
Parquet or Arrow file's 0-based row) and the field, or, with `on_bad_row="skip"`, it is counted
under its reason in a `DataReport` that the trainer prints at start.
"""

from __future__ import annotations

import codecs
import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from pagedrl.model.chat_template import ChatTemplateError, UnusableTemplate
from pagedrl.train.data_arrow import TRAIN, ArrowDataError, Split, arrow_files, arrow_rows

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
    where: str  # "path:line" (1-based) for JSON files, "path (row i)" for Arrow's, "dataset[i]" for lists
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
              on_bad_row: BadRowPolicy = "error", split: Split = TRAIN) -> Iterator[Row]:
    """Rows of a JSONL file (blank lines ignored), of a `.json` file holding one JSON array of objects,
    of Parquet or Arrow files (`split` of a folder holding several), or of a Python sequence of dicts
    (a list, a `datasets.Dataset`), in order, so the first bad row is the one an error names. Other
    formats are refused by name, with the one-line conversion."""
    _check_policy(on_bad_row)
    if isinstance(dataset, (str, Path)):
        files = _arrow(lambda: arrow_files(Path(dataset), split))
        if files is not None:
            yield from _checked(_arrow_rows(files), report, on_bad_row)
            return
        path = _data_file(dataset)
        if path.suffix.lower() == ".json":
            raw = path.read_bytes()
            if raw.removeprefix(codecs.BOM_UTF8).lstrip()[:1] in (b"[", b"{"):
                items = _json_document_rows(path, raw)
                if items is not None:
                    yield from _checked(items, report, on_bad_row)
                    return
        yield from _jsonl_rows(path, report, on_bad_row)
        return
    _check_source(dataset)
    yield from _checked(((f"dataset[{i}]", value) for i, value in enumerate(dataset)), report, on_bad_row)


def _arrow(call: Callable[[], T]) -> T:
    try:
        return call()
    except ArrowDataError as e:
        raise DataError(str(e)) from None


def _arrow_rows(files: list[Path]) -> Iterator[tuple[str, Any]]:
    try:
        yield from arrow_rows(files)
    except ArrowDataError as e:
        raise DataError(str(e)) from None


def _jsonl_rows(path: Path, report: DataReport, on_bad_row: BadRowPolicy) -> Iterator[Row]:
    with path.open("rb") as f:
        yield from _json_lines(path, f, report, on_bad_row)


def _json_lines(path: Path, lines: Iterable[bytes], report: DataReport, on_bad_row: BadRowPolicy) -> Iterator[Row]:
    for number, line_bytes in enumerate(lines, start=1):
        if number == 1:  # a BOM before the first row is how some editors (Notepad, Excel) mark UTF-8
            line_bytes = line_bytes.removeprefix(codecs.BOM_UTF8)
        if not line_bytes.strip():
            continue
        report.rows += 1
        where = f"{path}:{number}"
        try:
            line = line_bytes.decode("utf-8")
        except UnicodeDecodeError as e:
            _bad(report, on_bad_row, where, BadRow(
                "row", f"not valid UTF-8 (byte 0x{line_bytes[e.start]:02x} at byte {e.start + 1} of the line)",
                "not UTF-8"))
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            _bad(report, on_bad_row, where, BadRow("row", f"invalid JSON ({e.msg} at column {e.colno})",
                                                   "invalid JSON"))
            continue
        row = _object_row(where, value, report, on_bad_row)
        if row is not None:
            yield row


def _checked(rows: Iterable[tuple[str, Any]], report: DataReport, on_bad_row: BadRowPolicy) -> Iterator[Row]:
    """Count each (where, value) and keep those whose value is a JSON object."""
    for where, value in rows:
        report.rows += 1
        row = _object_row(where, value, report, on_bad_row)
        if row is not None:
            yield row


def _object_row(where: str, value: Any, report: DataReport, on_bad_row: BadRowPolicy) -> Row | None:
    """The row, if its value is a JSON object (a dict); anything else is a bad row."""
    if isinstance(value, Mapping):
        return Row(where, dict(value))
    _bad(report, on_bad_row, where, BadRow("row", f"expected a JSON object, got {kind_of(value)}",
                                           "not a JSON object"))
    return None


def _json_document_rows(path: Path, raw: bytes) -> Iterator[tuple[str, Any]] | None:
    """A `.json` file that is one JSON array of objects, as `datasets.load_dataset("json")` reads it:
    each item named `file:line (item i)`. None when the file is JSON lines after all (one object per
    line, the other layout that loader takes). A syntax error in an array stops the whole file, since
    nothing after it can be told apart, so it is an error under either bad-row policy."""
    body = raw.removeprefix(codecs.BOM_UTF8).strip()
    if body.startswith(b"{"):
        try:
            json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return None  # JSON lines
        if b"\n" not in body:
            return None  # one row on one line
        raise DataError(f"dataset: {path} holds one JSON object over several lines; pagedrl reads a JSON array "
                        "of row objects, or JSON lines (one row object per line)")
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}:{line}: row: not valid UTF-8 (byte 0x{raw[e.start]:02x})") from None
    return _json_array_items(path, text)


def _json_array_items(path: Path, text: str) -> Iterator[tuple[str, Any]]:
    decoder = json.JSONDecoder()
    pos, i = text.index("[") + 1, 0
    line, counted = 1, 0  # the line of `pos`, counted incrementally: linear in the file, not quadratic
    try:
        while True:
            pos = _skip_space(text, pos)
            if text.startswith("]", pos) and i == 0:
                pos += 1
                break
            value, end = decoder.raw_decode(text, pos)
            line, counted = line + text.count("\n", counted, pos), pos
            yield f"{path}:{line} (item {i})", value
            i, pos = i + 1, _skip_space(text, end)
            if text.startswith("]", pos):
                pos += 1
                break
            if not text.startswith(",", pos):
                raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)
            pos += 1
        if _skip_space(text, pos) != len(text):
            raise json.JSONDecodeError("Extra data", text, _skip_space(text, pos))
    except json.JSONDecodeError as e:
        raise DataError(f"{path}:{e.lineno}: row: invalid JSON ({e.msg} at column {e.colno}); the rest of the "
                        "array cannot be read") from None


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


# Formats pagedrl does not read, by suffix: what each is, and the `datasets` reader that converts it once.
OTHER_FORMATS = {".csv": ("a CSV file", "Dataset.from_csv"), ".tsv": ("a TSV file", "Dataset.from_csv")}
DATA_SUFFIXES = {".json", ".jsonl", ".gz", ".txt", ".parquet", ".arrow", *OTHER_FORMATS}
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # owner/name, as the Hub spells a dataset
BARE_NAME = re.compile(r"[A-Za-z0-9][\w-]*")  # a canonical Hub dataset (`imdb`, `gsm8k`): no owner, no suffix


def _data_file(dataset: str | Path) -> Path:
    """The path of a JSONL or JSON file, or a DataError saying what was given instead and how to
    turn it into one; nothing is downloaded or converted at run time."""
    path = Path(dataset)
    if path.is_dir():
        raise DataError(f"dataset: {path} is a folder without Parquet or Arrow files; expected a JSONL, JSON, Parquet "
                        "or Arrow file, a folder of Parquet or Arrow files, or a save_to_disk folder")
    if not path.is_file():
        save_once = ("nothing is downloaded at run time, so save it once with python -c \"import datasets; "
                     f"datasets.load_dataset('{dataset}', split='train').to_json('train.jsonl')\" and pass train.jsonl")
        if isinstance(dataset, str) and HUB_ID.fullmatch(dataset) and path.suffix.lower() not in DATA_SUFFIXES:
            raise DataError(f"dataset: {dataset!r} looks like a Hub dataset id; pagedrl reads local files: {save_once}")
        if isinstance(dataset, str) and BARE_NAME.fullmatch(dataset):  # `imdb`: a Hub name, or a file's typo
            raise DataError(f"dataset: file {path} does not exist; if {dataset!r} names a Hub dataset, {save_once}")
        raise DataError(f"dataset: file {path} does not exist")
    with path.open("rb") as f:
        head = f.read(8)
    if path.suffix.lower() in OTHER_FORMATS:
        name, reader = OTHER_FORMATS[path.suffix.lower()]
        raise DataError(f"dataset: {path} is {name}; pagedrl reads JSONL, JSON, Parquet or Arrow files: convert it "
                        f"once with python -c \"import datasets; datasets.{reader}('{path}')"
                        f".to_parquet('{path.with_suffix('.parquet').name}')\"")
    if head.startswith(b"\x1f\x8b"):
        raise DataError(f"dataset: {path} is gzip-compressed; pagedrl reads uncompressed JSONL or JSON files: "
                        f"decompress it once (gunzip -k {path})")
    return path


def _check_source(dataset: Any) -> None:
    """A dataset given in Python: any sized sequence of mappings (a list of dicts, a `datasets.Dataset`),
    read row by row; a mapping of splits or a table of columns is refused saying which row source to
    pass instead."""
    if isinstance(dataset, Mapping):
        if dataset and all(hasattr(v, "column_names") for v in dataset.values()):
            raise DataError(f"dataset: a {type(dataset).__name__} of splits ({', '.join(map(str, dataset))}); pass "
                            "one split, e.g. dataset['train']")
        raise DataError(f"dataset: expected a JSONL path or a list of dicts, got {type(dataset).__name__}")
    if hasattr(dataset, "to_dict") and hasattr(dataset, "columns"):  # a pandas DataFrame iterates column names
        raise DataError(f"dataset: a {type(dataset).__name__} iterates its column names, not its rows; pass "
                        "df.to_dict('records')")
    if isinstance(dataset, (str, bytes)) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__iter__")):
        raise DataError(f"dataset: expected a JSONL path or a list of dicts, got {type(dataset).__name__}")


def load_examples(dataset: str | Path | Sequence[Mapping[str, Any]],
                  convert: Callable[[Row, DataReport], T | None],
                  on_bad_row: BadRowPolicy = "error", split: Split = TRAIN) -> tuple[list[T], DataReport]:
    """Read and convert every row (of `split`, where the dataset is a folder of splits). A `BadRow`
    from reading or from `convert` becomes a DataError naming the row, or a counted skip; `convert`
    returning None means skipped by policy (it records its own reason in the report)."""
    if not isinstance(dataset, (str, Path)):
        _check_source(dataset)
    source = str(dataset) if isinstance(dataset, (str, Path)) else f"<{type(dataset).__name__} of {len(dataset)} rows>"
    report = DataReport(source)
    examples: list[T] = []
    for row in read_rows(dataset, report, on_bad_row, split):
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
                        needs: str, eval_convert: Callable[[Row, DataReport], T | None] | None = None,
                        ) -> tuple[list[T], DataReport, list[T] | None]:
    """The training rows (`dataset`, else `config.dataset`) and the evaluation rows (`eval_dataset`,
    else `config.eval_dataset`, else none), both under the config's bad-row policy, each the split of a
    folder of splits the config names for it; the evaluation rows through `eval_convert` where they are
    read otherwise (SFT's eval set packed or not as the train set)."""
    dataset = dataset if dataset is not None else config.dataset
    if dataset is None:
        raise ValueError(f"dataset: {needs} (a JSONL, JSON, Parquet or Arrow file or folder, or a list of rows "
                         "through the API)")
    train_split, test_split = config_splits(config)
    examples, report = load_examples(dataset, convert, config.on_bad_row, train_split)
    eval_source = eval_dataset if eval_dataset is not None else config.eval_dataset
    if eval_source is None:
        return examples, report, None
    eval_examples, eval_report = load_examples(eval_source, eval_convert or convert, config.on_bad_row,
                                               test_split)
    for reason, n in eval_report.skipped.items():  # skipped evaluation rows are reported with the others
        report.skipped[f"eval_dataset: {reason}"] += n
        report.first_skipped[f"eval_dataset: {reason}"] = eval_report.first_skipped[reason]
    return examples, report, eval_examples


def config_splits(config: Any) -> tuple[Split, Split]:
    """The splits a config reads from a folder of splits: TRL's `dataset_train_split` for `dataset`,
    `dataset_test_split` for `eval_dataset`, both of the configuration `dataset_config` (TRL's defaults
    for a config object without them)."""
    chosen = getattr(config, "dataset_config", None)
    return (Split("dataset_train_split", getattr(config, "dataset_train_split", "train"), chosen),
            Split("dataset_test_split", getattr(config, "dataset_test_split", "test"), chosen))


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
