"""What an algorithm tells the trainer loop: its batches, its normaliser, its loss. Nothing else.

The loop (`pagedrl.train.trainer`) owns the optimizer, schedule, accumulation, DDP, logging and
checkpoints. An algorithm owns the model being trained and answers, per optimizer step:

- `step_batches(step)`: this rank's micro-batches. Offline algorithms (SFT, reward model, DPO)
  take the next examples of their dataset (`OfflineAlgorithm` does it); online ones (GRPO, PPO)
  generate a rollout, and may hand the same rollout out for μ consecutive steps.
- `count(batch)`: the batch's share of the loss normaliser (tokens, sequences, pairs). The loop
  sums it over micro-batches and ranks *before* any forward pass and hands the global count to
  `loss`, so a loss divided by it does not depend on how the step was split.
- `loss(model, batch, global_count)`: this micro-batch's contribution to the step's loss (the
  contributions of all micro-batches on all ranks add up to the step loss) and its metrics.
- `step_metrics(step)`: metrics of the step as a whole (a rollout's rewards), if any.
- `after_optimizer_step(step)`: after each update (GRPO bumps the engine's weight version here).
- `evaluate(step)`, `state_dict()`/`load_state_dict()` (data position), `save_model(folder, state)`,
  `load_model(folder)`, `summary_lines()`.

The loop sets `full_weights`: a context manager under which every trained parameter is whole on
this rank (a no-op unless the module is sharded with FSDP2). Anything that runs the model outside
the loop's own forward and backward, a rollout above all, runs inside it.

Metrics carry how they combine across micro-batches, ranks and logged steps (`train/metrics.py`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedrl.model.adapter import load_adapter_weights, write_adapter
from pagedrl.model.checkpoint import load_weights, read_state_dict, save_checkpoint
from pagedrl.model.lora import adapter_config
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.data import DataReport
from pagedrl.train.distributed import DistInfo, all_reduce_op
from pagedrl.train.metrics import Metric, MetricTotals, as_metric


class EpochStream:
    """The order examples are seen in: epoch e is a permutation of all N indices drawn from
    `seed + e`, and epochs follow each other without a gap. A step takes the next
    `examples_per_step` indices, straddling an epoch boundary when N is not a multiple of it, so
    every row is seen once per epoch and no batch is ever short. The whole position is one
    integer, `consumed`, which is what a checkpoint stores."""

    def __init__(self, num_examples: int, seed: int, shuffle: bool = True) -> None:
        if num_examples < 1:
            raise ValueError(f"num_examples: must be >= 1, got {num_examples}")
        self.num_examples, self.seed, self.shuffle = num_examples, seed, shuffle
        self.consumed = 0
        self._order: tuple[int, list[int]] | None = None

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_examples, generator=g).tolist()
            else:
                order = list(range(self.num_examples))
            self._order = (epoch, order)
        return self._order[1]

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            epoch, offset = divmod(self.consumed, self.num_examples)
            out.append(self._epoch_order(epoch)[offset])
            self.consumed += 1
        return out

    @property
    def epoch(self) -> float:
        return self.consumed / self.num_examples

    def state_dict(self) -> dict[str, int]:
        return {"consumed": self.consumed, "num_examples": self.num_examples, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state["num_examples"] != self.num_examples:
            raise ValueError(f"resume_from_checkpoint: the checkpoint saw {state['num_examples']} examples, "
                             f"the dataset now has {self.num_examples}; resuming would not continue the same run")
        self.consumed = int(state["consumed"])


class Algorithm:
    """Base with the optional hooks' defaults. Subclasses set `model` (the module the optimizer
    trains; the loop wraps it in DDP) and implement `step_batches`, `count` and `loss`."""

    name: str = "train"
    normaliser: str = "examples"  # what `count` counts, for the start summary
    model: nn.Module
    tokenizer: Tokenizer | None = None
    generation_config: dict[str, Any] | None = None  # written beside the weights (sampling defaults)
    num_examples: int | None = None  # rows of an offline dataset; None for online algorithms
    examples_per_step: int = 0  # global rows (or prompts) one optimizer step consumes
    steps_per_epoch: int | None = None  # where epochs end on a step of their own (KTO's blocks); else rows / step
    find_unused_parameters: bool = False  # for DDP: True if some trained parameters may get no gradient
    # Set by the loop: the trained weights whole on this rank inside it (see the module docstring).
    full_weights: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext

    def step_batches(self, step: int) -> Sequence[Any]:
        raise NotImplementedError

    def count(self, batch: Any) -> float:
        raise NotImplementedError

    def loss(self, model: Any, batch: Any, global_count: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any]]:
        """`model(...)` runs the trained module's forward (through DDP: call it once per
        micro-batch, e.g. chosen and rejected in one call); `model.logits` etc. are the module's.
        Returns this micro-batch's share of the step loss and its metrics (`Metric` or number)."""
        raise NotImplementedError

    def step_metrics(self, step: int) -> dict[str, Any]:
        """Metrics of the step as a whole rather than of a micro-batch (rewards of a rollout,
        generation time), asked for after the last backward; combined across ranks like the rest."""
        return {}

    def after_optimizer_step(self, step: int) -> None:
        """Called after every optimizer step, once the weights have changed."""

    def sample_completions(self, step: int) -> list[dict[str, Any]]:
        """A few of the step's completions with their rewards, logged with the step's metrics
        (online algorithms; TRL's `log_completions`)."""
        return []

    def evaluate(self, step: int) -> dict[str, Any] | None:
        """Held-out metrics (logged as `eval/<name>`), or None when there is nothing to evaluate.
        An `outcomes` entry, a list of per-problem scores in the held-out set's order, goes to
        `eval_outcomes.jsonl` instead."""
        return None

    @property
    def evaluates(self) -> bool:
        """Whether `evaluate` has anything to evaluate (`eval_steps` asks for evaluations; without
        anything to evaluate, that is refused rather than silently ignored)."""
        return type(self).evaluate is not Algorithm.evaluate

    @property
    def epoch(self) -> float:
        return 0.0

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def save_model(self, folder: Path, state: dict[str, torch.Tensor] | None = None) -> None:
        """Write `folder` as a Hugging Face folder: weights, config, generation config, tokenizer;
        with LoRA, the adapter in PEFT's format and the tokenizer. `state`: whole tensors of
        `self.model` when its own are shards (FSDP2), else None."""
        if adapter_config(self.model) is not None:
            write_adapter(self.model, folder, self.tokenizer)
            return
        save_checkpoint(self.model, folder, generation_config=self.generation_config, state=state)
        if self.tokenizer is not None:
            self.tokenizer.save(folder)

    def load_model(self, folder: Path) -> None:
        """Load the weights `save_model` wrote back into `self.model` (for resuming)."""
        if adapter_config(self.model) is not None:
            load_adapter_weights(self.model, folder)
            return
        state = read_state_dict(folder, dtype=torch.float32)
        with torch.no_grad():
            load_weights(self.model, state, str(folder))

    def summary_lines(self) -> list[str]:
        return []

    def close(self) -> None:
        """Called however the run ends (an interrupt too): release what the algorithm holds."""


class OfflineAlgorithm(Algorithm):
    """An algorithm that trains on a fixed list of examples: each step the next
    `per_device × accumulation × world` examples of the epoch stream, this rank's contiguous
    share of them, cut into `accumulation` micro-batches of `per_device` examples."""

    def __init__(self, examples: Sequence[Any], report: DataReport | None, per_device_batch_size: int,
                 gradient_accumulation_steps: int, dist: DistInfo, seed: int,
                 eval_examples: Sequence[Any] | None = None, shuffle: bool = True) -> None:
        self.examples = list(examples)
        self.report = report
        self.eval_examples = list(eval_examples) if eval_examples is not None else None
        self.per_device, self.accumulation, self.dist = per_device_batch_size, gradient_accumulation_steps, dist
        self.num_examples = len(self.examples)
        self.examples_per_step = per_device_batch_size * gradient_accumulation_steps * dist.world_size
        self.stream = EpochStream(self.num_examples, seed, shuffle)  # shuffle False: dataset order every epoch
        self.eval_batches = 1  # the eval set's micro-batches over all ranks, while `evaluate` runs

    def collate(self, examples: Sequence[Any]) -> Any:
        """Examples → one micro-batch (tensors on the model's device)."""
        raise NotImplementedError

    def step_batches(self, step: int) -> list[Any]:
        indices = self.stream.take(self.examples_per_step)
        share = self.per_device * self.accumulation
        mine = indices[self.dist.rank * share:(self.dist.rank + 1) * share]
        return [self.collate([self.examples[i] for i in mine[k * self.per_device:(k + 1) * self.per_device]])
                for k in range(self.accumulation)]

    @property
    def epoch(self) -> float:
        return self.stream.epoch

    def state_dict(self) -> dict[str, Any]:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.stream.load_state_dict(state["stream"])

    @property
    def evaluates(self) -> bool:
        """An eval dataset, or a subclass's own evaluation (the demo's held-out accuracy)."""
        return self.eval_examples is not None or type(self).evaluate is not OfflineAlgorithm.evaluate

    def evaluate(self, step: int) -> dict[str, float] | None:
        """`loss` and the metrics over the whole eval set, normalised as one big step."""
        if not self.eval_examples:
            return None
        batches = [self.collate(rows) for rows in self.eval_shares()]
        local = sum(float(self.count(b)) for b in batches)
        global_count, global_batches = all_reduce_op([local, len(batches)], self.dist, "sum").tolist()
        self.eval_batches = max(int(global_batches), 1)
        count = torch.tensor(float(global_count), device=_device_of(self.model))
        totals = MetricTotals()
        was_training = self.model.training
        self.model.eval()
        loss_sum = 0.0
        with torch.no_grad():
            for b in batches:
                loss, metrics = self.loss(self.model, b, count)
                loss_sum += float(loss)
                for name, m in metrics.items():
                    if as_metric(m).reduce != "cumulative":
                        totals.add(name, m)
        self.model.train(was_training)
        totals.add("loss", Metric.sum(loss_sum))
        return totals.all_reduce(self.dist).values()

    def eval_shares(self) -> list[list[Any]]:
        """This rank's evaluation micro-batches: every world_size-th eval row, per_device at a time."""
        assert self.eval_examples is not None
        share = self.eval_examples[self.dist.rank::self.dist.world_size]
        return [share[i:i + self.per_device] for i in range(0, len(share), self.per_device)]

    def micro_batch_share(self) -> float:
        """What one micro-batch's mean term (the router's load-balancing loss) counts for in the loss:
        training, one over the step's micro-batches on all ranks, as TRL divides by the accumulation
        steps; evaluating, one over the eval set's micro-batches, as TRL's eval loss is the mean of its
        batches' losses."""
        return 1.0 / (self.accumulation * self.dist.world_size if self.model.training else self.eval_batches)

    def summary_lines(self) -> list[str]:
        return self.report.lines() if self.report is not None else []


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device
