"""Block pool and KV cache manager: the behaviours the scheduler and the trainer rely on."""

import pytest

from pagedrl.engine import prefix_lookup
from pagedrl.engine.block_pool import BlockPool, FreeBlockQueue, KVBlock, hash_block_tokens
from pagedrl.engine.kv_cache_manager import KVCacheManager

BS = 4


def prefill(km: KVCacheManager, seq_id, tokens: list[int]) -> int:
    """First schedule of a prompt: prefix lookup, then slots for the rest. Returns the hit tokens."""
    computed = km.get_computed_blocks(tokens)
    assert km.allocate_slots(seq_id, tokens, computed.num_tokens, len(tokens) - computed.num_tokens, computed)
    return computed.num_tokens


def cached_tokens(km: KVCacheManager, tokens: list[int]) -> int:
    """Tokens of `tokens` a prefix lookup finds cached (a query: nothing is taken)."""
    return km.get_computed_blocks(tokens).num_tokens


def pool_state(km: KVCacheManager) -> tuple:
    """Everything a lookup must leave alone: ref counts, free queue, cached blocks, statistics."""
    return ([b.ref_count for b in km.pool.blocks], km.pool.free_block_ids(), dict(km.pool.cached),
            km.prefix_cache_queries, km.prefix_cache_hits)


# ------------------------------------------------------------------- free queue


def test_free_queue_is_fifo_and_removes_from_the_middle():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    q.append(blocks[2])
    assert q.popleft() is blocks[0]
    assert [b.block_id for b in q] == [1, 3, 4, 2]
    with pytest.raises(ValueError, match="already in the free queue"):
        q.append(blocks[3])
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[0])
    for _ in range(4):
        q.popleft()
    with pytest.raises(IndexError):
        q.popleft()


def test_pool_rejects_double_free_and_overdraw():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free_blocks([a])
    with pytest.raises(ValueError, match="num_blocks"):
        pool.get_new_blocks(4)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


# ------------------------------------------------------------------------ hashes


def test_chain_hash_depends_on_parent_tokens_and_version():
    root = hash_block_tokens(None, [1, 2, 3, 4], 0)
    assert root == hash_block_tokens(None, (1, 2, 3, 4), 0)
    assert root != hash_block_tokens(None, [1, 2, 3, 5], 0)
    assert root.digest != hash_block_tokens(None, [1, 2, 3, 4], 1).digest
    child = hash_block_tokens(root, [5, 6, 7, 8], 0)
    other_root = hash_block_tokens(None, [0, 2, 3, 4], 0)
    assert child != hash_block_tokens(other_root, [5, 6, 7, 8], 0)
    assert child != hash_block_tokens(None, [5, 6, 7, 8], 0)
    with pytest.raises(ValueError, match="weight_version"):
        hash_block_tokens(root, [5, 6, 7, 8], 1)


# ------------------------------------------------------------------ prefix hits


def test_shared_system_prompt_is_computed_once():
    km = KVCacheManager(num_blocks=16, block_size=BS)
    system = list(range(100, 112))  # three full blocks
    assert prefill(km, "a", system + [1, 2, 3]) == 0
    hit = prefill(km, "b", system + [7, 8])
    assert hit == 12
    assert km.block_table("b")[:3] == km.block_table("a")[:3]
    assert km.block_table("b")[3] != km.block_table("a")[3]
    assert [km.pool.blocks[b].ref_count for b in km.block_table("a")[:3]] == [2, 2, 2]
    assert km.prefix_cache_queries == 15 + 14 and km.prefix_cache_hits == 12
    # A finished prompt's blocks stay cached while free and are hit again.
    km.free("a")
    km.free("b")
    assert km.num_blocks_used == 0 and km.num_blocks_cached == 3  # partial blocks are not cached
    assert cached_tokens(km, system + [1, 2, 3, 9, 5]) == 12
    assert km.num_blocks_cached == 3 and km.num_blocks_used == 0  # the lookup took nothing
    assert prefill(km, "c", system + [1, 2, 3, 9, 5]) == 12
    assert km.num_blocks_cached == 0 and km.num_blocks_used == 5


def test_divergent_prefix_stops_the_chain():
    km = KVCacheManager(num_blocks=16, block_size=BS)
    prefill(km, "a", [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0])
    # Same second block, different first block: the chain hash must not match block 2.
    assert cached_tokens(km, [9, 1, 1, 1, 2, 2, 2, 2, 3]) == 0
    assert cached_tokens(km, [1, 1, 1, 1, 2, 2, 2, 9, 3]) == 4


def test_last_token_is_always_recomputed():
    km = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(12))  # exactly three full blocks
    prefill(km, "a", prompt)
    assert cached_tokens(km, prompt) == 8  # k full blocks -> at most k - 1 hit
    assert cached_tokens(km, prompt + [99]) == 12
    assert cached_tokens(km, prompt[:1]) == 0


def test_prefix_caching_disabled_never_hits():
    km = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    prompt = list(range(9))
    assert prefill(km, "a", prompt) == 0
    assert prefill(km, "b", prompt) == 0
    assert not set(km.block_table("a")) & set(km.block_table("b"))
    km.free("a")
    assert km.num_blocks_cached == 0 and km.prefix_cache_queries == 0


# ------------------------------------------------------- admission: a query, then an allocation


def test_lookup_is_a_pure_query():
    km = KVCacheManager(num_blocks=8, block_size=BS)
    prefill(km, "a", list(range(13)))  # blocks 0, 1, 2 full and cached, 3 partial
    km.free("a")
    prefill(km, "b", list(range(8)) + [99])  # holds 0 and 1 again; 2 stays free and cached
    before = pool_state(km)
    computed = km.get_computed_blocks(list(range(13)))
    assert computed.num_tokens == 12 and [b.block_id for b in computed.blocks] == [0, 1, 2]
    assert computed.num_queried_tokens == 13
    assert pool_state(km) == before


def test_a_refused_admission_holds_nothing_and_is_counted_once_admitted():
    km = KVCacheManager(num_blocks=4, block_size=BS)
    system = list(range(8))
    prefill(km, "a", system + [50, 51, 52, 53, 54])  # 13 tokens: the whole pool
    queries, hits = km.prefix_cache_queries, km.prefix_cache_hits
    prompt, hashes = system + [60], []
    for _ in range(3):  # "b" waits: it hits a's two system blocks but finds no block for its own
        before = pool_state(km)
        computed = km.get_computed_blocks(prompt, hashes)
        assert computed.num_tokens == 8
        assert not km.allocate_slots("b", prompt, 8, 1, computed, hashes)
        assert pool_state(km) == before
    km.free("a")
    computed = km.get_computed_blocks(prompt, hashes)
    assert km.allocate_slots("b", prompt, 8, 1, computed, hashes)
    assert km.block_table("b")[:2] == [0, 1]
    assert (km.prefix_cache_queries - queries, km.prefix_cache_hits - hits) == (9, 8)


def test_a_sequence_hashes_each_full_block_once(monkeypatch):
    calls = []
    real = prefix_lookup.hash_block_tokens
    monkeypatch.setattr(prefix_lookup, "hash_block_tokens", lambda *args: calls.append(args[1]) or real(*args))
    km = KVCacheManager(num_blocks=8, block_size=BS)
    tokens, hashes = list(range(6)), []
    for _ in range(3):  # lookups while it waits
        computed = km.get_computed_blocks(tokens, hashes)
    assert km.allocate_slots("a", tokens, 0, 6, computed, hashes)
    for t in range(6, 20):  # decodes
        tokens.append(t)
        assert km.allocate_slots("a", tokens, len(tokens) - 1, 1, block_hashes=hashes)
    assert [list(c) for c in calls] == [tokens[i : i + BS] for i in range(0, 20, BS)]
    chain, expected = None, []
    for i in range(0, 20, BS):
        chain = hash_block_tokens(chain, tokens[i : i + BS], 0)
        expected.append(chain)
    assert hashes == expected


def test_kept_hashes_start_again_after_a_weight_update():
    km = KVCacheManager(num_blocks=8, block_size=BS)
    prompt, hashes = list(range(9)), []
    prefill(km, "a", prompt)
    stale = km.get_computed_blocks(prompt, hashes)
    assert stale.num_tokens == 8 and all(h.weight_version == 0 for h in hashes)
    km.bump_weight_version()
    with pytest.raises(ValueError, match="look the prompt up again"):
        km.allocate_slots("b", prompt, 8, 1, stale, hashes)
    computed = km.get_computed_blocks(prompt, hashes)
    assert computed.num_tokens == 0  # KV of the old weights is never found
    first = hash_block_tokens(None, prompt[:4], 1)
    assert hashes == [first, hash_block_tokens(first, prompt[4:8], 1)]
    assert km.allocate_slots("b", prompt, 0, 9, computed, hashes)
    assert cached_tokens(km, prompt) == 8


# --------------------------------------------------------------------- eviction


def test_lru_eviction_takes_never_used_then_tail_blocks_before_prefix():
    km = KVCacheManager(num_blocks=6, block_size=BS)
    prefill(km, "a", list(range(12)))  # blocks 0, 1, 2 (all full, all cached)
    a = km.block_table("a")
    assert a == [0, 1, 2]
    km.free("a")
    # Never-used blocks first, then a's tail before a's prefix.
    assert km.pool.free_block_ids() == [3, 4, 5, 2, 1, 0]
    assert km.allocate_slots("x", list(range(50, 66)), 0, 16)  # four blocks: 3, 4, 5 and a's last
    assert km.block_table("x") == [3, 4, 5, 2]
    # a's first two blocks are still cached; its third was evicted with its hash.
    assert cached_tokens(km, list(range(12)) + [0]) == 8


def test_prefix_hit_on_a_free_block_takes_it_out_of_the_queue():
    km = KVCacheManager(num_blocks=4, block_size=BS)
    prefill(km, "a", list(range(9)))  # blocks 0, 1 full and cached, 2 partial
    km.free("a")
    assert km.pool.free_block_ids() == [3, 2, 1, 0]
    assert cached_tokens(km, list(range(8)) + [5]) == 8
    assert km.pool.free_block_ids() == [3, 2, 1, 0]  # looked up, not taken
    assert prefill(km, "b", list(range(8)) + [5]) == 8  # hits 0 and 1, takes 3 for the last token
    assert km.block_table("b") == [0, 1, 3]
    assert km.pool.free_block_ids() == [2]
    assert km.num_blocks_used == 3 and km.num_free_blocks == 1


# ----------------------------------------------------------------- weight version


def test_weight_version_bump_makes_lookups_miss_while_old_blocks_live():
    km = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = list(range(10))
    prefill(km, "old", prompt)
    old_table = km.block_table("old")
    assert cached_tokens(km, prompt) == 8
    assert km.bump_weight_version() == 1 and km.weight_version == 1
    assert cached_tokens(km, prompt) == 0  # the old blocks are still held by "old"
    assert km.allocate_slots("new", prompt, 0, len(prompt))
    assert not set(km.block_table("new")) & set(old_table)
    # The old sequence keeps decoding on its blocks, but nothing it computes is cached now.
    prompt_old = prompt + [10, 11, 12, 13, 14, 15]
    assert km.allocate_slots("old", prompt_old, 10, 6)
    assert all(b.weight_version == 1 for b in km.pool.cached)
    assert prefill(km, "newer", prompt_old) == 8  # blocks of "new", not of "old"
    assert km.block_table("newer")[:2] == km.block_table("new")[:2]
    km.free("old")
    assert km.num_blocks_cached == 0


def test_a_sequence_without_blocks_takes_the_version_of_its_first_block():
    km = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(9))
    computed = km.get_computed_blocks(prompt)
    assert computed.num_tokens == 0  # nothing held yet
    km.bump_weight_version()
    assert km.allocate_slots("a", prompt, 0, len(prompt), computed)  # computed under the new weights
    assert cached_tokens(km, prompt) == 8
    # A refused allocation leaves an empty table behind; it too takes the version of its first block.
    assert not km.allocate_slots("b", list(range(50, 80)), 0, 30)
    km.bump_weight_version()
    assert km.allocate_slots("b", list(range(50, 59)), 0, 9)
    assert cached_tokens(km, list(range(50, 59))) == 8


def test_reset_prefix_cache_keeps_live_tables():
    km = KVCacheManager(num_blocks=8, block_size=BS)
    prefill(km, "a", list(range(9)))
    table = km.block_table("a")
    km.reset_prefix_cache()
    assert km.block_table("a") == table and cached_tokens(km, list(range(9))) == 0


# ------------------------------------------------------------ fork, copy on write


def test_fork_then_copy_on_write_of_the_partial_block():
    km = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = list(range(6))  # one full block, one partial (2 tokens)
    prefill(km, "p", prompt)
    km.fork("p", "c")
    assert km.block_table("c") == km.block_table("p")
    full, partial = km.block_table("p")
    assert km.pool.blocks[partial].ref_count == 2

    assert km.allocate_slots("p", prompt + [40], 6, 1)
    new_partial = km.block_table("p")[1]
    assert km.take_pending_copies() == [(partial, new_partial)]
    assert km.take_pending_copies() == []
    # Now "c" holds the old partial block alone and writes into it without a copy.
    assert km.allocate_slots("c", prompt + [41], 6, 1)
    assert km.take_pending_copies() == []
    assert km.block_table("c") == [full, partial]
    assert km.block_table("p") == [full, new_partial]
    assert km.slot("p", 6) != km.slot("c", 6)
    assert km.slot("p", 0) == km.slot("c", 0)
    assert km.pool.blocks[full].ref_count == 2
    assert km.pool.blocks[partial].ref_count == 1 and km.pool.blocks[new_partial].ref_count == 1


def test_fork_at_a_block_boundary_needs_no_copy():
    km = KVCacheManager(num_blocks=8, block_size=BS)
    prefill(km, "p", list(range(8)))
    km.fork("p", "c")
    assert km.allocate_slots("p", list(range(9)), 8, 1)
    assert km.allocate_slots("c", list(range(8)) + [7], 8, 1)
    assert km.take_pending_copies() == []
    assert km.block_table("p")[:2] == km.block_table("c")[:2]
    assert km.block_table("p")[2] != km.block_table("c")[2]


# --------------------------------------------------------------- all or nothing


def test_allocation_is_all_or_nothing():
    km = KVCacheManager(num_blocks=4, block_size=BS)
    assert km.allocate_slots("a", list(range(10)), 0, 10)  # three blocks
    before = (km.block_table("a"), km.pool.free_block_ids(), km.num_blocks_used)
    assert not km.allocate_slots("b", list(range(5)), 0, 5)  # needs two, one free
    assert not km.allocate_slots("a", list(range(17)), 10, 7)  # needs two more, one free
    assert km.block_table("b") == []
    assert (km.block_table("a"), km.pool.free_block_ids(), km.num_blocks_used) == before
    assert km.allocate_slots("a", list(range(16)), 10, 6)  # exactly one more
    assert km.num_free_blocks == 0 and km.usage == 1.0


def test_copy_on_write_counts_towards_all_or_nothing():
    km = KVCacheManager(num_blocks=3, block_size=BS)
    prefill(km, "p", [1, 2, 3, 4, 5, 6])  # two blocks, one free
    km.fork("p", "c")
    # Writing 3 tokens from position 6 needs a copy of the partial block plus one new block.
    assert not km.allocate_slots("p", [1, 2, 3, 4, 5, 6, 7, 8, 9], 6, 3)
    assert km.take_pending_copies() == []
    assert km.allocate_slots("p", [1, 2, 3, 4, 5, 6, 7], 6, 1)  # just the copy
    assert len(km.take_pending_copies()) == 1


def test_free_cached_hits_count_towards_all_or_nothing():
    km = KVCacheManager(num_blocks=3, block_size=BS)
    prefill(km, "a", list(range(12)))  # three full blocks, all cached
    km.free("a")
    prompt = list(range(8)) + [60, 61, 62]  # hits two free blocks, needs one more: three of three
    computed = km.get_computed_blocks(prompt)
    assert computed.num_tokens == 8
    before = pool_state(km)
    assert not km.allocate_slots("b", prompt + [63, 64], 8, 5, computed)  # two more: four of three
    assert pool_state(km) == before
    assert km.allocate_slots("b", prompt, 8, 3, computed)
    assert km.num_free_blocks == 0


# ------------------------------------------------------------------ bad input


def test_freeing_twice_or_never_allocated_releases_nothing_more():
    km = KVCacheManager(num_blocks=4, block_size=BS)
    prefill(km, "a", list(range(6)))
    km.fork("a", "b")
    km.free("a")
    km.free("a")
    km.free("never-scheduled")
    assert [km.pool.blocks[b].ref_count for b in km.block_table("b")] == [1, 1]
    assert km.num_blocks_used == 2


def test_bad_input_names_the_parameter():
    km = KVCacheManager(num_blocks=4, block_size=BS)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)
    with pytest.raises(ValueError, match="token_ids"):
        km.get_computed_blocks([])
    with pytest.raises(ValueError, match="exceeds len"):
        km.allocate_slots("a", [1, 2], 0, 3)
    with pytest.raises(ValueError, match="num_new_tokens"):
        km.allocate_slots("a", [1, 2], 0, -1)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        km.allocate_slots("a", [1, 2, 3, 4, 5, 6], 5, 1)
    prefill(km, "a", list(range(5)))
    with pytest.raises(ValueError, match="already hashed"):
        km.allocate_slots("a", list(range(5)), 2, 3)
    with pytest.raises(ValueError, match="already holds"):
        km.allocate_slots("a", [1, 2], 0, 2, km.get_computed_blocks([1, 2]))
    with pytest.raises(ValueError, match="child_id"):
        km.fork("a", "a")
    with pytest.raises(ValueError, match="position"):
        km.slot("a", 8)
    km.free("a")
    with pytest.raises(ValueError, match="unknown sequence"):
        km.block_table("a")
    assert km.can_ever_fit(16) and not km.can_ever_fit(17)
