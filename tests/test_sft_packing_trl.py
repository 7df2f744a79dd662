"""SFT's `packing_strategy: bfd_split` and `wrapped` against TRL 1.16's own code: the packed rows as
TRL's `pack_dataset` makes them (tokens, sequence lengths and labels, row by row), the dataset TRL's
SFTTrainer prepares, and its first batch's loss and gradients. (`bfd`, TRL's default: `test_sft_trl.py`.)"""

from __future__ import annotations

import pytest
import torch
from first_batches import TOLERANCE, ours_first_batch, trl_first_batch
from test_sft_assistant_only import template_file  # noqa: F401 (a fixture)
from test_sft_trl import _examples, trl_prepared_rows
from tiny_train import arithmetic_rows, chat_rows, sft_trainer

from pagedrl.train.algorithms.sft_packing import PackedRow, pack
from pagedrl.train.config import load_config
from pagedrl.train.examples import PromptCompletion, label_mask
from pagedrl.train.offline_config import SFTConfig


def _labels(example: PromptCompletion, completion_only: bool = True) -> list[int]:
    """TRL's labels column of an example: its token where it carries a label, -100 elsewhere."""
    return [t if keep else -100 for t, keep in zip(example.input_ids, label_mask(example, completion_only),
                                                   strict=True)]


def _row(row: PackedRow | PromptCompletion) -> dict[str, list[int]]:
    """A packed row in TRL's columns: `seq_lengths` for bfd's rows, which TRL's wrapped rows do not have."""
    parts = row.examples if isinstance(row, PackedRow) else (row,)
    out = {"input_ids": [t for e in parts for t in e.input_ids], "labels": [t for e in parts for t in _labels(e)]}
    if isinstance(row, PackedRow):
        out["seq_lengths"] = [len(e.input_ids) for e in parts]
    return out


@pytest.mark.parametrize("strategy", ["bfd_split", "wrapped"])
def test_packing_strategies_equal_trl_pack_dataset(strategy) -> None:
    """TRL's `pack_dataset(..., strategy)` on the same tokenized rows and labels (the prompt's -100): the
    same rows, tokens, sequence lengths and labels; over 2345 examples (TRL's blocks of 1000 show), many
    longer than a row (split, or wrapped across rows), many of equal lengths (TRL's tie order)."""
    from datasets import Dataset
    from trl.data_utils import pack_dataset

    g = torch.Generator().manual_seed(1)
    lengths = [int(n) for n in torch.randint(1, 150, (2345,), generator=g)]
    examples = _examples(lengths, prompt=5)
    rows = pack(examples, 64, strategy)
    theirs = pack_dataset(Dataset.from_dict({"input_ids": [e.input_ids for e in examples],
                                             "labels": [_labels(e) for e in examples]}), 64, strategy)
    assert len(rows) == len(theirs) > sum(lengths) / 64 - 1
    assert any(n > 64 for n in lengths)
    for ours, want in zip(rows, theirs, strict=True):
        assert _row(ours) == want
        assert len(ours.input_ids if isinstance(ours, PromptCompletion) else _row(ours)["input_ids"]) <= 64


def test_bfd_split_pieces_keep_their_labels_and_every_token() -> None:
    """A 10-token example (3 prompt tokens) in rows of 4: pieces 0-4, 4-8, 8-10, the first piece's
    prompt tokens unlabelled, no token lost; TRL's docstring example packs [[1..5],[6,7],[8,9,10],[11]]."""
    (long,) = _examples([10], prompt=3)
    pieces = [e for row in pack([long], 4, "bfd_split") for e in row.examples]
    assert sorted(len(e.input_ids) for e in pieces) == [2, 4, 4]
    assert sorted(t for e in pieces for t in e.input_ids) == long.input_ids
    first = next(e for e in pieces if e.input_ids[0] == long.input_ids[0])
    assert label_mask(first, True) == [False, False, False, True]
    docs = [PromptCompletion([], ids, "") for ids in ([1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11])]
    assert [_row(r)["input_ids"] for r in pack(docs, 4, "bfd_split")] == [[1, 2, 3, 4], [8, 9, 10, 5], [6, 7, 11]]
    assert [r.input_ids for r in pack(docs, 4, "wrapped")] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]


@pytest.mark.parametrize(("strategy", "padding_free"), [("bfd_split", False), ("wrapped", False),
                                                        ("wrapped", True)])
def test_packing_strategy_equals_trl_sft_trainer(tiny_train_model, tmp_path, strategy, padding_free) -> None:
    """TRL's SFTTrainer with the same `packing_strategy`: the dataset's rows (tokens, sequence lengths,
    labels), and the first batch, bfd_split's rows padding-free and wrapped's padded (or back to back with
    `padding_free`), as TRL's trainer collates them: loss and every gradient."""
    rows = [r for r in arithmetic_rows(40) if isinstance(r["prompt"], str)]
    settings = dict(packing=True, packing_strategy=strategy, max_length=12, padding_free=padding_free)
    trl_rows = trl_prepared_rows(tiny_train_model, rows, tmp_path / "trl-rows", **settings)
    features, trl_loss, trl_grads, _ = trl_first_batch("sft", tiny_train_model, rows, tmp_path / "trl", size=2,
                                                       **settings)
    algorithm = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, per_device_train_batch_size=2,
                            **settings).algorithm
    assert len(algorithm.examples) == len(trl_rows)
    for row, want in zip(algorithm.examples, trl_rows, strict=True):
        assert _row(row) == want
    assert any(len(r["input_ids"]) == 12 for r in trl_rows)
    _, loss, grads, _ = ours_first_batch(algorithm, size=2)
    assert [_row(r)["input_ids"] for r in algorithm.examples[:2]] == [f["input_ids"] for f in features]
    assert abs(loss - trl_loss) < TOLERANCE
    for name, g in trl_grads.items():
        assert float((grads[name] - g).abs().max()) < TOLERANCE, name


def test_eval_set_is_read_whole_only_where_it_is_packed_so(tiny_train_model, tmp_path) -> None:
    """`wrapped` packs the train set from whole rows; `eval_packing: false` leaves the eval rows cut to
    `max_length` (TRL truncates the rows it does not pack)."""
    rows = [r for r in arithmetic_rows(8) if isinstance(r["prompt"], str)]
    trainer = sft_trainer(tiny_train_model, tmp_path, rows=rows, packing=True, packing_strategy="wrapped",
                          max_length=12, eval_packing=False)
    algorithm = trainer.algorithm
    read = sft_trainer(tiny_train_model, tmp_path / "plain", rows=rows, max_length=None).algorithm.examples
    assert sum(len(r.input_ids) for r in algorithm.examples) == sum(len(e.input_ids) for e in read)
    from pagedrl.train.algorithms.sft import SFT
    from pagedrl.train.distributed import DistInfo

    config = SFTConfig(model=str(tiny_train_model), output_dir=str(tmp_path / "e"), packing=True,
                       packing_strategy="wrapped", max_length=12, eval_packing=False)
    evaluated = SFT(config, algorithm.model, algorithm.tokenizer, DistInfo(), rows, rows).eval_examples
    assert all(isinstance(e, PromptCompletion) and len(e.input_ids) <= 12 for e in evaluated)
    assert len(evaluated) == len(rows)


def test_packing_strategy_values_are_trl_s() -> None:
    assert load_config(SFTConfig, None, ["packing_strategy=bfd-requeue"]).packing_strategy == "bfd_split"
    with pytest.raises(ValueError, match=r"packing_strategy: expected one of 'bfd', 'bfd_split', 'wrapped'"):
        load_config(SFTConfig, None, ["packing=true", "packing_strategy=ffd"])


@pytest.mark.parametrize("strategy", ["bfd_split", "wrapped"])
def test_packed_assistant_only_labels_equal_trl(tiny_train_model, template_file,  # noqa: F811
                                                tmp_path, strategy) -> None:
    """`assistant_only_loss` rows packed: each token keeps its label (the assistant's alone) across the
    pieces and wrapped rows, as TRL's packed labels column."""
    keys = dict(assistant_only_loss=True, chat_template_path=str(template_file), packing=True,
                packing_strategy=strategy, max_length=48)
    rows = chat_rows(24)
    theirs = trl_prepared_rows(tiny_train_model, rows, tmp_path / "trl", **keys)
    ours = sft_trainer(tiny_train_model, tmp_path / "ours", rows=rows, **keys).algorithm.examples
    assert [_row(r) for r in ours] == theirs
