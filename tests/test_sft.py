"""SFT end to end: it learns, it evaluates, it reports skipped rows, and the command line drives it."""

from __future__ import annotations

import json

import pytest
from tiny_train import arithmetic_rows, sft_trainer

from pagedrl.train.algorithms.sft import run_sft
from pagedrl.train.cli import train_main
from pagedrl.train.logging import read_metrics
from pagedrl.train.offline_config import SFTConfig


def test_sft_halves_the_loss_on_a_small_corpus(tiny_train_model, tmp_path) -> None:
    trainer = sft_trainer(tiny_train_model, tmp_path, max_steps=12, per_device_train_batch_size=8,
                          learning_rate=1e-2, warmup_steps=2, padding_free=True)
    trainer.train()
    rows = read_metrics(tmp_path / "metrics.jsonl")
    first, last = rows[0], rows[-1]
    assert last["loss"] <= first["loss"] / 2, (first["loss"], last["loss"])
    assert last["mean_token_accuracy"] > first["mean_token_accuracy"]
    tokens_per_step = sum(len(e.input_ids) for e in trainer.algorithm.examples) / 2  # 16 rows, 8 a step
    assert last["num_tokens"] == pytest.approx(12 * tokens_per_step)
    assert last["epoch"] == 6.0 and last["learning_rate"] > 0


def test_eval_dataset_is_evaluated_at_step_zero_and_every_eval_steps(tiny_train_model, tmp_path) -> None:
    rows = arithmetic_rows(16)
    config = SFTConfig(model=str(tiny_train_model), output_dir=str(tmp_path), max_steps=4, eval_steps=2,
                       per_device_train_batch_size=8, learning_rate=1e-2, logging_steps=1, save_steps=100)
    run_sft(config, dataset=rows, eval_dataset=rows[:6], progress=False)
    evals = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    assert "eval/mean_token_accuracy" in evals[0] and "eval/num_tokens" not in evals[0]
    assert all(r["train_time"] <= r["wall_time"] for r in evals)


def test_skipped_rows_are_reported_in_the_start_summary(tiny_train_model, tmp_path, capsys) -> None:
    path = tmp_path / "data.jsonl"
    good = [json.dumps(r) for r in arithmetic_rows(4)]
    path.write_text("\n".join(good[:2] + ['{"prompt": "x"}', "not json"] + good[2:]) + "\n")
    config = SFTConfig(model=str(tiny_train_model), dataset=str(path), output_dir=str(tmp_path / "out"),
                       max_steps=1, per_device_train_batch_size=2, save_steps=100, on_bad_row="skip")
    run_sft(config, progress=False)
    out = capsys.readouterr().out
    assert f"dataset {path}: 6 rows, 4 used" in out
    assert f"skipped 1: missing 'completion' (first at {path}:3)" in out
    assert f"skipped 1: invalid JSON (first at {path}:4)" in out
    assert "examples per step   2 = 2 per micro-batch x 1 accumulation steps x 1 process(es)" in out
    config.on_bad_row = "error"
    with pytest.raises(ValueError, match=rf"{path}:3: completion: missing"):
        run_sft(config, progress=False)


def test_command_line_runs_sft_from_yaml_and_overrides(tiny_train_model, tmp_path, capsys) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_rows(8)))
    yaml = tmp_path / "sft.yaml"
    yaml.write_text(f"model: {tiny_train_model}\ndataset: {data}\nper_device_train_batch_size: 4\n"
                    "logging_steps: 1\nlearning_rate: 1.0e-3\n")
    out = tmp_path / "run"
    assert train_main("sft", [str(yaml), "max_steps=2", f"output_dir={out}", "save_steps=1"]) == 0
    assert (out / "final" / "model.safetensors").is_file() and (out / "checkpoint-2").is_dir()
    assert [r["learning_rate"] for r in read_metrics(out / "metrics.jsonl")] == [1e-3, 5e-4]
    assert train_main("sft", [str(yaml), "learning_rat=1"]) == 2
    assert "unknown key 'learning_rat'" in capsys.readouterr().err
    assert train_main("sft", [str(yaml), "max_steps=1", f"output_dir={out}", "dataset=/nonexistent.jsonl"]) == 1
    assert "/nonexistent.jsonl does not exist" in capsys.readouterr().err
