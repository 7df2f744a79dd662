"""SFT's `packing`: TRL's `pack_dataset` strategies, rows of at most `max_length` tokens over the dataset.

A TRL user's `packing: true` changes what a row of the dataset is: examples are packed once, before
training, into rows of at most `max_length` tokens, and `per_device_train_batch_size` then counts those
rows; an epoch is the packed rows, so it takes fewer steps. TRL packs each block of 1000 examples (the
batch of the `datasets.map` it runs in) on its own, and so does each strategy here:

- `bfd` (TRL's default): the examples sorted by length, longest first (equal lengths in dataset order),
  each going into the open row whose free space fits it most tightly (the oldest such row on a tie), else
  a new row. An example longer than `max_length` has been cut to its start when read (TRL's packer cuts
  it so). Examples keep their own positions and attend only to themselves (the rows are trained
  padding-free), so packing changes the grouping, never an example's loss.
- `bfd_split`: the same, but an example longer than `max_length` is first split into pieces of
  `max_length` tokens (the last one shorter), each packed as an example of its own: no token is dropped,
  and a piece's first token is predicted from nothing, as the start of any example is.
- `wrapped`: the block's tokens back to back, cut every `max_length` tokens (the block's last row
  shorter), whatever the examples' edges: a row is one sequence, attending across the examples in it,
  its positions counting from 0, each token labelled as it was in its example. TRL trains these rows
  padded (or back to back with `padding_free`), as plain sequences.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pagedrl.train.examples import PromptCompletion, label_mask

PackingStrategy = Literal["bfd", "bfd_split", "wrapped"]
PACK_BLOCK = 1000  # TRL packs inside each batch of `datasets.map(batched=True)`, 1000 rows by default


@dataclass(frozen=True)
class PackedRow:
    """Examples trained back to back in one row of at most `max_length` tokens."""

    examples: tuple[PromptCompletion, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(e.input_ids) for e in self.examples)


def pack(examples: Sequence[PromptCompletion], max_length: int, strategy: PackingStrategy,
         completion_only: bool = True) -> list[PackedRow] | list[PromptCompletion]:
    """The dataset's rows as TRL's `pack_dataset(examples, max_length, strategy)` makes them, in its order.
    `completion_only` is the loss's choice of labels, which `wrapped` rows carry token by token."""
    if strategy == "wrapped":
        return pack_wrapped(examples, max_length, completion_only)
    return pack_bfd(examples, max_length, split=strategy == "bfd_split")


def pack_bfd(examples: Sequence[PromptCompletion], max_length: int, split: bool = False) -> list[PackedRow]:
    """The rows TRL's bfd packing makes of `examples`, in its order. Without `split` every example is at
    most `max_length` tokens already (the loader keeps each one's start, as TRL's packing cuts it); with
    it (`bfd_split`) a longer one is packed as its pieces of `max_length` tokens."""
    rows: list[PackedRow] = []
    for start in range(0, len(examples), PACK_BLOCK):
        block = examples[start:start + PACK_BLOCK]
        if split:
            block = [piece for e in block for piece in _pieces(e, max_length)]
        rows += _pack_block(block, max_length)
    return rows


def _pieces(example: PromptCompletion, max_length: int) -> list[PromptCompletion]:
    """`example` cut every `max_length` tokens, each piece's tokens keeping their labels: a prompt token
    stays a prompt token, an assistant mask is cut with the tokens."""
    n = len(example.input_ids)
    if n <= max_length:
        return [example]
    return [slice_example(example, a, min(a + max_length, n), f"{example.where} (tokens {a}-{min(a + max_length, n)})")
            for a in range(0, n, max_length)]


def slice_example(example: PromptCompletion, start: int, end: int, where: str) -> PromptCompletion:
    """Tokens `start:end` of `example` as an example of their own, each with the label it had."""
    p = len(example.prompt_ids)
    mask = example.assistant_mask
    return PromptCompletion(example.prompt_ids[start:end], example.completion_ids[max(0, start - p):max(0, end - p)],
                            where, example.columns, None if mask is None else mask[start:end])


def pack_wrapped(examples: Sequence[PromptCompletion], max_length: int,
                 completion_only: bool = True) -> list[PromptCompletion]:
    """TRL's `wrapped` rows: each block's tokens back to back, cut every `max_length`. A row is one
    sequence whose `assistant_mask` says which of its tokens carry a label (as its example labelled them,
    `label_mask`); it has no prompt of its own."""
    rows: list[PromptCompletion] = []
    for start in range(0, len(examples), PACK_BLOCK):
        block = examples[start:start + PACK_BLOCK]
        ids = [t for e in block for t in e.input_ids]
        labels = [m for e in block for m in label_mask(e, completion_only)]
        first = block[0].where if block else ""
        for a in range(0, len(ids), max_length):
            rows.append(PromptCompletion([], ids[a:a + max_length], f"packed row from {first} (tokens {a}-"
                                         f"{min(a + max_length, len(ids))} of its block)", {}, labels[a:a + max_length]))
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
