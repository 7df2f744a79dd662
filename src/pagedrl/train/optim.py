"""The optimizer and its learning-rate schedule, built once per run the way transformers builds them.

Kept apart from the loop because it is the one place a run's update rule is decided: which
parameters decay (matrices and embeddings, not biases or norm weights), how many optimizer steps
the run has (`max_steps`, or epochs of the algorithm's examples), and the multiplier of the peak
learning rate at each of them (warm-up, then constant, linear or cosine). The loop only steps
what this returns; a resumed run rebuilds the same objects and loads their state into them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedrl.train.algorithm import Algorithm
from pagedrl.train.config import TrainConfig


def decay_groups(module: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW groups: matrices and embeddings decay; biases and norm weights (1-D) do not."""
    decay, no_decay = [], []
    for _, p in module.named_parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


SCHEDULES = ("linear", "cosine", "constant", "constant_with_warmup")


def lr_lambda(kind: str, warmup: int, total: int, from_zero: bool = True):
    """Multiplier of the peak learning rate at step s (0-based): linear warm-up over `warmup` steps,
    then constant, linear to 0 or cosine to 0 at `total`, as transformers' schedules of the same
    names (whose `constant` has no warm-up whatever `warmup` says: `constant_with_warmup` has one).
    `from_zero` False: the warm-up's steps train at 1/(warmup+1) .. warmup/(warmup+1) instead of 0 ..
    (warmup-1)/warmup (`TrainConfig.warmup_starts_at_zero`)."""
    if kind not in SCHEDULES:
        raise ValueError(f"lr_scheduler_type: expected one of {', '.join(SCHEDULES)}, got {kind!r}")
    if kind == "constant":
        warmup = 0

    def f(step: int) -> float:
        if step < warmup:
            return step / max(1, warmup) if from_zero else (step + 1) / (warmup + 1)
        if kind in ("constant", "constant_with_warmup"):
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))

    return f


def total_steps(config: TrainConfig, algorithm: Algorithm) -> int:
    if config.max_steps > 0:
        return config.max_steps
    if not algorithm.num_examples or not algorithm.examples_per_step:
        raise ValueError("max_steps: this algorithm has no dataset size to derive steps from num_train_epochs; "
                         "set max_steps")
    return max(1, math.ceil(config.num_train_epochs * algorithm.num_examples / algorithm.examples_per_step))


def build_optimizer(module: nn.Module, config: TrainConfig, warmup_steps: int,
                    total: int) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over `module`'s trainable parameters and the schedule that steps its learning rate."""
    optimizer = torch.optim.AdamW(
        decay_groups(module, config.weight_decay), lr=config.learning_rate,
        betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_epsilon)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config.lr_scheduler_type, warmup_steps, total,
                                                                    config.warmup_starts_at_zero))
    return optimizer, scheduler
