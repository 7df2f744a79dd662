"""Random interleavings of prefill, decode, fork, free and weight updates on a small KV cache.

Beside the manager runs a shadow KV cache: every physical slot holds what a forward would have
written there, modelled as (the token prefix it encodes, the weight versions that went into it).
Each simulated forward reads the previous position back through the block table, so a block
shared when it should not be, a missing copy-on-write or a stale prefix hit shows up as wrong
content, not only as broken bookkeeping.
"""

from collections import Counter

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedrl.engine.block_pool import hash_block_tokens
from pagedrl.engine.block_table import BlockTable
from pagedrl.engine.kv_cache_manager import KVCacheManager

ALPHABET = st.integers(0, 2)
# Prompts are a shared "system prompt" (or none) and a short random tail, so prefixes collide often.
SYSTEM_PROMPTS = ([], [0, 1, 2, 0], [0, 1, 2, 0, 1, 1], [2, 2, 2, 2, 2, 2, 2])
PROMPTS = st.builds(
    lambda system, tail: system + tail,
    st.sampled_from(SYSTEM_PROMPTS),
    st.lists(ALPHABET, min_size=1, max_size=5),
)
EMPTY_KV: tuple[tuple[int, ...], frozenset[int]] = ((), frozenset())


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(4, 16),
        block_size=st.sampled_from([1, 2, 3, 4]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.km = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.km.table = BlockTable(num_rows=1, num_cols=1)  # start tiny, so rows and columns grow all the time
        self.bs = block_size
        self.version = 0
        self.seqs: dict[int, dict] = {}  # id -> {"tokens": list[int], "computed": int, "hashes": list}
        self.freed: list[int] = []
        self.next_id = 0
        self.kv: dict[int, tuple[tuple[int, ...], frozenset[int]]] = {}  # slot -> shadow content
        self.queries = self.hits = 0

    # ------------------------------------------------------------- helpers

    def _pool_state(self) -> tuple:
        pool = self.km.pool
        return ([b.ref_count for b in pool.blocks], pool.free_block_ids(), dict(pool.cached),
                self.km.prefix_cache_queries, self.km.prefix_cache_hits)

    def _pick(self, index: int) -> int:
        ids = sorted(self.seqs)
        return ids[index % len(ids)]

    def _forward(self, seq_id: int, start: int, stop: int) -> None:
        """Write positions [start, stop) of a sequence, reading each previous position back."""
        tokens = self.seqs[seq_id]["tokens"]
        for pos in range(start, stop):
            prev = self.kv.get(self.km.slot(seq_id, pos - 1)) if pos > 0 else EMPTY_KV
            assert prev is not None and prev[0] == tuple(tokens[:pos]), (
                f"seq {seq_id} lost its KV at {pos - 1}"
            )
            self.kv[self.km.slot(seq_id, pos)] = (tuple(tokens[: pos + 1]), prev[1] | {self.version})

    def _allocate(self, seq_id: int, num_new: int, hits=None) -> bool:
        """allocate_slots (attaching a prefix lookup's `hits` first, if given), checking the
        all-or-nothing contract against an independent count."""
        seq = self.seqs[seq_id]
        computed = seq["computed"]
        table = self.km.block_table(seq_id) if seq_id in self.km else []
        hit_blocks = [] if hits is None else hits.blocks
        required = -(-(computed + num_new) // self.bs)
        first = computed // self.bs
        shared = sum(
            1 for i in range(first, min(required, len(table))) if self.km.pool.blocks[table[i]].ref_count > 1
        )
        needed = shared + max(0, required - len(table) - len(hit_blocks))
        needed += sum(1 for block in hit_blocks if block.ref_count == 0)  # free cached blocks hit
        free_before = self.km.pool.free_block_ids()
        ok = self.km.allocate_slots(seq_id, seq["tokens"], computed, num_new, hits, seq["hashes"])
        assert ok == (needed <= len(free_before))
        event("allocation refused" if not ok else "copy on write" if shared else "allocated")
        if not ok:
            assert self.km.block_table(seq_id) == table
            assert self.km.pool.free_block_ids() == free_before
        return ok

    def _run(self, batch: list[tuple[int, int]]) -> None:
        """One step: every slot about to be written is held by one sequence alone and by no other
        writer; then the queued copies run in order, then the forward."""
        writes: dict[int, int] = {}
        for seq_id, num_new in batch:
            computed = self.seqs[seq_id]["computed"]
            table = self.km.block_table(seq_id)
            for pos in range(computed, computed + num_new):
                assert self.km.pool.blocks[table[pos // self.bs]].ref_count == 1
                slot = self.km.slot(seq_id, pos)
                assert slot not in writes, f"seqs {writes.get(slot)} and {seq_id} both write slot {slot}"
                writes[slot] = seq_id
        for src, dst in self.km.take_pending_copies():
            for off in range(self.bs):
                s, d = src * self.bs + off, dst * self.bs + off
                if s in self.kv:
                    self.kv[d] = self.kv[s]
                else:
                    self.kv.pop(d, None)
        for seq_id, num_new in batch:
            seq = self.seqs[seq_id]
            self._forward(seq_id, seq["computed"], seq["computed"] + num_new)
            seq["computed"] += num_new

    def _schedule(self, seq_id: int, num_new: int, hits=None) -> bool:
        ok = self._allocate(seq_id, num_new, hits)
        if ok:
            self._run([(seq_id, num_new)])
        return ok

    # --------------------------------------------------------------- rules

    @rule(prompt=PROMPTS, chunk=st.integers(1, 12))
    def add_sequence(self, prompt: list[int], chunk: int) -> None:
        seq_id = self.next_id
        self.next_id += 1
        hashes: list = []
        before = self._pool_state()
        computed = self.km.get_computed_blocks(prompt, hashes)
        assert self._pool_state() == before  # a lookup is a query: nothing taken, nothing counted
        hit = computed.num_tokens
        assert hit % self.bs == 0 and hit <= (len(prompt) - 1) // self.bs * self.bs
        assert hit == len(computed.blocks) * self.bs
        event("prefix hit" if hit else "prefix miss")
        if not self.km.enable_prefix_caching:
            assert hit == 0
        # A hit is only as good as the KV behind it: this prompt's prefix, under the current weights.
        for pos in range(hit):
            slot = computed.blocks[pos // self.bs].block_id * self.bs + pos % self.bs
            assert self.kv.get(slot) == (tuple(prompt[: pos + 1]), frozenset({self.version}))
        self.seqs[seq_id] = {"tokens": list(prompt), "computed": hit, "hashes": hashes}
        if self._schedule(seq_id, min(chunk, len(prompt) - hit), computed):
            if self.km.enable_prefix_caching:  # counted once, when admitted
                self.queries += len(prompt)
                self.hits += hit
        else:
            self.km.free(seq_id)  # drops the empty table a refused allocation leaves
            del self.seqs[seq_id]

    @precondition(lambda self: any(s["computed"] < len(s["tokens"]) for s in self.seqs.values()))
    @rule(index=st.integers(0, 50), chunk=st.integers(1, 8))
    def continue_prefill(self, index: int, chunk: int) -> None:
        pending = sorted(i for i, s in self.seqs.items() if s["computed"] < len(s["tokens"]))
        seq_id = pending[index % len(pending)]
        seq = self.seqs[seq_id]
        self._schedule(seq_id, min(chunk, len(seq["tokens"]) - seq["computed"]))

    @precondition(lambda self: any(s["computed"] == len(s["tokens"]) for s in self.seqs.values()))
    @rule(index=st.integers(0, 50), token=ALPHABET)
    def decode(self, index: int, token: int) -> None:
        done = sorted(i for i, s in self.seqs.items() if s["computed"] == len(s["tokens"]))
        seq_id = done[index % len(done)]
        self.seqs[seq_id]["tokens"].append(token)
        if not self._schedule(seq_id, 1):
            self.seqs[seq_id]["tokens"].pop()

    @precondition(lambda self: any(s["computed"] == len(s["tokens"]) for s in self.seqs.values()))
    @rule(tokens=st.lists(ALPHABET, min_size=1, max_size=6))
    def decode_batch(self, tokens: list[int]) -> None:
        """Several sequences in one step: all allocations first, then copies, then one forward."""
        done = sorted(i for i, s in self.seqs.items() if s["computed"] == len(s["tokens"]))
        batch = []
        for seq_id, token in zip(done, tokens, strict=False):
            self.seqs[seq_id]["tokens"].append(token)
            if self._allocate(seq_id, 1):
                batch.append((seq_id, 1))
            else:
                self.seqs[seq_id]["tokens"].pop()
        self._run(batch)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 50))
    def fork(self, index: int) -> None:
        parent = self._pick(index)
        child = self.next_id
        self.next_id += 1
        self.km.fork(parent, child)
        self.seqs[child] = {
            "tokens": list(self.seqs[parent]["tokens"]),
            "computed": self.seqs[parent]["computed"],
            "hashes": list(self.seqs[parent]["hashes"]),
        }

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 50))
    def free(self, index: int) -> None:
        seq_id = self._pick(index)
        self.km.free(seq_id)
        del self.seqs[seq_id]
        self.freed.append(seq_id)

    @precondition(lambda self: self.freed)
    @rule(index=st.integers(0, 50))
    def freeing_twice_releases_nothing(self, index: int) -> None:
        before = [(b.block_id, b.ref_count) for b in self.km.pool.blocks], self.km.pool.free_block_ids()
        self.km.free(self.freed[index % len(self.freed)])
        assert (
            [(b.block_id, b.ref_count) for b in self.km.pool.blocks],
            self.km.pool.free_block_ids(),
        ) == before

    @rule()
    def bump_weight_version(self) -> None:
        event("weight update with live blocks" if self.km.num_blocks_used else "weight update, cache idle")
        self.version = self.km.bump_weight_version()

    # ---------------------------------------------------------- invariants

    @invariant()
    def no_block_leaks(self) -> None:
        pool = self.km.pool
        free = pool.free_block_ids()
        assert len(free) == len(set(free)) == self.km.num_free_blocks
        held = {b.block_id for b in pool.blocks if b.ref_count > 0}
        assert not held & set(free)
        assert len(held) + len(free) == self.km.num_blocks_total
        assert self.km.num_blocks_used == len(held)
        assert self.km.usage == len(held) / self.km.num_blocks_total
        assert all(b.ref_count >= 0 for b in pool.blocks)

    @invariant()
    def ref_counts_match_live_tables(self) -> None:
        holders: Counter[int] = Counter()
        for seq_id in self.seqs:
            table = self.km.block_table(seq_id)
            assert len(table) == len(set(table))
            holders.update(table)
        for block in self.km.pool.blocks:
            assert block.ref_count == holders[block.block_id], block

    @invariant()
    def persistent_rows_equal_the_tables(self) -> None:
        """The runner reads block tables from the persistent rows: each live sequence's row holds its
        table, zero-padded, and no two live sequences share a row."""
        live = [s for s in self.seqs if s in self.km]
        if not live:
            assert self.km.table.num_live_rows == 0
            return
        tables = [self.km.block_table(s) for s in live]
        width = max(len(t) for t in tables) + 1
        rows = self.km.block_table_rows(live, width).tolist()
        assert rows == [t + [0] * (width - len(t)) for t in tables]
        assert self.km.table.num_live_rows == len(live)

    @invariant()
    def cache_map_is_consistent_and_current(self) -> None:
        pool = self.km.pool
        for block_hash, block in pool.cached.items():
            assert block.block_hash == block_hash
            assert block_hash.weight_version == self.version
            # The slots hold exactly the prefix the hash names, computed under the current weights.
            last = self.kv[block.block_id * self.bs + self.bs - 1]
            prefix = last[0]
            assert last[1] == frozenset({self.version}) and len(prefix) % self.bs == 0
            for off in range(self.bs):
                assert self.kv[block.block_id * self.bs + off][0] == prefix[: len(prefix) - self.bs + off + 1]
            chain = None
            for i in range(0, len(prefix), self.bs):
                chain = hash_block_tokens(chain, prefix[i : i + self.bs], self.version)
            assert chain == block_hash
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(pool.cached)
        cached_free = sum(1 for b in hashed if b.ref_count == 0)
        assert self.km.num_blocks_cached == cached_free
        if not self.km.enable_prefix_caching:
            assert not hashed

    @invariant()
    def prefix_stats_add_up(self) -> None:
        assert (self.km.prefix_cache_queries, self.km.prefix_cache_hits) == (self.queries, self.hits)

    @invariant()
    def kept_hashes_name_the_sequences_own_blocks(self) -> None:
        """A sequence's kept chain hashes are those of its own tokens, under one weight version."""
        for seq in self.seqs.values():
            hashes = seq["hashes"]
            assert len(hashes) <= len(seq["tokens"]) // self.bs
            chain = None
            for i, block_hash in enumerate(hashes):
                chain = hash_block_tokens(chain, seq["tokens"][i * self.bs : (i + 1) * self.bs],
                                          hashes[0].weight_version)
                assert block_hash == chain

    @invariant()
    def every_sequence_reads_back_its_own_kv(self) -> None:
        """No write, copy or eviction has touched a slot that a live sequence has computed."""
        for seq_id, seq in self.seqs.items():
            for pos in range(seq["computed"]):
                assert self.kv[self.km.slot(seq_id, pos)][0] == tuple(seq["tokens"][: pos + 1])


KVCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_kv_cache_manager_state_machine = KVCacheMachine.TestCase
