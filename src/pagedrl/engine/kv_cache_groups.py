"""Layers in groups, each group with its own block tables over one shared pool: how a model whose layers
attend differently (Gemma 2/3, gpt-oss: sliding-window layers beside full ones) lets its sliding layers
give back the blocks that fell out of their window while its full layers keep every block.

The layout is vLLM's hybrid KV cache: the layers are cut into groups of `slots` layers that share one
rule (a window, or none), and the cache holds `slots` tensors (`KVCache` with `layer_slots`): layer j of
every group reads and writes the j-th tensor. A block id belongs to one group at a time and holds that
group's `slots` layers' keys and values for `block_size` tokens; every group's tables draw their ids from
the one `BlockPool`. Gemma 3 1B (4 full layers, 22 sliding over 512 keys) is 13 groups of 2 layers; a
sequence of n tokens holds ceil(n / 16) blocks of each full group and, in a step of decodes, at most
ceil(512 / 16) + 1 of each sliding group, each block 2 layers' keys and values where a block of one
table for every layer holds 26.

Each group is a `KVCacheManager` (its window, its tables, its prefix hashes tagged with the group so two
groups never meet in the pool); this class keeps them in step. A prefix lookup takes the hits every group
has (a sliding group needs only its window's blocks cached: `KVCacheManager.get_computed_blocks`), each
group's no longer than the others' until they agree. An allocation is all or nothing
over every group: each says what it would take, the pool is asked once, and the free hit blocks are
held before any group takes fresh ones, which could evict them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagedrl.engine.block_pool import BlockHash, BlockPool, PoolCounts
from pagedrl.engine.kv_cache import KVCache
from pagedrl.engine.kv_cache_manager import KVCacheManager
from pagedrl.engine.seq_blocks import ComputedBlocks, SeqId


@dataclass(frozen=True)
class LayerGroups:
    """Which group and which cache tensor each layer uses, and each group's window."""

    windows: tuple[int | None, ...]  # per group
    group_of_layer: tuple[int, ...]
    slot_of_layer: tuple[int, ...]
    slots: int  # layers a group holds (the cache's tensors)

    @classmethod
    def of(cls, layer_windows: Sequence[int | None]) -> LayerGroups | None:
        """The groups of a model whose layers' windows (None: every key) are not all the same; None where
        they are (one table serves every layer). A group's size is the one that leaves the fewest empty
        places in the groups (a kind's last group may be short, yet its blocks are as large as any), the
        larger of equals (fewer tables a step): Gemma 3 1B's 4 full and 22 sliding layers make 13 groups
        of 2, Gemma 2's and gpt-oss's halves 2 groups."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(layer_windows):
            kinds.setdefault(window, []).append(layer)
        if len(kinds) < 2:
            return None
        counts = [len(layers) for layers in kinds.values()]
        slots = min(range(1, min(counts) + 1), key=lambda size: (sum(-(-c // size) * size for c in counts), -size))
        windows: list[int | None] = []
        group_of_layer = [0] * len(layer_windows)
        slot_of_layer = [0] * len(layer_windows)
        for window in sorted(kinds, key=lambda w: (w is not None, w or 0)):  # the full layers' group first
            layers = kinds[window]
            for start in range(0, len(layers), slots):
                for slot, layer in enumerate(layers[start:start + slots]):
                    group_of_layer[layer], slot_of_layer[layer] = len(windows), slot
                windows.append(window)
        return cls(tuple(windows), tuple(group_of_layer), tuple(slot_of_layer), slots)


@dataclass(frozen=True)
class GroupedComputedBlocks:
    """A prefix lookup in every group, cut to the hits they all have."""

    parts: tuple[ComputedBlocks, ...]
    num_tokens: int
    num_queried_tokens: int


class GroupedKVCacheManager(PoolCounts):
    """`KVCacheManager`'s interface over groups of layers that share one pool (see the module)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, groups: LayerGroups) -> None:
        self.block_size = block_size
        self.layer_groups = groups
        self.pool = BlockPool(num_blocks)
        self.groups = [KVCacheManager(num_blocks, block_size, enable_prefix_caching, window, pool=self.pool,
                                      group_tag=b"group%d" % g) for g, window in enumerate(groups.windows)]
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def get_computed_blocks(self, token_ids: Sequence[int], block_hashes: list[BlockHash] | None = None,
                            salt: bytes = b"") -> GroupedComputedBlocks:
        """The longest prefix every group holds: each group's longest no longer than the others', until
        they agree (a sliding group's hit at k blocks says nothing of a shorter prefix's window)."""
        limit = None
        while True:
            parts = [g.get_computed_blocks(token_ids, block_hashes, salt, limit) for g in self.groups]
            hits = min(len(part.blocks) for part in parts)
            if all(len(part.blocks) == hits for part in parts):
                return GroupedComputedBlocks(tuple(parts), hits * self.block_size, parts[0].num_queried_tokens)
            limit = hits

    def allocate_slots(self, seq_id: SeqId, token_ids: Sequence[int], num_computed_tokens: int, num_new_tokens: int,
                       computed: GroupedComputedBlocks | ComputedBlocks | None = None,
                       block_hashes: list[BlockHash] | None = None, salt: bytes = b"") -> bool:
        """`KVCacheManager.allocate_slots` in every group, or in none."""
        if computed is None and all(g.in_place(seq_id, num_computed_tokens, num_new_tokens) for g in self.groups):
            for g in self.groups:  # a decode step's usual case: no group takes a block
                g.allocate_slots(seq_id, token_ids, num_computed_tokens, num_new_tokens, None, block_hashes, salt)
            return True
        if computed is None:
            parts: Sequence[ComputedBlocks | None] = [None] * len(self.groups)
        elif isinstance(computed, GroupedComputedBlocks):
            parts = computed.parts
        else:  # (a lookup skipped: no hits, one part a group)
            if computed.blocks:
                raise ValueError("computed: a lookup of one group's blocks; use this manager's get_computed_blocks")
            parts = [computed] * len(self.groups)
        for g, part in zip(self.groups, parts, strict=True):  # every group's hits still attachable, before any
            g.check_computed(seq_id, part, num_computed_tokens)
        needed = sum(g.blocks_needed(seq_id, num_computed_tokens, num_new_tokens, part)
                     for g, part in zip(self.groups, parts, strict=True))
        if needed > self.pool.num_free_blocks:
            return False
        hits = [block for g, part in zip(self.groups, parts, strict=True)
                for block in g.attached_hits(part, num_computed_tokens)]
        self.pool.touch(hits)  # held while every group allocates: no group's fresh blocks evict another's hits
        try:
            for g, part in zip(self.groups, parts, strict=True):
                if not g.allocate_slots(seq_id, token_ids, num_computed_tokens, num_new_tokens, part, block_hashes,
                                        salt):
                    raise AssertionError(f"group {g.group_tag!r} refused after the pool said it fits")
        finally:
            self.pool.free_blocks(hits)
        if computed is not None:
            self.prefix_cache_queries += computed.num_queried_tokens
            self.prefix_cache_hits += computed.num_tokens
        return True

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        for g in self.groups:
            g.fork(parent_id, child_id)

    def free(self, seq_id: SeqId) -> None:
        for g in self.groups:
            g.free(seq_id)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Every group's copies: a block id is one group's, and the copy moves every slot of it."""
        return [pair for g in self.groups for pair in g.take_pending_copies()]

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self.groups[0]

    def block_table(self, seq_id: SeqId) -> list[int]:
        """The full layers' group's table (what a picture of prefix sharing shows)."""
        return self.groups[0].block_table(seq_id)

    def num_held_blocks(self, seq_id: SeqId) -> int:
        return sum(g.num_held_blocks(seq_id) for g in self.groups)

    def block_table_rows(self, seq_ids: Sequence[SeqId], num_blocks: int) -> torch.Tensor:
        return self.groups[0].block_table_rows(seq_ids, num_blocks)

    def group_block_table_rows(self, seq_ids: Sequence[SeqId], num_blocks: int) -> list[torch.Tensor]:
        """Each group's `block_table_rows`."""
        return [g.block_table_rows(seq_ids, num_blocks) for g in self.groups]

    @property
    def weight_version(self) -> int:
        return self.groups[0].weight_version

    def bump_weight_version(self) -> int:
        return [g.bump_weight_version() for g in self.groups][0]

    def reset_prefix_cache(self) -> None:
        self.pool.drop_cached_hashes()

    def most_blocks(self, num_tokens: int, step_tokens: int | None = None) -> int:
        """The most blocks of the pool a sequence of `num_tokens` tokens holds at once, every group's."""
        return sum(g.most_blocks(num_tokens, step_tokens) for g in self.groups)


def cache_and_manager(cfg: Any, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device,
                      enable_prefix_caching: bool, groups_allowed: bool = True
                      ) -> tuple[KVCache, KVCacheManager | GroupedKVCacheManager]:
    """The engine's KV cache and its manager for a `ModelConfig`, `num_blocks` blocks of every layer's
    keys and values: one table where every layer attends alike (`groups_allowed` False: always), else
    groups of layers over the same bytes in blocks of a group's layers (more blocks, each smaller)."""
    heads, head_dim, values = cfg.kv_cache_layout  # keys and values, or latent attention's latents
    groups = LayerGroups.of(cfg.layer_windows) if groups_allowed else None
    if groups is None:
        cache = KVCache(cfg.num_hidden_layers, num_blocks, block_size, heads, head_dim, dtype, device, values)
        return cache, KVCacheManager(num_blocks, block_size, enable_prefix_caching, cfg.uniform_window)
    num_blocks = num_blocks * cfg.num_hidden_layers // groups.slots
    cache = KVCache(groups.slots, num_blocks, block_size, heads, head_dim, dtype, device, values,
                    layer_slots=groups.slot_of_layer)
    return cache, GroupedKVCacheManager(num_blocks, block_size, enable_prefix_caching, groups)


def describe(manager: KVCacheManager | GroupedKVCacheManager, block_size: int, dtype: torch.dtype) -> str:
    """The KV cache's blocks, for a start-up line: how many, in what dtype, and where layers hold their
    own tables, in what groups."""
    blocks = f"{manager.num_blocks_total} KV blocks of {block_size} tokens in {str(dtype).removeprefix('torch.')}"
    groups = getattr(manager, "layer_groups", None)
    if groups is None:
        return blocks
    sliding = [w for w in groups.windows if w is not None]
    layers = f"{groups.slots} layer{'s' if groups.slots > 1 else ''}"
    return (f"{blocks} and {layers} each, {len(groups.windows)} groups of layers with block tables of their own "
            f"({len(groups.windows) - len(sliding)} full; {len(sliding)} sliding over {max(sliding)} keys, which "
            "give back what left the window)")
