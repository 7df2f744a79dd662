"""The KV cache manager: which blocks each sequence gets (policy over the block pool).

Each sequence owns a block table, a list of physical blocks covering its tokens in order. The
manager fills it three ways: prefix hits (cached full blocks whose chain hash matches the prompt),
fresh blocks for new tokens, and copy-on-write when a sequence is about to write into a block it
shares (after `fork`, the n samples of one prompt share every block, the partial last one too).

Admission is a query, then an allocation (vLLM v1): `get_computed_blocks` looks the prompt up and
changes nothing, `allocate_slots` takes the hit blocks together with the fresh ones, all or
nothing, and only then records the lookup in the prefix-cache statistics. A request that has to
wait for memory therefore holds nothing while it waits and is counted once, when it is admitted.

The chain hashes of a sequence's full blocks belong to the sequence (`block_hashes`, a list the
caller keeps and the manager extends): each full block is hashed once as the sequence grows, not
again on every lookup or step.

Timing contract with the scheduler and the model runner: full blocks are registered in the cache
when they are allocated, before the forward that writes them; that forward runs before any later
step can read them. So: run `take_pending_copies()` and then the forward for every successful
`allocate_slots` of a step, and free a sequence only between steps.

A model whose every layer slides over the same window (`sliding_window`) needs no key more than
window - 1 positions behind the first query of a step: at each `allocate_slots` the blocks wholly below
that go back to the pool (ref counts, prefix sharing and the prefix cache as for any freed block: a
freed full block keeps its hash) and the sequence's table keeps a placeholder, `OUT_OF_WINDOW` (block 0
in the persistent table), which no kernel reads: the attention of a windowed layer starts at the
window's first block. So a long sequence holds about ceil(window / block_size) + 1 blocks plus its
step's chunk, not its length. Models whose layers differ (Gemma's, gpt-oss's full layers beside sliding
ones) hold one manager a group of layers, over one pool (`kv_cache_groups`).

A sequence's keys and values carry the weight version they were computed under. A sequence that
started before `bump_weight_version()` keeps running on its old blocks, but nothing it computes
is cached any more: its later blocks mix old and new weights and match no hash.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedrl.engine.block_pool import BlockHash, BlockPool, KVBlock, PoolCounts
from pagedrl.engine.block_table import BlockTable
from pagedrl.engine.host_tensors import long_tensor
from pagedrl.engine.prefix_lookup import PrefixLookup
from pagedrl.engine.seq_blocks import OUT_OF_WINDOW, ComputedBlocks, SeqBlocks, SeqId, blocks_below_window


class KVCacheManager(PrefixLookup, PoolCounts):
    """Block tables for every live sequence over one `BlockPool`."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 sliding_window: int | None = None, pool: BlockPool | None = None, group_tag: bytes = b"") -> None:
        """`pool` and `group_tag`: one group of layers' tables over a pool the groups share
        (`kv_cache_groups`); the tag keeps a group's cached blocks apart from the others' in the pool."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks) if pool is None else pool
        self.group_tag = group_tag
        self._seqs: dict[SeqId, SeqBlocks] = {}
        self.table = BlockTable()  # every live sequence's block ids, kept as they change
        self._weight_version = 0
        self._pending_copies: list[tuple[int, int]] = []
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ----------------------------------------------------------------- sequences

    def allocate_slots(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
        block_hashes: list[BlockHash] | None = None,
        salt: bytes = b"",
    ) -> bool:
        """Make the sequence's table cover `num_computed_tokens + num_new_tokens` tokens, writable.

        `computed`, the prefix lookup of a sequence that holds no blocks yet, is attached first
        (its blocks cover its `num_tokens`, which `num_computed_tokens` counts) and recorded in the
        prefix-cache statistics. All or nothing: returns False, changing nothing, when the free
        queue (cached free blocks included) cannot supply the fresh blocks and the hits that are
        free. A shared block that the new tokens will be written into is replaced by a fresh
        one; if it already holds computed tokens a (src, dst) copy is queued for
        `take_pending_copies`. Blocks that end up full of known tokens are then cached, hashed
        through `block_hashes` (see `hash_blocks`), under the `salt` the sequence was first given.
        Under a sliding window the blocks below this step's windows are freed, even on a refusal:
        no query of the sequence reads them again."""
        if num_computed_tokens < 0:
            raise ValueError(f"num_computed_tokens must be >= 0, got {num_computed_tokens}")
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        total = num_computed_tokens + num_new_tokens
        if total > len(token_ids):
            raise ValueError(
                f"num_computed_tokens + num_new_tokens = {total} exceeds len(token_ids) = {len(token_ids)}"
            )
        bs = self.block_size
        seq = self._seqs.get(seq_id)
        if computed is None and self.in_place(seq_id, num_computed_tokens, num_new_tokens):
            # The common decode step: the new tokens go into blocks the sequence already owns alone,
            # past its hashed ones: nothing to allocate, copy or check but the full blocks to cache.
            assert seq is not None
            if total // bs > seq.num_hashed_blocks:
                self._cache_full_blocks(seq, token_ids, total, block_hashes)
            return True
        hits = self.check_computed(seq_id, computed, num_computed_tokens)
        below = self._hits_below_window(len(hits), num_computed_tokens)
        if seq is None:
            seq = self._seqs[seq_id] = SeqBlocks(self._weight_version, self.table.new_row(), salt=salt)
        elif not seq.blocks:
            seq.weight_version = self._weight_version  # no keys and values yet: all computed from now on
        blocks = seq.blocks
        num_held = len(blocks) + len(hits)
        if num_computed_tokens > num_held * bs:
            raise ValueError(
                f"num_computed_tokens = {num_computed_tokens} but sequence {seq_id!r} holds only "
                f"{num_held} blocks ({num_held * bs} tokens)"
            )
        num_hashed = len(hits) if computed is not None else seq.num_hashed_blocks
        if num_computed_tokens < num_hashed * bs:
            raise ValueError(
                f"num_computed_tokens = {num_computed_tokens} would rewrite the {num_hashed} full "
                f"blocks of sequence {seq_id!r} that are already hashed"
            )
        shared, num_needed = self._fresh_blocks(blocks, num_held, num_computed_tokens, num_new_tokens)
        # A hit on a free cached block takes it out of the free queue too (not one below the window: it is
        # never held, its place a placeholder from the start).
        num_free_hits = sum(1 for block in hits[below:] if block.ref_count == 0)
        if num_needed + num_free_hits > self.pool.num_free_blocks:
            return False
        if computed is not None:
            self.pool.touch(hits[below:])  # before taking fresh blocks, which could evict them
            blocks.extend([OUT_OF_WINDOW] * below + hits[below:])
            seq.num_hashed_blocks = len(hits)
            seq.num_dropped = below
            self.prefix_cache_queries += computed.num_queried_tokens
            self.prefix_cache_hits += computed.num_tokens
        first_changed = len(blocks) - len(hits) if computed is not None else len(blocks)
        fresh = self.pool.get_new_blocks(num_needed)
        for i, new in zip(shared, fresh, strict=False):
            old = blocks[i]
            blocks[i] = new
            self.pool.free_blocks([old])  # still held by its other tables
            if i * bs < num_computed_tokens:
                self._pending_copies.append((old.block_id, new.block_id))
            first_changed = min(first_changed, i)
        blocks.extend(fresh[len(shared) :])
        if first_changed < len(blocks):
            self.table.write(seq.row, first_changed, [block.block_id for block in blocks[first_changed:]])
        self._cache_full_blocks(seq, token_ids, total, block_hashes)
        if self.sliding_window is not None:  # prefix hits below the window of this step's first query
            self._drop_out_of_window(seq, num_computed_tokens)
        return True

    def in_place(self, seq_id: SeqId, num_computed_tokens: int, num_new_tokens: int) -> bool:
        """Whether the new tokens go into blocks the sequence already holds alone, past its hashed ones (a
        decode step's usual case: `allocate_slots` then takes nothing); the blocks below the window are
        freed first, as `allocate_slots` does."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return False
        if self.sliding_window is not None:
            self._drop_out_of_window(seq, num_computed_tokens)
        total = num_computed_tokens + num_new_tokens
        return (seq.num_hashed_blocks * self.block_size <= num_computed_tokens < total
                and self._fits_in_place(seq.blocks, num_computed_tokens, total))

    def _fresh_blocks(self, blocks: list[KVBlock], num_held: int, num_computed_tokens: int,
                      num_new_tokens: int) -> tuple[list[int], int]:
        """The indices of the shared blocks the new tokens go into (each replaced by a fresh copy) and how
        many fresh blocks that and the blocks past `num_held` take."""
        bs = self.block_size
        num_required = -(-(num_computed_tokens + num_new_tokens) // bs)
        shared = []
        if num_new_tokens > 0:
            first_written = num_computed_tokens // bs
            shared = [i for i in range(first_written, min(num_required, len(blocks))) if blocks[i].ref_count > 1]
        return shared, len(shared) + max(0, num_required - num_held)

    def blocks_needed(self, seq_id: SeqId, num_computed_tokens: int, num_new_tokens: int,
                      computed: ComputedBlocks | None = None) -> int:
        """How many blocks `allocate_slots` with these arguments would take out of the pool's free queue
        now (fresh ones, and hits that are free), changing nothing but the blocks below the window,
        which it frees as `allocate_slots` does: what the groups sharing a pool ask before any allocates."""
        seq = self._seqs.get(seq_id)
        if seq is not None and self.sliding_window is not None:
            self._drop_out_of_window(seq, num_computed_tokens)
        blocks = seq.blocks if seq is not None else []
        hits = computed.blocks if computed is not None else []
        _, num_needed = self._fresh_blocks(blocks, len(blocks) + len(hits), num_computed_tokens, num_new_tokens)
        return num_needed + sum(1 for block in self.attached_hits(computed, num_computed_tokens) if block.ref_count == 0)

    def attached_hits(self, computed: ComputedBlocks | None, num_computed_tokens: int) -> list[KVBlock]:
        """The hits of `computed` that `allocate_slots` holds: not those wholly below the window of the
        first query (at `num_computed_tokens`), which it never takes."""
        if computed is None:
            return []
        return computed.blocks[self._hits_below_window(len(computed.blocks), num_computed_tokens):]

    def _hits_below_window(self, num_hits: int, num_computed_tokens: int) -> int:
        return blocks_below_window(num_hits, num_computed_tokens, self.block_size, self.sliding_window)

    def _drop_out_of_window(self, seq: SeqBlocks, first_query: int) -> None:
        """Free the blocks wholly below `first_query` - window + 1 (no query from this step on reads them)
        and leave `OUT_OF_WINDOW` in their place, tail of the dropped run first freed last, as `free` does."""
        assert self.sliding_window is not None
        target = blocks_below_window(len(seq.blocks), first_query, self.block_size, self.sliding_window)
        if target <= seq.num_dropped:
            return
        start = seq.num_dropped
        self.pool.free_blocks(reversed(seq.blocks[start:target]))
        seq.blocks[start:target] = [OUT_OF_WINDOW] * (target - start)
        seq.num_dropped = target
        self.table.write(seq.row, start, [OUT_OF_WINDOW.block_id] * (target - start))

    def _fits_in_place(self, blocks: list[KVBlock], num_computed_tokens: int, total: int) -> bool:
        """Whether tokens [num_computed_tokens, total) go into blocks of `blocks` held by this sequence alone."""
        bs = self.block_size
        if total > len(blocks) * bs:
            return False
        first, last = num_computed_tokens // bs, (total - 1) // bs
        if first == last:  # a decode: one block
            return blocks[first].ref_count == 1
        return all(blocks[i].ref_count == 1 for i in range(first, last + 1))

    def check_computed(self, seq_id: SeqId, computed: ComputedBlocks | None, num_computed_tokens: int) -> list[KVBlock]:
        """The hit blocks of `computed`, after checking that those it attaches (`attached_hits`) can still
        be attached: the ones below the window are never read, whatever they hold by now."""
        if computed is None:
            return []
        seq = self._seqs.get(seq_id)
        if seq is not None and seq.blocks:
            raise ValueError(
                f"sequence {seq_id!r} already holds {len(seq.blocks)} blocks; prefix hits attach only "
                "to a sequence without blocks (free it first)"
            )
        below = self._hits_below_window(len(computed.blocks), num_computed_tokens)
        for block, block_hash in zip(computed.blocks[below:], computed.hashes[below:], strict=True):
            if block.block_hash != self._pool_key(block_hash):
                raise ValueError(
                    f"computed: block {block.block_id} no longer holds the prefix it was found for "
                    "(evicted, or a new weight version); look the prompt up again"
                )
        return computed.blocks

    def _cache_full_blocks(
        self, seq: SeqBlocks, token_ids: Sequence[int], num_tokens: int, block_hashes: list[BlockHash] | None
    ) -> None:
        """Register the blocks full of the first `num_tokens` tokens not yet hashed."""
        if not self.enable_prefix_caching or seq.weight_version != self._weight_version:
            return
        num_full = num_tokens // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return
        hashes = self.hash_blocks(token_ids, num_full, block_hashes, seq.salt)
        for i in range(max(seq.num_hashed_blocks, seq.num_dropped), num_full):
            self.pool.cache_full_block(seq.blocks[i], self._pool_key(hashes[i]))
        seq.num_hashed_blocks = num_full

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """Give `child_id` the parent's table; every block gains a holder. The first write into a
        shared block copies it (see `allocate_slots`)."""
        if child_id in self._seqs:
            raise ValueError(f"child_id {child_id!r} is already a live sequence")
        parent = self._get(parent_id)
        self.pool.touch(parent.held())
        child = SeqBlocks(parent.weight_version, self.table.new_row(), list(parent.blocks), parent.num_hashed_blocks,
                           parent.salt, parent.num_dropped)
        self.table.copy_row(parent.row, child.row)
        self._seqs[child_id] = child

    def free(self, seq_id: SeqId) -> None:
        """Release a sequence's blocks. They are freed tail first, so its last blocks are evicted
        before its prefix, which other prompts are likelier to share.

        A sequence that holds nothing (never scheduled, or already freed) is left alone, so a
        request can be aborted at any stage; its blocks are released exactly once either way."""
        seq = self._seqs.pop(seq_id, None)
        if seq is not None:
            self.pool.free_blocks(reversed(seq.held()))
            self.table.release(seq.row, len(seq.blocks))

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write block copies (src, dst) queued since the last call, to run in this order
        before the next forward."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ------------------------------------------------------------------ tables

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The sequence's block ids, `OUT_OF_WINDOW`'s (0) for the blocks that fell out of its window."""
        return [block.block_id for block in self._get(seq_id).blocks]

    def num_held_blocks(self, seq_id: SeqId) -> int:
        """Blocks the sequence holds now (those that fell out of its window not counted)."""
        seq = self._get(seq_id)
        return len(seq.blocks) - seq.num_dropped

    def block_table_rows(self, seq_ids: Sequence[SeqId], num_blocks: int) -> torch.Tensor:
        """The first `num_blocks` block ids of each sequence's table, [len(seq_ids), num_blocks] int64,
        padded with block 0: read from the persistent table, nothing rebuilt (see `BlockTable`)."""
        try:
            rows = long_tensor([self._seqs[s].row for s in seq_ids])
        except KeyError as missing:
            raise ValueError(f"unknown sequence {missing.args[0]!r} (never allocated, or already freed)") from None
        self.table.reserve_cols(num_blocks)
        return self.table.tensor[:, :num_blocks].index_select(0, rows)

    def slot(self, seq_id: SeqId, position: int) -> int:
        """Physical slot (block id * block_size + offset) holding token `position` of the sequence."""
        blocks = self._get(seq_id).blocks
        if not 0 <= position < len(blocks) * self.block_size:
            raise ValueError(
                f"position {position} is outside the {len(blocks) * self.block_size} slots of sequence {seq_id!r}"
            )
        return blocks[position // self.block_size].block_id * self.block_size + position % self.block_size

    def slot_mapping(self, seq_id: SeqId, start: int, stop: int) -> list[int]:
        """Slots of positions [start, stop)."""
        return [self.slot(seq_id, p) for p in range(start, stop)]

    def _get(self, seq_id: SeqId) -> SeqBlocks:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id!r} (never allocated, or already freed)")
        return seq

    # ------------------------------------------------------------ weight version

    @property
    def weight_version(self) -> int:
        return self._weight_version

    def bump_weight_version(self) -> int:
        """The weights changed: no key or value computed before may be found again. Live sequences
        keep their blocks; every cached hash is dropped and new hashes carry the new version."""
        self._weight_version += 1
        self.pool.drop_cached_hashes()
        return self._weight_version

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (same weights); live sequences are untouched."""
        self.pool.drop_cached_hashes()


    def most_blocks(self, num_tokens: int, step_tokens: int | None = None) -> int:
        """The most blocks a sequence of `num_tokens` tokens holds at once (see `can_ever_fit`)."""
        need = -(-num_tokens // self.block_size)
        if self.sliding_window is not None and step_tokens is not None:
            need = min(need, -(-(self.sliding_window - 1 + step_tokens) // self.block_size) + 1)
        return need
