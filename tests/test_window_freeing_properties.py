"""The KV cache manager under a sliding window: random interleavings of prefill chunks, decodes, forks,
preemptions (free, then recompute from a prefix lookup) and frees, with blocks that fall out of the
window going back to the pool.

Beside the manager runs a shadow cache: each slot holds the token prefix a forward wrote there. A
simulated forward reads back, through the block table, every position its queries' windows cover, so a
block freed while a live window needs it (and then reused by another sequence) shows up as wrong content.
The pool's ref counts are checked against the tables that hold each block, and at the end every count is
zero and every block free.
"""

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedrl.engine.kv_cache_manager import OUT_OF_WINDOW, KVCacheManager

PROMPTS = st.builds(lambda system, tail: system + tail, st.sampled_from([[], [0, 1, 2, 0, 1, 1, 2, 0]]),
                    st.lists(st.integers(0, 2), min_size=1, max_size=14))


class WindowMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 14), block_size=st.sampled_from([1, 2, 3, 4]),
                window=st.sampled_from([1, 2, 3, 5, 8]), caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, window: int, caching: bool) -> None:
        self.km = KVCacheManager(num_blocks, block_size, caching, sliding_window=window)
        self.bs, self.window = block_size, window
        self.seqs: dict[int, dict] = {}  # id -> {"tokens", "computed", "hashes"}
        self.kv: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix written there
        self.next_id = 0

    def _pick(self, index: int) -> int:
        ids = sorted(self.seqs)
        return ids[index % len(ids)]

    def _step(self, seq_id: int, num_new: int, hits=None) -> bool:
        """allocate_slots, then (if it succeeded) the copies and the forward of positions [computed,
        computed + num_new), each reading back every earlier position of its window."""
        seq = self.seqs[seq_id]
        start = seq["computed"]
        if not self.km.allocate_slots(seq_id, seq["tokens"], start, num_new, hits, seq["hashes"]):
            return False
        table = self.km.block_table(seq_id)
        for i in range(max(0, start - self.window + 1) // self.bs, len(table)):  # the step's keys: all held
            assert self.km._seqs[seq_id].blocks[i] is not OUT_OF_WINDOW
        for src, dst in self.km.take_pending_copies():
            for off in range(self.bs):
                if src * self.bs + off in self.kv:
                    self.kv[dst * self.bs + off] = self.kv[src * self.bs + off]
        for pos in range(start, start + num_new):
            for key in range(max(0, pos - self.window + 1), pos):
                assert self.kv.get(self.km.slot(seq_id, key)) == tuple(seq["tokens"][:key + 1]), (
                    f"seq {seq_id} at {pos} lost the key at {key}: a block its window needs was freed")
            self.kv[self.km.slot(seq_id, pos)] = tuple(seq["tokens"][:pos + 1])
        seq["computed"] = start + num_new
        return True

    def _admit(self, seq_id: int, chunk: int) -> None:
        """A prefix lookup and the first chunk; a refused admission leaves nothing behind."""
        seq = self.seqs[seq_id]
        computed = self.km.get_computed_blocks(seq["tokens"], seq["hashes"])
        seq["computed"] = computed.num_tokens
        if not self._step(seq_id, min(chunk, len(seq["tokens"]) - computed.num_tokens), computed):
            self.km.free(seq_id)
            del self.seqs[seq_id]

    @rule(prompt=PROMPTS, chunk=st.integers(1, 6))
    def add_sequence(self, prompt: list[int], chunk: int) -> None:
        self.seqs[self.next_id] = {"tokens": list(prompt), "computed": 0, "hashes": []}
        self.next_id += 1
        self._admit(self.next_id - 1, chunk)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 6), token=st.integers(0, 2))
    def step(self, index: int, chunk: int, token: int) -> None:
        """A prefill chunk, or a decode (one sampled token appended) once the prompt is computed; when the
        pool cannot give the blocks, the sequence is preempted and recomputed later, as the scheduler does."""
        seq_id = self._pick(index)
        seq = self.seqs[seq_id]
        if seq["computed"] == len(seq["tokens"]):
            seq["tokens"].append(token)
        if not self._step(seq_id, min(chunk, len(seq["tokens"]) - seq["computed"])):
            self.preempt(index, chunk)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 6))
    def preempt(self, index: int, chunk: int) -> None:
        seq_id = self._pick(index)
        self.km.free(seq_id)
        self.seqs[seq_id]["computed"] = 0
        self._admit(seq_id, chunk)

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100))
    def fork(self, index: int) -> None:
        parent = self._pick(index)
        self.km.fork(parent, self.next_id)
        self.seqs[self.next_id] = {**self.seqs[parent], "tokens": list(self.seqs[parent]["tokens"]),
                                   "hashes": list(self.seqs[parent]["hashes"])}
        self.next_id += 1

    @precondition(lambda self: self.seqs)
    @rule(index=st.integers(0, 100))
    def free(self, index: int) -> None:
        seq_id = self._pick(index)
        self.km.free(seq_id)
        del self.seqs[seq_id]

    @invariant()
    def ref_counts_are_the_tables_holding_each_block(self) -> None:
        holders = Counter(b.block_id for s in self.seqs for b in self.km._seqs[s].held())
        pool = self.km.pool
        assert {b.block_id: b.ref_count for b in pool.blocks if b.ref_count} == dict(holders)
        assert sorted(pool.free_block_ids()) == sorted(b.block_id for b in pool.blocks if b.ref_count == 0)
        for s, seq in self.seqs.items():  # bounded: the window and the last step's chunk (6) at most
            assert self.km.num_held_blocks(s) <= -(-(self.window - 1 + 6) // self.bs) + 1
            assert self.km.num_held_blocks(s) <= -(-seq["computed"] // self.bs) + 1

    def teardown(self) -> None:
        if hasattr(self, "km"):
            for seq_id in list(self.seqs):
                self.km.free(seq_id)
            assert all(b.ref_count == 0 for b in self.km.pool.blocks)
            assert self.km.num_free_blocks == self.km.num_blocks_total


WindowMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_window_freeing = WindowMachine.TestCase
