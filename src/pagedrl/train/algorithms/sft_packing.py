"""SFT's `packing`: TRL's best-fit-decreasing (`bfd`) bins of `max_length` tokens over the dataset.

A TRL user's `packing: true` changes what a row of the dataset is: examples are packed once, before
training, into rows of at most `max_length` tokens, and `per_device_train_batch_size` then counts those
rows; an epoch is the packed rows, so it takes fewer steps. Which examples share a row is TRL's
`pack_dataset(..., strategy="bfd")`: each block of 1000 examples (the batch of the `datasets.map` it runs
in) sorted by length, longest first (equal lengths in dataset order), each going into the open row whose
free space fits it most tightly (the oldest such row on a tie), else a new row. Examples keep their own
positions and attend only to themselves (the rows are trained padding-free), so packing changes the
grouping, never an example's loss.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from pagedrl.train.examples import PromptCompletion

PACK_BLOCK = 1000  # TRL packs inside each batch of `datasets.map(batched=True)`, 1000 rows by default


@dataclass(frozen=True)
class PackedRow:
    """Examples trained back to back in one row of at most `max_length` tokens."""

    examples: tuple[PromptCompletion, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(e.input_ids) for e in self.examples)


def pack_bfd(examples: Sequence[PromptCompletion], max_length: int) -> list[PackedRow]:
    """The rows TRL's bfd packing makes of `examples`, in its order; every example is at most
    `max_length` tokens already (the loader keeps each one's start, as TRL's packing cuts it)."""
    rows: list[PackedRow] = []
    for start in range(0, len(examples), PACK_BLOCK):
        rows += _pack_block(examples[start:start + PACK_BLOCK], max_length)
    return rows


def _pack_block(examples: Sequence[PromptCompletion], max_length: int) -> list[PackedRow]:
    bins: list[list[PromptCompletion]] = []
    spaces: list[int] = []  # the free spaces some open row has, ascending
    by_space: dict[int, deque[list[PromptCompletion]]] = {}
    for ex in sorted((e for e in examples if e.input_ids), key=lambda e: -len(e.input_ids)):  # stable
        n = len(ex.input_ids)
        if n > max_length:
            raise ValueError(f"{ex.where}: {n} tokens, longer than max_length={max_length}")
        k = bisect.bisect_left(spaces, n)
        if k < len(spaces):  # the tightest fit, the oldest row among equals
            space = spaces[k]
            row = by_space[space].popleft()
            if not by_space[space]:
                spaces.pop(k)
        else:
            space, row = max_length, []
            bins.append(row)
        row.append(ex)
        space -= n
        if space > 0:
            if not by_space.get(space):
                bisect.insort(spaces, space)
            by_space.setdefault(space, deque()).append(row)
    return [PackedRow(tuple(b)) for b in bins]


def unpack(items: Sequence[PromptCompletion | PackedRow]) -> list[PromptCompletion]:
    """A micro-batch's examples, packed rows opened in order."""
    return [e for item in items for e in (item.examples if isinstance(item, PackedRow) else (item,))]
