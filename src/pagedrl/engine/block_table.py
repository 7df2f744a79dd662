"""Every live sequence's block table as one row of a persistent array, kept up to date as it changes.

The KV cache manager writes here at each change of a sequence's blocks (fresh blocks appended, a
shared block replaced by its copy, a fork, a free), so the model runner never rebuilds the tables
from Python lists: a step reads the rows of its sequences with one `index_select` (vLLM v1's
persistent batch). A decode step changes a row only when a sequence starts a new block, one step in
`block_size`, so the per-step cost follows what changed, not the batch.

The array is numpy (a single element write costs ~0.1 us, a torch one ~5 us) and `tensor` is a torch
view of the same memory, so reading needs no copy either. Rows and columns grow by doubling; a row
is zeroed when released, so ids past a sequence's own blocks are block 0, as the paged-attention
metadata pads them.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    """Rows of block ids, one per live sequence; `tensor` [rows, cols] int64 shares their memory."""

    def __init__(self, num_rows: int = 64, num_cols: int = 32) -> None:
        self._ids = np.zeros((num_rows, num_cols), dtype=np.int64)
        self._tensor = torch.from_numpy(self._ids)
        self._free = list(range(num_rows - 1, -1, -1))  # popped from the end: row 0 first

    @property
    def tensor(self) -> torch.Tensor:
        """The whole array as a torch tensor (no copy). Valid until the next row or column growth:
        read it anew each step."""
        return self._tensor

    @property
    def num_live_rows(self) -> int:
        return self._ids.shape[0] - len(self._free)

    def new_row(self) -> int:
        if not self._free:
            rows = self._ids.shape[0]
            self._resize(2 * rows, self._ids.shape[1])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        return self._free.pop()

    def release(self, row: int, num_blocks: int) -> None:
        """Give the row back, zeroing its first `num_blocks` ids (the rest are zero already)."""
        self._ids[row, :num_blocks] = 0
        self._free.append(row)

    def write(self, row: int, start: int, block_ids: list[int]) -> None:
        """Set ids [start, start + len(block_ids)) of the row."""
        end = start + len(block_ids)
        self.reserve_cols(end)
        self._ids[row, start:end] = block_ids

    def reserve_cols(self, num_cols: int) -> None:
        """At least `num_cols` columns (the new ones zero)."""
        if num_cols > self._ids.shape[1]:
            self._resize(self._ids.shape[0], max(num_cols, 2 * self._ids.shape[1]))

    def copy_row(self, src: int, dst: int) -> None:
        self._ids[dst] = self._ids[src]

    def row(self, row: int, num_blocks: int) -> list[int]:
        return self._ids[row, :num_blocks].tolist()

    def _resize(self, num_rows: int, num_cols: int) -> None:
        grown = np.zeros((num_rows, num_cols), dtype=np.int64)
        grown[: self._ids.shape[0], : self._ids.shape[1]] = self._ids
        self._ids = grown
        self._tensor = torch.from_numpy(grown)
