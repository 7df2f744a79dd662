"""The order of rows that belong together in fixed blocks: KTO's, where each block of
`per_device_train_batch_size` rows, in dataset order, lends its own completions to its rows' KL pairs
(`unpaired.pair_kl`), so that a micro-batch must be exactly one block for its KL term to mean what TRL's does.

`EpochStream` runs one epoch into the next and keeps every batch full; here, as in TRL's sequential
dataloader, each epoch's blocks are the micro-batches (the last block short when the row count is not a
multiple of the block), and an epoch's last step takes only the micro-batches left (transformers'
remainder step), so the next epoch starts again at block 0. A step's blocks are shared out as the rows of
`OfflineAlgorithm` are, each rank a contiguous run of them; where the last step's blocks do not split
evenly over the ranks, it is padded with the epoch's first blocks, as accelerate pads the last round (it
tops a short last batch up with the first rows; here the short block stays whole, so every micro-batch is
a block). The position is one integer, the steps taken."""

from __future__ import annotations

import math
from collections.abc import Mapping


def blocks_of(num_rows: int, block: int) -> list[list[int]]:
    """Row indices in blocks of `block`, in order; the last block short when `block` does not divide."""
    return [list(range(start, min(start + block, num_rows))) for start in range(0, num_rows, block)]


class BlockStream:
    """Each step: this rank's micro-batches, each one whole block of rows (see the module docstring)."""

    def __init__(self, num_examples: int, block: int, accumulation: int, world_size: int) -> None:
        if num_examples < 1:
            raise ValueError(f"num_examples: must be >= 1, got {num_examples}")
        self.num_examples, self.world_size = num_examples, world_size
        self.blocks = blocks_of(num_examples, block)
        self.blocks_per_step = accumulation * world_size
        self.steps_per_epoch = math.ceil(len(self.blocks) / self.blocks_per_step)
        self.steps = 0

    def take(self, rank: int) -> list[list[int]]:
        """The next step's micro-batches of `rank` (the same number on every rank), as row indices."""
        step = self.steps % self.steps_per_epoch
        chosen = self.blocks[step * self.blocks_per_step:(step + 1) * self.blocks_per_step]
        each = math.ceil(len(chosen) / self.world_size)
        chosen = chosen + [self.blocks[i % len(self.blocks)] for i in range(each * self.world_size - len(chosen))]
        self.steps += 1
        return chosen[rank * each:(rank + 1) * each]

    @property
    def epoch(self) -> float:
        return self.steps / self.steps_per_epoch

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps, "num_examples": self.num_examples}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state.get("num_examples") != self.num_examples or "steps" not in state:
            raise ValueError(f"resume_from_checkpoint: the checkpoint's data position {dict(state)} is not one of "
                             f"this run's {self.num_examples} rows in blocks; resuming would not continue the same run")
        self.steps = int(state["steps"])
