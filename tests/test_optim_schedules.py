"""Every transformers 5 learning-rate schedule that needs no metric, with its lr_scheduler_kwargs: the
rate at each step is transformers' `get_scheduler` on the same optimizer, a resumed schedule goes on
with the same rates, and options transformers would trip on (or silently ignore) are refused at load
naming `lr_scheduler_kwargs.<key>`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import get_scheduler

from pagedrl.train.config import TrainConfig, load_config
from pagedrl.train.offline_config import SFTConfig
from pagedrl.train.optim import build_optimizer

LR, WARMUP, TOTAL = 3e-4, 5, 50
CASES = [
    ("linear", {}), ("cosine", {}), ("cosine", {"num_cycles": 1.5}), ("constant", {}), ("constant_with_warmup", {}),
    ("cosine_with_restarts", {}), ("cosine_with_restarts", {"num_cycles": 3}),
    ("polynomial", {}), ("polynomial", {"lr_end": 1e-5, "power": 2.0}),
    ("inverse_sqrt", {}), ("inverse_sqrt", {"timescale": 20}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}), ("cosine_with_min_lr", {"min_lr": 3e-5, "num_cycles": 0.75}),
    ("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_warmup_with_min_lr", {"min_lr": 1e-5, "warmup_lr_rate": 0.2}),
    ("warmup_stable_decay", {"num_decay_steps": 10}),
    ("warmup_stable_decay", {"num_decay_steps": 12, "min_lr_ratio": 0.1, "decay_type": "1-sqrt", "warmup_type": "cosine"}),
    ("warmup_stable_decay", {"num_decay_steps": 8, "num_stable_steps": 20, "decay_type": "linear",
                             "warmup_type": "1-sqrt"}),
]


def model() -> torch.nn.Module:
    return torch.nn.Linear(3, 2)


def rates(scheduler: torch.optim.lr_scheduler.LRScheduler, optimizer: torch.optim.Optimizer, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return out


def ours(kind: str, options: dict, warmup: int = WARMUP, **fields) -> tuple:
    config = TrainConfig(learning_rate=LR, lr_scheduler_type=kind, lr_scheduler_kwargs=options, **fields)
    return build_optimizer(model(), config, warmup, TOTAL)


@pytest.mark.parametrize(("kind", "options"), CASES, ids=lambda c: str(c))
def test_each_schedule_is_transformers_get_scheduler(kind: str, options: dict) -> None:
    optimizer, scheduler = ours(kind, options)
    theirs_opt = torch.optim.AdamW(model().parameters(), lr=LR)
    theirs = get_scheduler(kind, theirs_opt, num_warmup_steps=WARMUP, num_training_steps=TOTAL,
                           scheduler_specific_kwargs=dict(options))
    assert rates(scheduler, optimizer, TOTAL + 1) == rates(theirs, theirs_opt, TOTAL + 1)


@pytest.mark.parametrize(("kind", "options"), CASES, ids=lambda c: str(c))
def test_a_resumed_schedule_goes_on_with_the_same_rates(kind: str, options: dict) -> None:
    optimizer, scheduler = ours(kind, options)
    whole = rates(scheduler, optimizer, TOTAL)
    first, first_scheduler = ours(kind, options)
    rates(first_scheduler, first, 17)
    again, again_scheduler = ours(kind, options)  # a new run loads the checkpoint's states
    again.load_state_dict(first.state_dict())
    again_scheduler.load_state_dict(first_scheduler.state_dict())
    assert rates(again_scheduler, again, TOTAL - 17) == whole[17:]


@pytest.mark.parametrize("kind", ["linear", "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt",
                                  "cosine_with_min_lr", "constant_with_warmup"])
def test_warmup_not_from_zero_changes_only_the_warmup(kind: str) -> None:
    options = {"min_lr_rate": 0.1} if kind == "cosine_with_min_lr" else {}
    o1, s1 = ours(kind, options)
    o2, s2 = ours(kind, options, warmup_starts_at_zero=False, warmup_steps=WARMUP)
    zero, not_zero = rates(s1, o1, TOTAL), rates(s2, o2, TOTAL)
    assert not_zero[:WARMUP] == pytest.approx([LR * (s + 1) / (WARMUP + 1) for s in range(WARMUP)], rel=1e-12)
    assert not_zero[WARMUP:] == zero[WARMUP:]


@pytest.mark.parametrize(("kind", "options"), [("cosine_warmup_with_min_lr", {"min_lr_rate": 0.1}),
                                               ("warmup_stable_decay", {"num_decay_steps": 5})])
def test_a_warmup_of_its_own_is_not_changed_by_warmup_starts_at_zero(kind: str, options: dict) -> None:
    with pytest.raises(ValueError, match=rf"warmup_starts_at_zero: false cannot apply to {kind}"):
        TrainConfig(lr_scheduler_type=kind, lr_scheduler_kwargs=options, warmup_steps=3, warmup_starts_at_zero=False)
    TrainConfig(lr_scheduler_type=kind, lr_scheduler_kwargs=options, warmup_starts_at_zero=False)  # no warm-up: fine


def test_a_trl_recipe_reads_its_schedule_and_options(tmp_path: Path) -> None:
    path = tmp_path / "sft.yaml"
    path.write_text("lr_scheduler_type: cosine_with_min_lr\nlr_scheduler_kwargs:\n  min_lr_rate: 0.1\n"
                    "warmup_ratio: 0.03\n")
    cfg = load_config(SFTConfig, path)
    assert (cfg.lr_scheduler_type, cfg.lr_scheduler_kwargs) == ("cosine_with_min_lr", {"min_lr_rate": 0.1})
    over = ['lr_scheduler_kwargs={"num_cycles": 2}', "lr_scheduler_type=cosine_with_restarts"]
    assert load_config(SFTConfig, path, over).lr_scheduler_kwargs == {"num_cycles": 2}
    assert load_config(SFTConfig, None, ["lr_scheduler_kwargs=null"]).lr_scheduler_kwargs == {}
    text = load_config(SFTConfig, None, ["lr_scheduler_type=polynomial", "lr_scheduler_kwargs='{\"power\": 2}'"])
    assert text.lr_scheduler_kwargs == {"power": 2.0}


@pytest.mark.parametrize(("kind", "options", "message"), [
    ("cosine_with_min_lr", {"min_lr_rate": 0.1, "min_lr_ratio": 0.1},
     r"lr_scheduler_kwargs\.min_lr_ratio: not an option of cosine_with_min_lr; cosine_with_min_lr takes num_cycles, "
     r"min_lr, min_lr_rate \(from command line\)"),
    ("linear", {"num_cycles": 1}, r"lr_scheduler_kwargs\.num_cycles: not an option of linear; linear takes no "
                                  r"lr_scheduler_kwargs"),
    ("constant_with_warmup", {"min_lr": 0.0}, r"lr_scheduler_kwargs\.min_lr: .*takes no lr_scheduler_kwargs"),
    ("cosine_with_restarts", {"num_cycles": 1.5}, r"lr_scheduler_kwargs\.num_cycles: expected an integer, got 1\.5"),
    ("cosine", {"num_cycles": "many"}, r"lr_scheduler_kwargs\.num_cycles: expected a number, got 'many'"),
    ("polynomial", {"power": True}, r"lr_scheduler_kwargs\.power: expected a number, got True"),
    ("warmup_stable_decay", {"num_decay_steps": 3, "decay_type": "exp"},
     r"lr_scheduler_kwargs\.decay_type: expected one of linear, cosine, 1-sqrt, got 'exp'"),
    ("warmup_stable_decay", {}, r"lr_scheduler_kwargs: warmup_stable_decay needs num_decay_steps"),
    ("cosine_with_min_lr", {}, r"lr_scheduler_kwargs: cosine_with_min_lr needs exactly one of min_lr or min_lr_rate"),
    ("cosine_with_min_lr", {"min_lr_rate": 1.5}, r"lr_scheduler_kwargs\.min_lr_rate: .* must lie in \[0, 1\]"),
    ("polynomial", {"lr_end": 1.0}, r"lr_scheduler_kwargs\.lr_end: must be below learning_rate"),
    ("reduce_lr_on_plateau", {}, r"lr_scheduler_type: reduce_lr_on_plateau follows a metric"),
    ("cosine_annealing", {}, r"lr_scheduler_type: expected one of linear, cosine, .*warmup_stable_decay, got"),
])
def test_bad_options_are_refused_at_load_naming_the_key(kind: str, options: dict, message: str) -> None:
    import json

    with pytest.raises(ValueError, match=message):
        load_config(SFTConfig, None, [f"lr_scheduler_type={kind}", f"lr_scheduler_kwargs={json.dumps(options)}"])


def test_decay_steps_longer_than_the_run_are_refused_when_the_run_is_built() -> None:
    with pytest.raises(ValueError, match=r"lr_scheduler_kwargs\.num_decay_steps: 60 decay steps after 5 warm-up steps "
                                         r"do not fit the run's 50 steps"):
        ours("warmup_stable_decay", {"num_decay_steps": 60})
