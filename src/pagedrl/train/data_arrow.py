"""Training rows from Arrow's formats, read as `datasets` reads them, since that is where a TRL user's
data is: a Parquet file (every Hub dataset is stored as Parquet), an Arrow IPC file (`.arrow`, the
stream `datasets` writes), a folder of such files (a Hub dataset's snapshot, `data/train-*.parquet`),
and a `save_to_disk` folder (a Dataset, or a DatasetDict's split folders).

A folder may hold several splits; the one read is the config's `dataset_train_split` for `dataset`
and `dataset_test_split` for `eval_dataset` (TRL's names and defaults, "train" and "test"). A
folder's files are put in splits as `datasets.load_dataset(folder)` puts them: by the `configs` its
README.md declares (`dataset_config` picks one), else by their names (`_SHARDED`, `_KEYWORDS`).

Files are read a record batch at a time, each row the dict `datasets` gives back: a struct is a dict,
a list a list, a null None, and a column of `datasets`' `Json` feature (Arrow's `arrow.json` type) its
decoded JSON value. pyarrow is imported only when a file is read: `pagedrl serve` and a JSONL run
never load it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import pyarrow as pa

ARROW_SUFFIXES = (".parquet", ".arrow")
BATCH_ROWS = 1024  # rows converted to Python at a time: a large file is never held as dicts at once


class Split(NamedTuple):
    """Which split of a folder to read, the config key that names it (for the refusal), and which of the
    configurations a dataset card declares (TRL's `dataset_config`; None: the card's default)."""

    key: str
    name: str
    config: str | None = None


TRAIN = Split("dataset_train_split", "train")


class ArrowDataError(ValueError):
    """A file or folder that cannot be read; data.py raises it as its DataError."""


def arrow_files(path: Path, split: Split) -> list[Path] | None:
    """The Parquet / Arrow files `path` stands for, in order, or None when it is no such file or folder
    (a JSONL or JSON file, or a folder holding neither)."""
    if path.is_file():
        if file_kind(path) is None:
            return None
        _no_configs(path, split)
        return [path]
    if not path.is_dir():
        return None
    if (path / "dataset_dict.json").is_file():
        _no_configs(path, split)
        return _dataset_dict_files(path, split)
    if (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
        _no_configs(path, split)
        return _saved_dataset_files(path)
    configs = card_configs(path)
    if configs is None:
        _no_configs(path, split)
    splits = folder_splits(path) if configs is None else _config_splits(path, configs, split.config)
    if not splits:
        return None
    return _pick(path, splits, split, "holds the splits")


def _no_configs(path: Path, split: Split) -> None:
    """A dataset without a card's `configs` has one configuration, "default" (as `datasets` names it):
    `dataset_config` naming another is refused, as `load_dataset(path, name)` refuses it."""
    if split.config not in (None, "default"):
        raise ArrowDataError(f"dataset: {path} declares no configurations (a dataset card's `configs`), only "
                             f"'default'; dataset_config {split.config!r} names none of them: leave it unset")


def file_kind(path: Path) -> str | None:
    """".parquet" or ".arrow" for a file of either, known by its first bytes (or its suffix: a bad file
    of that name is then named by the reader), else None."""
    with path.open("rb") as f:
        head = f.read(8)
    if head.startswith(b"PAR1"):
        return ".parquet"
    if head.startswith((b"ARROW1", b"\xff\xff\xff\xff")):  # Arrow's file format; its stream format
        return ".arrow"
    return path.suffix.lower() if path.suffix.lower() in ARROW_SUFFIXES else None


def _dataset_dict_files(path: Path, split: Split) -> list[Path]:
    try:
        names = json.loads((path / "dataset_dict.json").read_text())["splits"]
    except (ValueError, KeyError, TypeError) as e:
        raise ArrowDataError(f"dataset: {path / 'dataset_dict.json'} is not a DatasetDict's split list ({e})") from None
    folder = _pick(path, {str(n): path / str(n) for n in names}, split, "is a DatasetDict with the splits")
    return _saved_dataset_files(folder)


def _saved_dataset_files(path: Path) -> list[Path]:
    """The Arrow files a `Dataset.save_to_disk` folder lists in its state.json, in order."""
    state = path / "state.json"
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as e:
        raise ArrowDataError(f"dataset: {state} does not list the folder's Arrow files as save_to_disk writes "
                             f"them ({type(e).__name__}: {e})") from None
    files = [path / name for name in names]
    for file in files:
        if not file.is_file():
            raise ArrowDataError(f"dataset: {file}, listed in {state}, does not exist")
    return files


def _pick(path: Path, splits: dict[str, Any], split: Split, holds: str) -> Any:
    if split.name in splits:
        return splits[split.name]
    raise ArrowDataError(f"dataset: {path} {holds} {', '.join(splits)}, not {split.name!r}: set {split.key} "
                         "to one of them")


# How `datasets` (5.x, data_files.py) puts a folder's files in splits when no README declares them:
# the Hub's own layout `data/<split>-00000-of-00001.*` with any split name; else a keyword in a
# folder's name, then in a file's name, between non-word characters; else everything is "train".
_SHARDED = re.compile(r"data/(?P<split>[^/]+?)-\d{5}-of-\d{5}[^/]*\.[^/]*")
_SEP = r"[-._ 0-9]"
_KEYWORDS = {"train": ("train", "training"), "validation": ("validation", "valid", "dev", "val"),
             "test": ("test", "testing", "eval", "evaluation")}


def _in_dir_name(keyword: str) -> re.Pattern[str]:
    return re.compile(rf"(?:.*/)?(?:[^/]*{_SEP})?{keyword}(?:{_SEP}[^/]*)?/.*")


def _in_file_name(keyword: str) -> re.Pattern[str]:
    return re.compile(rf"(?:.*/)?(?:[^/]*{_SEP})?{keyword}{_SEP}[^/]*")


def folder_splits(path: Path) -> dict[str, list[Path]]:
    """The folder's Parquet and Arrow files by split (hidden files and folders, and `__*` folders,
    left out as `datasets` leaves them), each split's files in name order."""
    files = sorted(f.relative_to(path).as_posix() for f in path.rglob("*")
                   if f.suffix.lower() in ARROW_SUFFIXES and f.is_file() and not _hidden(f.relative_to(path)))
    if not files:
        return {}
    sharded: dict[str, list[str]] = {}
    for name in files:
        if match := _SHARDED.fullmatch(name):
            sharded.setdefault(match["split"], []).append(name)
    if sharded:
        order = [s for s in _KEYWORDS if s in sharded] + sorted(set(sharded) - set(_KEYWORDS))
        return {s: [path / n for n in sharded[s]] for s in order}
    for patterns_of in (_in_dir_name, _in_file_name):
        found = {split: [n for n in files if any(patterns_of(k).fullmatch(n) for k in keywords)]
                 for split, keywords in _KEYWORDS.items()}
        if any(found.values()):
            return {s: [path / n for n in names] for s, names in found.items() if names}
    return {"train": [path / n for n in files]}


def card_configs(path: Path) -> dict[str, dict[str, Any]] | None:
    """The configurations a Hub dataset's README.md declares in its YAML header (`configs:`), by name;
    None when it declares none."""
    import yaml

    readme = path / "README.md"
    text = readme.read_text(encoding="utf-8", errors="replace") if readme.is_file() else ""
    end = text.find("\n---", 3) if text.startswith("---") else -1
    if end < 0:
        return None
    try:
        card = yaml.safe_load(text[3:end])
    except yaml.YAMLError as e:
        raise ArrowDataError(f"dataset: {readme}: its YAML header does not parse ({e})".replace("\n", " ")) from None
    configs = card.get("configs") if isinstance(card, dict) else None
    if not configs:
        return None
    if not (isinstance(configs, list) and all(isinstance(c, dict) and "config_name" in c for c in configs)):
        raise ArrowDataError(f"dataset: {readme}: `configs` is not a list of entries with a config_name")
    return {str(c["config_name"]): c for c in configs}


def _config_splits(path: Path, configs: dict[str, dict[str, Any]], name: str | None) -> dict[str, list[Path]]:
    """A card configuration's files by split, as `datasets` resolves them: its `data_files` (a pattern or
    list of them, all `train`; or `{split, path}` entries) under its `data_dir`, else its `data_dir`'s
    files split by name. The configuration is `name`, else the only one, the one named `default`, or the
    one marked `default: true`."""
    if name is None:
        defaults = [c for c, entry in configs.items() if len(configs) == 1 or c == "default" or entry.get("default")]
        if len(defaults) != 1:
            raise ArrowDataError(f"dataset: {path} holds the configurations {', '.join(configs)} (its README.md): set "
                                 "dataset_config to one of them")
        name = defaults[0]
    if name not in configs:
        raise ArrowDataError(f"dataset: {path} has no configuration {name!r} (its README.md declares "
                             f"{', '.join(configs)}): set dataset_config to one of them")
    entry = configs[name]
    base = path / str(entry.get("data_dir") or "")
    if entry.get("data_files") is None:
        return folder_splits(base)
    patterns = entry["data_files"]
    if isinstance(patterns, dict):  # {split: pattern(s)}
        patterns = [{"split": split, "path": globs} for split, globs in patterns.items()]
    elif not (isinstance(patterns, list) and any(isinstance(p, dict) for p in patterns)):  # pattern(s) of `train`
        patterns = [{"split": "train", "path": patterns}]
    splits: dict[str, list[Path]] = {}
    for item in patterns:
        globs = item["path"] if isinstance(item.get("path"), list) else [item.get("path")]
        files = splits.setdefault(str(item.get("split", "train")), [])
        for glob in globs:
            for file in sorted(base.glob(str(glob))):
                if file.is_file() and file not in files and not _hidden(file.relative_to(base)):
                    files.append(file)
    for file in (f for files in splits.values() for f in files):
        if file.suffix.lower() not in ARROW_SUFFIXES:
            raise ArrowDataError(f"dataset: {file}, a data file of configuration {name!r} of {path}, is not a Parquet "
                                 "or Arrow file")
    return {s: files for s, files in splits.items() if files}


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts) or any(
        part.startswith("__") for part in relative.parts[:-1])


# ---------------------------------------------------------------------------------------------
# Rows
# ---------------------------------------------------------------------------------------------


def arrow_rows(files: list[Path]) -> Iterator[tuple[str, Any]]:
    """(where, row) for every row of the files in order, `where` naming the file and the row's 0-based
    index in it (as `pyarrow` and `datasets` index it)."""
    import pyarrow as pa

    for file in files:
        kind = file_kind(file)
        index = 0
        try:
            for batch in _batches(file, kind):
                decode = _row_decoder(batch.schema)
                for row in batch.to_pylist():
                    yield f"{file} (row {index})", decode(row)
                    index += 1
        except (pa.ArrowException, OSError) as e:
            name = "a Parquet file" if kind == ".parquet" else "an Arrow file"
            raise ArrowDataError(f"dataset: {file} is not readable as {name} ({type(e).__name__}: {e})") from None


def _batches(file: Path, kind: str | None) -> Iterator[pa.RecordBatch]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    if kind == ".parquet":
        with pq.ParquetFile(file) as parquet:
            yield from parquet.iter_batches(batch_size=BATCH_ROWS)
        return
    with pa.memory_map(str(file)) as source:
        if source.read(6) == b"ARROW1":  # the IPC file format (`pyarrow.ipc.new_file`)
            source.seek(0)
            reader = pa.ipc.open_file(source)
            for i in range(reader.num_record_batches):
                yield reader.get_batch(i)
            return
        source.seek(0)
        yield from pa.ipc.open_stream(source)  # the IPC stream format, as `datasets` writes .arrow files


def _row_decoder(schema: pa.Schema) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A function that decodes a row's `arrow.json` values in place (the identity when it has none)."""
    decoders = {f.name: d for f in schema if (d := _decoder(f.type)) is not None}
    if not decoders:
        return lambda row: row

    def decode(row: dict[str, Any]) -> dict[str, Any]:
        for name, d in decoders.items():
            row[name] = d(row[name])
        return row

    return decode


def _decoder(kind: pa.DataType) -> Callable[[Any], Any] | None:
    """How to turn a value of this type, as `to_pylist` gives it, into its JSON value; None when
    `to_pylist`'s is already it (no `arrow.json` inside)."""
    import pyarrow as pa

    if getattr(kind, "extension_name", None) == "arrow.json":
        return lambda v: None if v is None else json.loads(v)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        item = _decoder(kind.value_type)
        return None if item is None else (lambda v: None if v is None else [item(x) for x in v])
    if pa.types.is_struct(kind):
        fields = {kind.field(i).name: d for i in range(kind.num_fields) if (d := _decoder(kind.field(i).type))}
        if not fields:
            return None

        def struct(v: Any) -> Any:
            if v is not None:
                for name, d in fields.items():
                    v[name] = d(v[name])
            return v

        return struct
    return None
