"""The optimizer and its learning-rate schedule, built once per run the way transformers builds them.

Kept apart from the loop because it is the one place a run's update rule is decided: which
parameters decay (matrices and embeddings, not biases or norm weights), how many optimizer steps
the run has (`max_steps`, or epochs of the algorithm's examples), and the multiplier of the peak
learning rate at each of them (`train/schedules.py`). The loop only steps what this returns; a
resumed run rebuilds the same objects and loads their state into them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedrl.train.algorithm import Algorithm
from pagedrl.train.config import TrainConfig
from pagedrl.train.schedules import SCHEDULES, lr_lambda

__all__ = ["SCHEDULES", "build_optimizer", "decay_groups", "lr_lambda", "check_same_optim", "optim_of_state", "total_steps"]


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: matrices and embeddings decay; biases and norm weights (1-D) do not."""
    decay, no_decay = [], []
    for _, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def total_steps(config: TrainConfig, algorithm: Algorithm) -> int:
    if config.max_steps > 0:
        return config.max_steps
    if not algorithm.num_examples or not algorithm.examples_per_step:
        raise ValueError("max_steps: this algorithm has no dataset size to derive steps from num_train_epochs; "
                         "set max_steps")
    if algorithm.steps_per_epoch:
        return max(1, math.ceil(config.num_train_epochs * algorithm.steps_per_epoch))
    return max(1, math.ceil(config.num_train_epochs * algorithm.num_examples / algorithm.examples_per_step))


def build_optimizer(module: nn.Module, config: TrainConfig, warmup_steps: int,
                    total: int) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The optimizer `config.optim` names over `module`'s trainable parameters, as transformers'
    Trainer builds it for that name (AdamW with the adam_* fields, fused for adamw_torch_fused;
    plain SGD, no momentum), and the schedule that steps its learning rate."""
    groups = decay_groups(module, config.weight_decay)
    if config.optim == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(groups, lr=config.learning_rate)
    else:
        optimizer = torch.optim.AdamW(
            groups, lr=config.learning_rate, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon,
            fused=True if config.optim == "adamw_torch_fused" else None)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(
        config.lr_scheduler_type, warmup_steps, total, config.warmup_starts_at_zero, config.lr_scheduler_kwargs,
        config.learning_rate))
    return optimizer, scheduler


def optim_of_state(state: dict[str, Any]) -> str:
    """The `optim` whose optimizer wrote `state` (an optimizer state dict)."""
    group = state["param_groups"][0] if state.get("param_groups") else {}
    if "betas" in group:
        return "adamw_torch_fused" if group.get("fused") else "adamw_torch"
    return "sgd" if "momentum" in group else "unknown"


def check_same_optim(optim: str, state: dict[str, Any], folder: Any) -> None:
    """A run resumes with the optimizer its checkpoint saved: torch would load one's moments and
    settings (the fused flag among them) into another without a word."""
    saved = optim_of_state(state)
    if saved != optim:
        raise ValueError(f"resume_from_checkpoint: {folder} holds the optimizer state of optim {saved}, this run's "
                         f"optim is {optim}; resume with optim: {saved}, or start from its model (model={folder})")
