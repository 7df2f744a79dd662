"""Parquet files, Arrow files, folders of Parquet shards and save_to_disk folders, read as `datasets`
reads them back (the reference: `load_dataset("parquet")`, `load_dataset(folder)`, `load_from_disk`),
for each trainer's row shapes; a folder's split is the config's `dataset_train_split` /
`dataset_test_split`; a bad row names its file and row; and a DPO run on a Parquet snapshot trains as
on the same rows in JSONL."""

from __future__ import annotations

import json

import datasets
import pytest
from preference_data import preference_rows

from pagedrl.train import data_arrow
from pagedrl.train.cli import train_main
from pagedrl.train.data import DataError, DataReport, load_examples, load_train_and_eval, read_rows
from pagedrl.train.data_arrow import Split
from pagedrl.train.examples import PromptCompletionRows
from pagedrl.train.offline_config import DPOConfig

USER, BOT = {"role": "user", "content": "what is two plus three"}, {"role": "assistant", "content": "five"}
CALL = {"role": "assistant", "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]}
# Each trainer's rows, as a TRL user's datasets hold them (a column holds one type).
SHAPES = {
    "prompt_completion": [{"prompt": "two plus three is", "completion": " five"},
                          {"prompt": "hi", "completion": " yo"}],
    "chat_prompt_completion": [{"prompt": [USER], "completion": [BOT]},
                               {"prompt": [USER, BOT, USER], "completion": [BOT]}],
    # a message without `tool_calls` beside one with them: Arrow gives it the key, null
    "messages": [{"messages": [USER, CALL, {"role": "tool", "content": "5"}, BOT]}, {"messages": [USER, BOT]}],
    "preference": [{"prompt": [USER], "chosen": [BOT], "rejected": [{**BOT, "content": "six"}], "margin": 0.5},
                   {"prompt": [USER], "chosen": [BOT], "rejected": [BOT], "margin": None}],
    "implicit_prompt": [{"chosen": "a b c", "rejected": "a b d"}, {"chosen": "x", "rejected": "y"}],
    "prompt_only": [{"prompt": [USER], "answer": 5, "tags": ["x", None]},
                    {"prompt": [USER], "answer": None, "tags": None}],
}


def rows_of(dataset, split: Split = data_arrow.TRAIN, on_bad_row: str = "error") -> list[dict]:
    return [r.values for r in read_rows(dataset, DataReport("test"), on_bad_row, split)]


def split(name: str, key: str = "dataset_train_split") -> Split:
    return Split(key, name)


@pytest.mark.parametrize("shape", SHAPES)
def test_each_trainers_rows_read_as_datasets_reads_them_back(shape, tmp_path) -> None:
    ds = datasets.Dataset.from_list(SHAPES[shape])
    parquet = tmp_path / "train.parquet"
    ds.to_parquet(str(parquet))
    want = datasets.load_dataset("parquet", data_files=str(parquet), split="train",
                                 cache_dir=str(tmp_path / "c")).to_list()
    assert rows_of(parquet) == want
    ds.save_to_disk(str(tmp_path / "saved"))
    saved = datasets.load_from_disk(str(tmp_path / "saved"))
    assert rows_of(tmp_path / "saved") == saved.to_list() == want
    (arrow,) = (tmp_path / "saved").glob("*.arrow")  # the Arrow stream datasets writes, on its own
    assert rows_of(arrow) == datasets.Dataset.from_file(str(arrow)).to_list() == want
    jsonl = tmp_path / "rows.jsonl"  # the same rows in JSON, nulls spelled out, read the same
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in want))
    assert rows_of(jsonl) == want


def test_datasets_json_feature_is_decoded_as_datasets_decodes_it(tmp_path) -> None:
    """A column of mixed shapes is stored as datasets' `Json` feature: JSON text in an `arrow.json` column."""
    rows = [{"messages": [USER, CALL], "extra": {"a": 1}},
            {"messages": [USER, {**BOT, "name": "x"}], "extra": [1, "b"]}]
    ds = datasets.Dataset.from_list(rows, on_mixed_types="use_json")
    assert "Json" in repr(ds.features)
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    assert rows_of(tmp_path / "rows.parquet") == rows == rows_of(tmp_path / "saved") == datasets.load_from_disk(
        str(tmp_path / "saved")).to_list()


def test_large_files_are_read_a_batch_at_a_time_and_name_each_row(tmp_path, monkeypatch) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    monkeypatch.setattr(data_arrow, "BATCH_ROWS", 3)
    rows = [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(10)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet", row_group_size=4)
    with pa.OSFile(str(tmp_path / "b.arrow"), "wb") as sink, pa.ipc.new_file(sink, pa.schema(
            [("prompt", pa.string()), ("completion", pa.string())])) as writer:  # Arrow's file format too
        writer.write_table(pa.Table.from_pylist(rows[:5]), max_chunksize=2)
    got = list(read_rows(tmp_path / "a.parquet", DataReport("t")))
    assert [r.values for r in got] == rows and got[7].where == f"{tmp_path / 'a.parquet'} (row 7)"
    assert rows_of(tmp_path / "b.arrow") == rows[:5]
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=rf"^dataset: {tmp_path / 'bad.parquet'} is not readable as a Parquet file "):
        rows_of(tmp_path / "bad.parquet")


def test_a_bad_row_names_its_file_and_row(tmp_path, tok) -> None:
    path = tmp_path / "rows.parquet"
    datasets.Dataset.from_list([{"prompt": "a", "completion": "b"},
                                {"prompt": "a", "completion": ""}]).to_parquet(str(path))
    with pytest.raises(DataError, match=rf"^{path} \(row 1\): completion: empty string$"):
        load_examples(path, PromptCompletionRows(tok, 64))
    examples, report = load_examples(path, PromptCompletionRows(tok, 64), on_bad_row="skip")
    assert len(examples) == 1 and report.first_skipped == {"empty 'completion'": f"{path} (row 1)"}


LAYOUTS = {  # folder layouts `datasets` puts in splits, and the splits it makes of them
    "hub snapshot": ["data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
                     "data/test-00000-of-00001.parquet", "data/sft_extra-00000-of-00001.parquet"],
    "split in file names": ["train.parquet", "valid_0.parquet", "eval-1.parquet"],
    "split in folder names": ["prefs/train/shard_0.parquet", "prefs/train/shard_1.parquet", "prefs/dev/0.parquet"],
    "no split named": ["part-1.parquet", "part-0.parquet", "sub/part-2.parquet"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_folder_of_shards_is_split_as_datasets_splits_it(layout, tmp_path) -> None:
    root = tmp_path / "snapshot"
    for i, name in enumerate(LAYOUTS[layout]):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list([{"prompt": [{**USER, "content": f"{name} {j}"}], "chosen": [BOT], "rejected": [BOT]}
                                    for j in range(i + 1)]).to_parquet(str(root / name))
    (root / "README.md").write_text("# a dataset card\n")
    (root / ".cache" / "data").mkdir(parents=True)  # what `hf download --local-dir` leaves beside: hidden
    (root / ".cache" / "data" / "train-00000-of-00002.parquet").write_bytes(b"")
    want = datasets.load_dataset(str(root), cache_dir=str(tmp_path / "c"))
    assert list(data_arrow.folder_splits(root)) == list(want)
    for name, ds in want.items():
        assert rows_of(root, split(name)) == ds.to_list()
    with pytest.raises(DataError, match=rf"^dataset: {root} holds the splits {', '.join(want)}, not 'nope': set "
                                        r"dataset_test_split to one of them$"):
        rows_of(root, split("nope", "dataset_test_split"))


CARDS = {  # README.md headers as the Hub writes them: several configurations (gsm8k's), a default among them
    "named": "configs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
             "  - split: test\n    path: main/test-*\n- config_name: socratic\n  data_files:\n"
             "  - split: train\n    path: socratic/train-*\n",
    "default": "configs:\n- config_name: all\n  data_dir: main\n  default: true\n- config_name: other\n"
               "  data_files: socratic/*.parquet\n",
}


@pytest.mark.parametrize("card", CARDS)
def test_the_configurations_of_a_dataset_card_are_read_as_datasets_reads_them(card, tmp_path) -> None:
    root = tmp_path / "gsm8k"
    for name in ("main/train-00000-of-00001.parquet", "main/test-00000-of-00001.parquet",
                 "socratic/train-00000-of-00001.parquet"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        datasets.Dataset.from_list([{"prompt": f"{name} {i}", "answer": i} for i in range(3)]).to_parquet(str(root / name))
    (root / "README.md").write_text(f"---\n{CARDS[card]}---\n# a dataset card\n")
    names = list(data_arrow.card_configs(root))
    for config in names:
        want = datasets.load_dataset(str(root), config, cache_dir=str(tmp_path / "c"))
        for name, ds in want.items():
            assert rows_of(root, Split("dataset_train_split", name, config)) == ds.to_list()
    with pytest.raises(DataError, match=rf"^dataset: {root} has no configuration 'nope' \(its README.md declares "
                                        rf"{', '.join(names)}\): set dataset_config to one of them$"):
        rows_of(root, Split("dataset_train_split", "train", "nope"))
    if card == "default":
        assert rows_of(root) == datasets.load_dataset(str(root), split="train", cache_dir=str(tmp_path / "c")).to_list()
        return
    with pytest.raises(ValueError, match="Config name is missing"):  # datasets refuses too
        datasets.load_dataset(str(root), cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataError, match=rf"^dataset: {root} holds the configurations main, socratic \(its README.md\): "
                                        r"set dataset_config to one of them$"):
        rows_of(root)


def test_the_dataset_keys_are_trls_script_arguments_at_trls_defaults() -> None:
    import trl

    from pagedrl.train.config import load_config

    script, config = trl.ScriptArguments(), DPOConfig()
    for key in ("dataset_config", "dataset_train_split", "dataset_test_split"):
        assert getattr(config, key) == getattr(script, key)
    assert load_config(DPOConfig, None, ["dataset_streaming=false", "dataset_config=main"]).dataset_config == "main"
    with pytest.raises(ValueError, match="dataset_streaming: .*nothing is streamed from the Hub"):
        load_config(DPOConfig, None, ["dataset_streaming=true"])


def test_a_save_to_disk_dataset_dict_gives_the_configs_split(tmp_path, tiny_train_model) -> None:
    rows = preference_rows(6)
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                               "validation": datasets.Dataset.from_list(rows[4:])})
    dd.save_to_disk(str(tmp_path / "prefs"))
    loaded = datasets.load_from_disk(str(tmp_path / "prefs"))
    config = DPOConfig(model=str(tiny_train_model), dataset=str(tmp_path / "prefs"),
                       eval_dataset=str(tmp_path / "prefs"), dataset_test_split="validation")
    train, _, evaluation = load_train_and_eval(config, None, None, lambda row, report: row.values, "rows")
    assert train == loaded["train"].to_list() and evaluation == loaded["validation"].to_list()
    config.dataset_test_split = "test"  # TRL's default, which this dataset lacks
    with pytest.raises(DataError, match=r"prefs is a DatasetDict with the splits train, validation, not 'test': set "
                                        r"dataset_test_split to one of them$"):
        load_train_and_eval(config, None, None, lambda row, report: row.values, "rows")
    (tmp_path / "prefs" / "train" / "state.json").write_text('{"_data_files": [{"filename": "gone.arrow"}]}')
    with pytest.raises(DataError, match=r"train/gone.arrow, listed in .*train/state.json, does not exist$"):
        rows_of(tmp_path / "prefs")


def test_grpo_prompts_and_their_columns_come_from_the_configs_splits(tmp_path, tok) -> None:
    from pagedrl.train.distributed import DistInfo
    from pagedrl.train.rl.config import GRPOConfig
    from pagedrl.train.rl.prompts import PromptSource

    rows = [{"prompt": [{**USER, "content": f"what is {i} plus {i}"}], "answer": 2 * i, "note": None} for i in range(5)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:3]),
                          "dev": datasets.Dataset.from_list(rows[3:])}).save_to_disk(str(tmp_path / "math"))
    config = GRPOConfig(dataset=str(tmp_path / "math"), eval_dataset=str(tmp_path / "math"), dataset_test_split="dev")
    source = PromptSource(config, tok, DistInfo())
    for got, want in ((source.rows, rows[:3]), (source.eval_rows(), rows[3:])):
        assert [(p.prompt, p.columns) for p in got] == [(r["prompt"], {"answer": r["answer"], "note": None}) for r in want]
    assert source.rows[2].where == f"{tmp_path / 'math' / 'train' / 'data-00000-of-00001.arrow'} (row 2)"


def test_csv_stays_refused_and_a_folder_without_data_is_named(tmp_path) -> None:
    (tmp_path / "rows.csv").write_text("prompt,completion\na,b\n")
    with pytest.raises(DataError, match=r"rows.csv is a CSV file; pagedrl reads JSONL, JSON, Parquet or Arrow files: "
                                        r"convert it once with .*from_csv.*to_parquet\('rows.parquet'\)"):
        rows_of(tmp_path / "rows.csv")
    with pytest.raises(DataError, match=rf"^dataset: {tmp_path} is a folder without Parquet or Arrow files; expected"):
        rows_of(tmp_path)


def test_dpo_on_a_parquet_snapshot_trains_as_on_its_rows_in_jsonl(tiny_train_model, tmp_path, capsys) -> None:
    from test_trainer_resume import metric_rows

    rows, eval_rows = preference_rows(4, seed=5, chat_every=1), preference_rows(2, seed=6, chat_every=1)
    snapshot = tmp_path / "snapshot" / "data"
    snapshot.mkdir(parents=True)
    datasets.Dataset.from_list(rows).to_parquet(str(snapshot / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(eval_rows).to_parquet(str(snapshot / "test-00000-of-00001.parquet"))
    for name, part in (("train.jsonl", rows), ("test.jsonl", eval_rows)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    common = [f"model={tiny_train_model}", "max_steps=1", "per_device_train_batch_size=4", "eval_steps=1",
              "eval_on_start=false", "logging_steps=1", "save_steps=null"]
    assert train_main("dpo", common + [f"dataset={snapshot.parent}", f"eval_dataset={snapshot.parent}",
                                       f"output_dir={tmp_path / 'a'}"]) == 0
    assert f"dataset {snapshot.parent}: 4 rows, 4 used" in capsys.readouterr().out
    assert train_main("dpo", common + [f"dataset={tmp_path / 'train.jsonl'}", f"eval_dataset={tmp_path / 'test.jsonl'}",
                                       f"output_dir={tmp_path / 'b'}"]) == 0
    logged = metric_rows(tmp_path / "a")
    assert any("eval/loss" in r for r in logged) and logged == metric_rows(tmp_path / "b")


def test_a_config_named_where_none_is_declared_is_refused_as_datasets_refuses_it(tmp_path) -> None:
    rows = [{"prompt": f"p{i}", "completion": f"c{i}"} for i in range(2)]
    file = tmp_path / "one.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(file))
    saved = tmp_path / "saved"
    datasets.Dataset.from_list(rows).save_to_disk(str(saved))
    shards = tmp_path / "shards" / "data"
    shards.mkdir(parents=True)
    datasets.Dataset.from_list(rows).to_parquet(str(shards / "train-00000-of-00001.parquet"))
    with pytest.raises(ValueError, match="BuilderConfig 'main' not found"):  # datasets refuses too
        datasets.load_dataset(str(shards.parent), "main", cache_dir=str(tmp_path / "c"))
    for path in (file, saved, shards.parent):
        with pytest.raises(DataError, match=rf"^dataset: {path} declares no configurations .*dataset_config 'main'"):
            rows_of(path, Split("dataset_train_split", "train", "main"))
        assert rows_of(path, Split("dataset_train_split", "train", "default")) == rows
