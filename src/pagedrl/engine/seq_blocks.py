"""What the KV cache manager keeps per sequence (`SeqBlocks`) and what a prefix lookup hands back to it
(`ComputedBlocks`): the records, apart from the policy that fills them (`engine/kv_cache_manager.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedrl.engine.block_pool import BlockHash, KVBlock

SeqId = int | str
# The table entry of a block that fell out of every layer's window and went back to the pool: never read,
# never freed again, never shared (its id, 0, is only what the persistent table shows).
OUT_OF_WINDOW = KVBlock(0)


@dataclass
class SeqBlocks:
    """A sequence's block table, how many of its leading full blocks are hashed, its KV version, its
    row in the persistent `BlockTable`, the salt of its chain hashes (its LoRA adapter), and how many
    of its leading blocks fell out of the window (`OUT_OF_WINDOW` entries)."""

    weight_version: int
    row: int
    blocks: list[KVBlock] = field(default_factory=list)
    num_hashed_blocks: int = 0
    salt: bytes = b""
    num_dropped: int = 0

    def held(self) -> list[KVBlock]:
        """The blocks the sequence holds (its table less the placeholders)."""
        return self.blocks[self.num_dropped:]


@dataclass(frozen=True)
class ComputedBlocks:
    """What a prefix lookup found: cached blocks holding a prompt's first `num_tokens` tokens.

    Nothing is held yet: pass this to `allocate_slots`, which takes the blocks and records the
    lookup (`num_queried_tokens` looked up, `num_tokens` hit) once the allocation succeeds."""

    blocks: list[KVBlock]
    hashes: list[BlockHash]
    num_tokens: int
    num_queried_tokens: int


def blocks_below_window(num_blocks: int, first_query: int, block_size: int, window: int | None) -> int:
    """How many of a sequence's first `num_blocks` blocks lie wholly below the window of a query at
    position `first_query` (none without a window): no query from there on reads them."""
    if window is None:
        return 0
    return min(num_blocks, max(0, first_query - window + 1) // block_size)


def window_hits(found: list[KVBlock | None], block_size: int, window: int) -> int:
    """The most leading blocks k whose blocks a query at position k * block_size reads (its window's)
    are all cached (`found[i]` None: block i is not): a windowed prefix lookup, from the right."""
    run, runs = 0, []  # cached blocks in a row, ending at each block
    for block in found:
        run = run + 1 if block is not None else 0
        runs.append(run)
    for k in range(len(found), 0, -1):
        if runs[k - 1] >= k - blocks_below_window(k, k * block_size, block_size, window):
            return k
    return 0
