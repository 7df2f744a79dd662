"""Layers in groups over one pool (`engine/kv_cache_groups.py`): random interleavings of prefill chunks,
decodes, forks, preemptions (free, then recompute from a prefix lookup) and frees, on a full layers'
group beside one or two sliding ones.

Beside the manager runs a shadow cache, per group: each slot holds the token prefix a forward of that
group's layers wrote there. A simulated forward reads back, through each group's table, every position
its queries see (every earlier one in the full group, the window in a sliding one), so a block freed while
a window needs it, a block two groups hold at once, or a prefix hit on another group's block shows up as
wrong content. The pool's ref counts are checked against every group's tables, and at the end every block
is free.
"""

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedrl.engine.kv_cache_groups import GroupedKVCacheManager, LayerGroups

PROMPTS = st.builds(lambda system, tail: system + tail, st.sampled_from([[], [0, 1, 2, 0, 1, 1, 2, 0]]),
                    st.lists(st.integers(0, 2), min_size=1, max_size=14))


class GroupsMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(6, 30), block_size=st.sampled_from([1, 2, 3, 4]),
                window=st.sampled_from([1, 2, 3, 5, 8]), sliding_groups=st.integers(1, 2), caching=st.booleans())
    def setup(self, num_blocks: int, block_size: int, window: int, sliding_groups: int, caching: bool) -> None:
        groups = LayerGroups.of([None] + [window] * sliding_groups)
        assert groups is not None and groups.windows == (None,) + (window,) * sliding_groups
        self.km = GroupedKVCacheManager(num_blocks, block_size, caching, groups)
        self.bs, self.window = block_size, window
        self.seqs: dict[int, dict] = {}  # id -> {"tokens", "computed", "hashes"}
        self.kv: dict[int, tuple[int, tuple[int, ...]]] = {}  # slot -> (group, the token prefix written there)
        self.next_id = 0

    def _pick(self, index: int) -> int:
        ids = sorted(self.seqs)
        return ids[index % len(ids)]

    def _step(self, seq_id: int, num_new: int, hits=None) -> bool:
        seq = self.seqs[seq_id]
        start = seq["computed"]
        if not self.km.allocate_slots(seq_id, seq["tokens"], start, num_new, hits, seq["hashes"]):
            return False
        for src, dst in self.km.take_pending_copies():
            for off in range(self.bs):
                if src * self.bs + off in self.kv:
                    self.kv[dst * self.bs + off] = self.kv[src * self.bs + off]
        for g, group in enumerate(self.km.groups):
            window = group.sliding_window
            for pos in range(start, start + num_new):
                for key in range(0 if window is None else max(0, pos - window + 1), pos):
                    assert self.kv.get(group.slot(seq_id, key)) == (g, tuple(seq["tokens"][:key + 1])), (
                        f"seq {seq_id} in group {g} at {pos} lost the key at {key}")
                self.kv[group.slot(seq_id, pos)] = (g, tuple(seq["tokens"][:pos + 1]))
        seq["computed"] = start + num_new
        return True

    def _admit(self, seq_id: int, chunk: int) -> None:
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
        seq_id = self._pick(index)
        seq = self.seqs[seq_id]
        if seq["computed"] == len(seq["tokens"]):
            seq["tokens"].append(token)
        before = self.km.num_blocks_used
        if not self._step(seq_id, min(chunk, len(seq["tokens"]) - seq["computed"])):
            assert self.km.num_blocks_used <= before  # a refusal takes nothing (it may free below the window)
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
    def each_block_is_one_groups_and_counted_once_a_holder(self) -> None:
        holders: Counter[int] = Counter()
        owner: dict[int, int] = {}
        for g, group in enumerate(self.km.groups):
            for s in self.seqs:
                for block in group._seqs[s].held():
                    holders[block.block_id] += 1
                    assert owner.setdefault(block.block_id, g) == g, f"block {block.block_id} in two groups"
        pool = self.km.pool
        assert {b.block_id: b.ref_count for b in pool.blocks if b.ref_count} == dict(holders)
        for s, seq in self.seqs.items():  # a sliding group: the window and the last step's chunk (6) at most
            for group in self.km.groups[1:]:
                assert group.num_held_blocks(s) <= -(-(self.window - 1 + 6) // self.bs) + 1
            assert self.km.groups[0].num_held_blocks(s) == -(-seq["computed"] // self.bs)

    def teardown(self) -> None:
        if hasattr(self, "km"):
            for seq_id in list(self.seqs):
                self.km.free(seq_id)
            assert all(b.ref_count == 0 for b in self.km.pool.blocks)
            assert self.km.num_free_blocks == self.km.num_blocks_total


GroupsMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
test_groups_share_the_pool = GroupsMachine.TestCase


def test_layers_go_in_groups_of_the_fewest_kind() -> None:
    """Gemma 2 and gpt-oss alternate (two groups, the full layers' first); Gemma 3's five sliding layers a
    full one make groups of its full layers' count, the last sliding group short; one kind is no groups."""
    assert LayerGroups.of([None, 8, None, 8]) == LayerGroups((None, 8), (0, 1, 0, 1), (0, 0, 1, 1), 2)
    gemma3 = [8] * 5 + [None] + [8] * 5 + [None] + [8, 8]
    layout = LayerGroups.of(gemma3)
    assert layout is not None and layout.slots == 2 and layout.windows == (None,) + (8,) * 6
    assert layout.group_of_layer[5] == layout.group_of_layer[11] == 0
    pairs = list(zip(layout.group_of_layer, layout.slot_of_layer, strict=True))
    assert len(set(pairs)) == len(gemma3)  # no two layers share a group's tensor
    assert all(gemma3[layer] == layout.windows[g] for layer, g in enumerate(layout.group_of_layer))
    assert LayerGroups.of([None] * 4) is None and LayerGroups.of([8] * 4) is None
