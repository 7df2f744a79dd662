"""A built-in verifiable task: arithmetic problems with exact answers, generated offline.

Problems are drawn from a fixed seed; the held-out set is drawn first and the training stream
never yields one of its problems, so held-out accuracy measures generalisation, not recall. The
default is two-digit addition, asked under the model's own chat template:
`What is {a} + {b}? Answer with just the number.`
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
TEMPLATE = "What is {a} {op} {b}? Answer with just the number."


@dataclass(frozen=True)
class ArithmeticTask:
    operations: tuple[str, ...] = ("+",)
    low: int = 10
    high: int = 99
    num_eval: int = 256
    seed: int = 0
    template: str = TEMPLATE

    def __post_init__(self) -> None:
        bad = [op for op in self.operations if op not in OPERATIONS]
        if not self.operations or bad:
            raise ValueError(f"operations: choose from {sorted(OPERATIONS)}, got {list(self.operations)}")
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
        space = len(self.operations) * (self.high - self.low + 1) ** 2
        if self.num_eval >= space:
            raise ValueError(f"num_eval ({self.num_eval}) leaves no training problems out of {space}")

    def row(self, a: int, op: str, b: int) -> dict[str, Any]:
        """A dataset row in TRL's conversational prompt format, with the answer as a column."""
        content = self.template.format(a=a, op=op, b=b)
        return {"prompt": [{"role": "user", "content": content}], "answer": str(OPERATIONS[op](a, b))}

    def _draw(self, rng: random.Random) -> tuple[int, str, int]:
        return rng.randint(self.low, self.high), rng.choice(self.operations), rng.randint(self.low, self.high)

    def eval_problems(self) -> list[tuple[int, str, int]]:
        rng = random.Random(f"arithmetic-eval-{self.seed}")
        seen: dict[tuple[int, str, int], None] = {}
        while len(seen) < self.num_eval:
            seen.setdefault(self._draw(rng))
        return list(seen)

    def eval_rows(self) -> list[dict[str, Any]]:
        return [self.row(*p) for p in self.eval_problems()]

    def train_rows(self, seed: int | None = None) -> Iterator[dict[str, Any]]:
        """An endless stream of training problems, none of them in the held-out set."""
        held_out = set(self.eval_problems())
        rng = random.Random(f"arithmetic-train-{self.seed if seed is None else seed}")
        while True:
            problem = self._draw(rng)
            if problem not in held_out:
                yield self.row(*problem)
