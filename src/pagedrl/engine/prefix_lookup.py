"""A KV cache manager's prefix lookups: the chain hashes of a sequence's full blocks, and the longest
prefix of a prompt whose blocks the pool still holds (`KVCacheManager`'s queries, apart from what it
allocates)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedrl.engine.block_pool import BlockHash, BlockPool, hash_block_tokens
from pagedrl.engine.seq_blocks import OUT_OF_WINDOW, ComputedBlocks, window_hits


class PrefixLookup:
    """The lookups of a manager with a `pool`, a `block_size`, prefix caching on or off, a sliding window
    or none, a `group_tag` for the pool's keys, and the weight version its hashes carry."""

    pool: BlockPool
    block_size: int
    enable_prefix_caching: bool
    sliding_window: int | None
    group_tag: bytes
    _weight_version: int

    def get_computed_blocks(
        self, token_ids: Sequence[int], block_hashes: list[BlockHash] | None = None, salt: bytes = b"",
        max_blocks: int | None = None,
    ) -> ComputedBlocks:
        """The longest cached prefix of `token_ids` (a multiple of `block_size` tokens, at most
        `max_blocks` blocks). A pure query: no block is held and no statistic changes; only
        `block_hashes`, the sequence's own list of chain hashes, is brought up to date (see `hash_blocks`).

        The last token is never a hit: its logits are needed, so at most (len - 1) // block_size
        blocks match. Under a sliding window a prefix needs only the blocks of the next query's window
        cached: those below it may have been evicted (they are `OUT_OF_WINDOW` in the result, never read
        or held), so the longest such prefix is found from the right, as vLLM's sliding-window lookup does."""
        if len(token_ids) == 0:
            raise ValueError("token_ids must not be empty")
        if not self.enable_prefix_caching:
            return ComputedBlocks([], [], 0, 0)
        num_candidates = (len(token_ids) - 1) // self.block_size
        if max_blocks is not None:
            num_candidates = min(num_candidates, max_blocks)
        hashes = self.hash_blocks(token_ids, num_candidates, block_hashes, salt)
        found = []
        for block_hash in hashes[:num_candidates]:
            block = self.pool.get_cached_block(self._pool_key(block_hash))
            if block is None and self.sliding_window is None:
                break
            found.append(block)
        num_hits = len(found) if self.sliding_window is None else window_hits(found, self.block_size,
                                                                                self.sliding_window)
        blocks = [OUT_OF_WINDOW if block is None else block for block in found[:num_hits]]
        return ComputedBlocks(blocks, hashes[:num_hits], num_hits * self.block_size, len(token_ids))

    def _pool_key(self, block_hash: BlockHash) -> BlockHash:
        """What the pool files a block under: its chain hash, tagged with this group's tag if any."""
        return BlockHash(block_hash.digest + self.group_tag, block_hash.weight_version) if self.group_tag else block_hash

    def hash_blocks(
        self, token_ids: Sequence[int], num_blocks: int, block_hashes: list[BlockHash] | None = None,
        salt: bytes = b"",
    ) -> list[BlockHash]:
        """Chain hashes of the first `num_blocks` full blocks of `token_ids` under the current
        weights, extending `block_hashes` in place: blocks hashed before are not hashed again.

        `block_hashes` must have been built from these `token_ids` (a sequence's tokens only ever
        grow). A list computed under older weights is started again: no hash of old keys and
        values may be found under new ones. Without a list every block is hashed afresh. `salt` (a
        sequence's adapter) enters the first block's hash, so the whole chain."""
        hashes = [] if block_hashes is None else block_hashes
        if hashes and hashes[0].weight_version != self._weight_version:
            hashes.clear()
        bs = self.block_size
        for i in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs], self._weight_version, salt))
        return hashes
