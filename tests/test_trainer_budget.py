"""`max_train_minutes`: a run whose training time is spent stops after that step, cleanly: its
last step logged and a complete `final/`, with evaluation time not counted against the budget."""

from __future__ import annotations

import json

import pytest
from tiny_train import sft_trainer

from pagedrl.train import checkpointing as ckpt
from pagedrl.train.config import TrainConfigError
from pagedrl.train.offline_config import SFTConfig


def test_a_spent_budget_ends_the_run_after_the_step_with_a_final_save(tiny_train_model, tmp_path) -> None:
    trainer = sft_trainer(tiny_train_model, tmp_path, max_steps=50, max_train_minutes=1e-6, report_to=["jsonl"])
    final = trainer.train()
    assert trainer.step == 1 and ckpt.is_complete(final)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1]


def test_evaluation_time_is_not_spent_from_the_budget(tiny_train_model, tmp_path) -> None:
    trainer = sft_trainer(tiny_train_model, tmp_path, max_steps=3, max_train_minutes=10.0, report_to=["jsonl"])
    trainer.logger = type("Quiet", (), {"write": lambda self, text: None})()
    trainer.step = 1
    trainer._start -= 601.0  # ten minutes and a second since the start
    trainer.eval_seconds = 60.0  # a minute of it evaluating: nine minutes of training
    assert not trainer.out_of_time()
    trainer.eval_seconds = 0.0
    assert trainer.out_of_time()


def test_a_budget_must_be_positive() -> None:
    with pytest.raises(TrainConfigError, match="max_train_minutes"):
        SFTConfig(max_train_minutes=0.0)
