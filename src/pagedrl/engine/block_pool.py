"""The block pool: the mechanism under the KV cache (free queue, reference counts, prefix hashes).

The pool knows nothing about requests. It hands out physical block ids, counts how many block
tables hold each block, and remembers which full blocks hold which content hash so that equal
prefixes can share one copy of their keys and values. Policy (which request gets which blocks,
when to copy on write) lives in `kv_cache_manager.py`.

A freed block keeps its hash: its keys and values stay valid until the block is reused. Free
blocks wait in an LRU queue (freed to the tail, reused from the head), so the blocks most recently
given back are the last to lose their cached content. Reusing a block from the head is what
evicts its hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple


class BlockHash(NamedTuple):
    """Content hash of a full block and all blocks before it, under one weight version.

    The version is carried beside the digest (and mixed into it), so a key computed under new
    weights can never equal a key stored under old ones, whatever the digest."""

    digest: bytes
    weight_version: int


_ROOT_DIGEST = bytes(32)


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int], weight_version: int,
                      salt: bytes = b"") -> BlockHash:
    """Chain hash of one full block: blake2b over (weight version, length, parent digest, tokens).

    Chaining makes the hash name the whole prefix, not just this block's tokens: the keys and
    values of a block depend on every token before it. A first block mixes in its sequence's `salt`
    (the LoRA adapter it runs with), so the chains of two adapters never meet."""
    if parent is not None and parent.weight_version != weight_version:
        raise ValueError(
            f"weight_version {weight_version} differs from the parent hash's version {parent.weight_version}"
        )
    h = hashlib.blake2b(digest_size=32)
    h.update(struct.pack("<qq", weight_version, len(token_ids)))
    h.update(parent.digest if parent is not None else _ROOT_DIGEST)
    if parent is None and salt:
        h.update(struct.pack("<q", len(salt)) + salt)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return BlockHash(h.digest(), weight_version)


class KVBlock:
    """Bookkeeping for one physical block; the free-queue links live here so the queue allocates
    nothing and can unlink any block in O(1)."""

    __slots__ = ("block_id", "ref_count", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_count}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order (head = next to reuse).

    A deque cannot drop a block from the middle in O(1), which a prefix hit on a free cached block
    needs; this list can, because each block carries its own links."""

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def append(self, block: KVBlock) -> None:
        """Put `block` at the tail: it will be the last to be reused."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> KVBlock:
        """Take the least recently freed block."""
        if self._len == 0:
            raise IndexError("the free queue is empty")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        """Unlink `block` wherever it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1


class BlockPool:
    """All physical blocks of one KV cache: who holds them, which are free, which hold cached content.

    Invariants: a block is in the free queue exactly when its ref count is 0; the hash map points
    a hash at a block exactly when that block's `block_hash` is that hash."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._num_cached_free = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now, including free blocks that still hold cached content."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return len(self.blocks) - len(self._free)

    @property
    def num_cached_free_blocks(self) -> int:
        """Free blocks whose content is still reachable through the hash map."""
        return self._num_cached_free

    @property
    def cached(self) -> Mapping[BlockHash, KVBlock]:
        """Read-only view of hash -> block."""
        return MappingProxyType(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free block ids in eviction order (head first)."""
        return [block.block_id for block in self._free]

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks from the head of the free queue, evicting their cached content."""
        if num_blocks < 0 or num_blocks > len(self._free):
            raise ValueError(f"num_blocks must be in [0, {len(self._free)}] (free blocks), got {num_blocks}")
        taken = []
        for _ in range(num_blocks):
            block = self._free.popleft()
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                self._num_cached_free -= 1
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one holder to each block; a free cached block leaves the free queue (a prefix hit)."""
        for block in blocks:
            if block.ref_count == 0:
                self._free.remove(block)
                if block.block_hash is not None:
                    self._num_cached_free -= 1
            block.ref_count += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one holder from each block, in eviction order: a block reaching 0 joins the tail of
        the free queue with its hash kept, so the first block given here is the first evicted."""
        blocks = list(blocks)
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"block {block.block_id} is freed more often than it was taken")
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free.append(block)
                if block.block_hash is not None:
                    self._num_cached_free += 1

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Make a full, held block findable by `block_hash`. If another block already holds that
        hash, the existing mapping wins (its holders and LRU position stay valid) and this block
        stays uncached. Returns whether `block` is now the block for `block_hash`."""
        if block.ref_count == 0:
            raise ValueError(f"block {block.block_id} is free; only a held block can be cached")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"block {block.block_id} is already cached under another hash")
            return True
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def drop_cached_hashes(self) -> None:
        """Forget every cached hash, held blocks included: after a weight update no stored key and
        value may be found again. The blocks themselves stay where they are."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        self._num_cached_free = 0


class PoolCounts:
    """The counts a KV cache manager reports from its `pool` (`/metrics`, the scheduler's fit check); the
    manager says how many blocks a sequence holds at most (`most_blocks`)."""

    pool: BlockPool

    def most_blocks(self, num_tokens: int, step_tokens: int | None = None) -> int:
        raise NotImplementedError

    @property
    def num_blocks_total(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_blocks_used(self) -> int:
        return self.pool.num_used_blocks

    @property
    def num_blocks_cached(self) -> int:
        """Free blocks whose content can still be hit under the current weights."""
        return self.pool.num_cached_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.num_used_blocks / self.pool.num_blocks

    def can_ever_fit(self, num_tokens: int, step_tokens: int | None = None) -> bool:
        """Whether a sequence of `num_tokens` tokens fits in the whole cache (else it never will). Under a
        sliding window it holds at most the window and one step's `step_tokens` (when given) at a time."""
        return self.most_blocks(num_tokens, step_tokens) <= self.pool.num_blocks
