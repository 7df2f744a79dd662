"""Where training rows come from: JSONL, a `.json` array of objects (as `datasets.load_dataset("json")`
reads it), a Python sequence of dicts such as a `datasets.Dataset`, and a clear refusal for Hub ids
(nothing is downloaded at run time). Parquet, Arrow and save_to_disk folders: tests/test_data_arrow.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedrl.train.data import DataError, DataReport, load_examples, read_rows
from pagedrl.train.examples import PromptCompletionRows

ROWS = [{"prompt": "what is two plus three", "completion": " five", "src": "a"},
        {"prompt": [{"role": "user", "content": "hello there"}], "completion": [{"role": "assistant", "content": "hi"}],
         "src": "b"}]


def rows_of(dataset, on_bad_row: str = "error") -> list[tuple[str, dict]]:
    return [(r.where, r.values) for r in read_rows(dataset, DataReport("test"), on_bad_row)]


def hf_json_rows(path: Path) -> list[dict]:
    """The rows `datasets.load_dataset("json")` reads from a file, as plain dicts."""
    import datasets

    return datasets.load_dataset("json", data_files=str(path), split="train").to_list()


def test_a_json_array_file_reads_as_the_datasets_json_loader_reads_it(tmp_path) -> None:
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(ROWS, indent=2))
    rows = rows_of(path)
    assert [v for _, v in rows] == ROWS == hf_json_rows(path)
    assert [w for w, _ in rows] == [f"{path}:2 (item 0)", f"{path}:7 (item 1)"]
    lines = tmp_path / "lines.json"  # JSON lines under a .json name: that loader reads those too
    lines.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    assert [v for _, v in rows_of(lines)] == ROWS == hf_json_rows(lines)


def test_a_json_array_names_the_item_and_line_of_a_bad_row(tmp_path, tiny_train_model) -> None:
    from pagedrl.model.tokenizer import Tokenizer

    path = tmp_path / "rows.json"
    path.write_text('[\n  {"prompt": "a", "completion": "b"},\n  {"prompt": "a"},\n  7\n]\n')
    convert = PromptCompletionRows(Tokenizer.from_folder(tiny_train_model), 64)
    with pytest.raises(DataError, match=rf"^{path}:3 \(item 1\): completion: missing"):
        load_examples(path, convert)
    examples, report = load_examples(path, convert, on_bad_row="skip")
    assert len(examples) == 1 and report.rows == 3
    assert report.first_skipped == {"missing 'completion'": f"{path}:3 (item 1)", "not a JSON object": f"{path}:4 (item 2)"}
    path.write_text('[{"prompt": "a", "completion": "b"},\n {"prompt": }]')
    with pytest.raises(DataError, match=rf"^{path}:2: row: invalid JSON \(Expecting value at column 13\); the rest"):
        rows_of(path, "skip")
    path.write_text('{\n  "prompt": ["a", "b"],\n  "completion": ["c", "d"]\n}\n')
    with pytest.raises(DataError, match=r"holds one JSON object over several lines; pagedrl reads a JSON array"):
        rows_of(path)


def test_a_datasets_dataset_is_read_row_by_row() -> None:
    import datasets

    chat = [ROWS[1], {**ROWS[1], "src": "c"}]  # a column holds one type: chat rows in this one
    ds = datasets.Dataset.from_list(chat)
    rows = rows_of(ds)
    assert [w for w, _ in rows] == ["dataset[0]", "dataset[1]"] and [v for _, v in rows] == chat
    assert load_examples(ds, lambda row, report: row.values)[1].source == "<Dataset of 2 rows>"
    assert [v for _, v in rows_of(tuple(ROWS))] == ROWS  # any sequence of mappings
    with pytest.raises(DataError, match=r"^dataset: a DatasetDict of splits \(train\); pass one split, e.g. "
                                        r"dataset\['train'\]$"):
        rows_of(datasets.DatasetDict({"train": ds}))
    with pytest.raises(DataError, match="iterates its column names, not its rows; pass df.to_dict"):
        rows_of(ds.to_pandas())
    with pytest.raises(DataError, match="expected a JSONL path or a list of dicts, got int"):
        rows_of(7)


def test_a_hub_dataset_id_is_refused_saying_nothing_is_downloaded(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"^dataset: 'trl-lib/ultrafeedback_binarized' looks like a Hub dataset id; "
                                        r"pagedrl reads local files: nothing is downloaded at run time"):
        rows_of("trl-lib/ultrafeedback_binarized")
    with pytest.raises(DataError, match=r"^dataset: file data/train.jsonl does not exist$"):
        rows_of("data/train.jsonl")


def test_a_bare_name_that_is_no_file_says_how_a_hub_dataset_of_that_name_is_saved(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"^dataset: file imdb does not exist; if 'imdb' names a Hub dataset, nothing is "
                                        r"downloaded at run time, so save it once with .*load_dataset\('imdb'"):
        rows_of("imdb")
    with pytest.raises(DataError, match=r"^dataset: file train.jsonl does not exist$"):
        rows_of("train.jsonl")
