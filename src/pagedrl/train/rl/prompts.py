"""Where an online algorithm's prompts come from: the arithmetic task's endless stream, or a
`{"prompt", ...columns}` dataset epoch after epoch. Both arrive as `PromptOnly` rows, read and
checked by the one prompt-row reader in `train/data.py`, so GRPO and PPO tokenize a prompt once
and name a bad row the same way."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from typing import Any

from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.algorithm import EpochStream
from pagedrl.train.data import DataReport, Row, config_splits, load_examples
from pagedrl.train.distributed import DistInfo
from pagedrl.train.examples import PromptOnly, PromptRows
from pagedrl.train.rl.arithmetic import ArithmeticTask


class PromptSource:
    """Prompts in order. Its position is one integer, so a checkpoint can resume it exactly.

    `config` needs: dataset, eval_dataset (and their splits), max_prompt_length, seed, on_bad_row and the `task_*`
    fields of the arithmetic task (GRPOConfig and PPOConfig both have them)."""

    def __init__(self, config: Any, tokenizer: Tokenizer, dist: DistInfo, context: int | None = None) -> None:
        self.consumed = 0
        self.task: ArithmeticTask | None = None
        self.rows: list[PromptOnly] = []
        limit, name = config.max_prompt_length, "max_prompt_length"
        if limit is None and context is not None:  # a prompt must leave the model room for one completion token
            limit, name = context - 1, "the model's context less one token (max_prompt_length unset)"
        self.convert = PromptRows(tokenizer, limit, "error", limit_name=name)
        self.report: DataReport | None = None
        self.on_bad_row = config.on_bad_row
        self.splits = config_splits(config)
        if config.dataset == "arithmetic":
            self.task = ArithmeticTask(tuple(config.task_operations), config.task_low, config.task_high,
                                       config.task_num_eval, seed=config.seed)
            self._stream: Iterator[PromptOnly] = (self._task_row(i, r) for i, r in
                                                  enumerate(self.task.train_rows()))
        else:
            if config.dataset is None:
                raise ValueError("dataset: an online algorithm needs prompts: a JSONL, JSON, Parquet or Arrow file or "
                                 "folder, or 'arithmetic'")
            self.rows, self.report = load_examples(config.dataset, self.convert, config.on_bad_row, self.splits[0])
            self.order = EpochStream(len(self.rows), config.seed)
        self.eval_dataset = config.eval_dataset
        self.rank, self.world = dist.rank, dist.world_size

    def _task_row(self, i: int, values: Mapping[str, Any]) -> PromptOnly:
        out = self.convert(Row(f"arithmetic[{i}]", dict(values)), DataReport("arithmetic"))
        assert out is not None  # "error" truncation never skips
        return out

    def take(self, n: int) -> list[PromptOnly]:
        """This rank's share of the next n × world prompts."""
        return self.take_share(n * self.world)[0]

    def take_share(self, total: int) -> tuple[list[PromptOnly], list[int]]:
        """This rank's contiguous share of the next `total` prompts of the run (rank r gets
        [r·total // world, (r+1)·total // world): in rank order the shares are the prompts one
        process would take) and their positions in the run's stream of prompts."""
        start = self.consumed
        if self.task is not None:
            rows = list(itertools.islice(self._stream, total))
        else:
            rows = [self.rows[i] for i in self.order.take(total)]
        self.consumed += total
        lo, hi = self.rank * total // self.world, (self.rank + 1) * total // self.world
        return rows[lo:hi], list(range(start + lo, start + hi))

    def eval_rows(self) -> list[PromptOnly]:
        if self.eval_dataset is not None:
            return load_examples(self.eval_dataset, self.convert, self.on_bad_row, self.splits[1])[0]
        if self.task is None:
            return []
        return [self._task_row(i, r) for i, r in enumerate(self.task.eval_rows())]

    @property
    def longest_prompt(self) -> int:
        """Tokens of the dataset's longest prompt (0 for the arithmetic task's stream, whose prompts are short)."""
        return max((len(r.prompt_ids) for r in self.rows), default=0)

    @property
    def epoch(self) -> float:
        return self.consumed / len(self.rows) if self.rows else 0.0

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        target = int(state["consumed"])
        while self.consumed < target:  # replay the stream in chunks: cheap, and exact
            self.take_share(min(1024, target - self.consumed))
