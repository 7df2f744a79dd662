"""A run stopped after a checkpoint and resumed writes the same metrics, bit for bit, as one that
never stopped: optimizer, schedule, data position, RNG states and the logging window all resume."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tiny_train import sft_trainer

from pagedrl.train.algorithm import Algorithm
from pagedrl.train.config import TrainConfig
from pagedrl.train.logging import read_metrics
from pagedrl.train.metrics import Metric
from pagedrl.train.trainer import Trainer

TIME_KEYS = {"wall_time", "train_time", "step_time"}


class Interrupted(Exception):
    pass


def metric_rows(output_dir: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in TIME_KEYS} for row in read_metrics(output_dir / "metrics.jsonl")]


def interrupt_at(trainer: Trainer, step: int) -> None:
    """Crash right after the optimizer step of `step`, before it is logged or saved; the steps before it run
    the algorithm's own after_optimizer_step (DPO's TR-DPO mixes its reference there)."""
    own = trainer.algorithm.after_optimizer_step

    def boom(s: int) -> None:
        if s == step:
            raise Interrupted
        own(s)
    trainer.algorithm.after_optimizer_step = boom


SFT_FIELDS = dict(max_steps=6, save_steps=3, lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.1,
                  per_device_train_batch_size=2, gradient_accumulation_steps=2)


def test_sft_resume_equals_uninterrupted_run(tiny_train_model, tmp_path) -> None:
    straight = sft_trainer(tiny_train_model, tmp_path / "a", **SFT_FIELDS)
    straight.train()
    expected = metric_rows(tmp_path / "a")
    assert [r["step"] for r in expected] == [1, 2, 3, 4, 5, 6]

    first = sft_trainer(tiny_train_model, tmp_path / "b", **SFT_FIELDS)
    interrupt_at(first, 5)
    with pytest.raises(Interrupted):
        first.train()
    assert [r["step"] for r in metric_rows(tmp_path / "b")] == [1, 2, 3, 4]  # step 4 logged after checkpoint-3

    resumed = sft_trainer(tiny_train_model, tmp_path / "b", resume_from_checkpoint=True, **SFT_FIELDS)
    resumed.train()
    got = metric_rows(tmp_path / "b")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]  # the rows after checkpoint-3 rewritten, not doubled
    assert got[3:] == expected[3:]  # bit for bit: == on floats
    for (n, p), (_, q) in zip(straight.module.named_parameters(), resumed.module.named_parameters(), strict=True):
        assert torch.equal(p, q), n


class NoisyRegression(Algorithm):
    """A toy algorithm whose batches come from all three RNGs (Python, numpy, torch), and whose
    metrics use every reduction, so a resume that forgot any piece of state would show."""

    name = "toy"
    normaliser = "rows"
    num_examples = 64
    examples_per_step = 8

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(3, 1)
        self.consumed = 0

    def step_batches(self, step: int) -> list[torch.Tensor]:
        out = []
        for _ in range(2):
            x = torch.randn(4, 3) + random.random() + float(np.random.rand())
            out.append(x)
        self.consumed += 8
        return out

    def count(self, batch: torch.Tensor) -> float:
        return float(batch.shape[0])

    def loss(self, model, batch, global_count):
        target = batch.sum(-1, keepdim=True) * 0.5 + 1.0
        err = (model(batch) - target) ** 2
        return err.sum() / global_count, {
            "err_max": Metric.max(err.max()), "err_min": Metric.min(err.min()),
            "rows_seen": Metric.cumulative(batch.shape[0]), "rows": Metric.sum(batch.shape[0]),
            "weighted": Metric.mean(err.sum(), batch.shape[0]),
        }

    @property
    def epoch(self) -> float:
        return self.consumed / self.num_examples

    def state_dict(self):
        return {"consumed": self.consumed}

    def load_state_dict(self, state):
        self.consumed = state["consumed"]

    def save_model(self, folder: Path) -> None:
        folder.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, str(folder / "model.safetensors"))


def toy_trainer(output_dir: Path, **fields) -> Trainer:
    config = TrainConfig(output_dir=str(output_dir), max_steps=9, logging_steps=2, save_steps=3, learning_rate=0.05,
                         seed=1, **fields)
    return Trainer(config, NoisyRegression(), progress=False)


def test_resume_restores_rngs_and_a_half_full_logging_window(tmp_path) -> None:
    toy_trainer(tmp_path / "a").train()
    expected = metric_rows(tmp_path / "a")
    assert [r["step"] for r in expected] == [2, 4, 6, 8, 9]
    assert expected[-1]["rows_seen"] == 72 and expected[0]["rows"] == 16 and expected[-1]["rows"] == 8
    assert all(r["err_min"] <= r["weighted"] <= r["err_max"] for r in expected)

    first = toy_trainer(tmp_path / "b")
    interrupt_at(first, 5)  # checkpoint-3 holds step 3 alone in the window (logged with step 4)
    with pytest.raises(Interrupted):
        first.train()
    toy_trainer(tmp_path / "b", resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-3")).train()
    assert metric_rows(tmp_path / "b") == expected


@pytest.mark.parametrize("fields", [
    dict(optim="adamw_torch_fused", lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
         warmup_steps=2),
    dict(optim="sgd", lr_scheduler_type="warmup_stable_decay", lr_scheduler_kwargs={"num_decay_steps": 4},
         warmup_steps=2),
    dict(lr_scheduler_type="polynomial", lr_scheduler_kwargs={"power": 2.0, "lr_end": 1e-3}, warmup_steps=2,
         warmup_starts_at_zero=False),
], ids=["fused-min-lr", "sgd-wsd", "polynomial"])
def test_resume_keeps_the_optimizer_and_the_schedule_of_its_options(tmp_path, fields) -> None:
    toy_trainer(tmp_path / "a", **fields).train()
    expected = metric_rows(tmp_path / "a")
    first = toy_trainer(tmp_path / "b", **fields)
    interrupt_at(first, 5)
    with pytest.raises(Interrupted):
        first.train()
    checkpoint = tmp_path / "b" / "checkpoint-3"
    other = "adamw_torch" if fields.get("optim") else "sgd"
    with pytest.raises(ValueError, match=rf"holds the optimizer state of optim {fields.get('optim', 'adamw_torch')}, "
                                         rf"this run's optim is {other}"):
        toy_trainer(tmp_path / "b", resume_from_checkpoint=str(checkpoint), **{**fields, "optim": other}).train()
    resumed = toy_trainer(tmp_path / "b", resume_from_checkpoint=str(checkpoint), **fields)
    resumed.train()
    assert metric_rows(tmp_path / "b") == expected
    assert resumed.optimizer.param_groups[0].get("fused") == (fields.get("optim") == "adamw_torch_fused" or None)
