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
from hypothesis.stateful import initialize, invariant
from test_window_freeing_properties import WindowMachine

from pagedrl.engine.kv_cache_groups import GroupedKVCacheManager, LayerGroups
from pagedrl.engine.kv_cache_manager import KVCacheManager


class GroupsMachine(WindowMachine):
    """`WindowMachine`'s rules (sequences added, stepped, preempted, forked and freed) on groups; its
    forward, invariant and setup replaced by the groups' own."""

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

    @invariant()
    def ref_counts_are_the_tables_holding_each_block(self) -> None:  # (replaces WindowMachine's)
        """Each block is one group's, and its ref count the tables of that group holding it."""
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


def test_prefix_hits_below_the_window_are_neither_held_nor_counted() -> None:
    """A prompt whose first 40 tokens are cached, admitted 40 tokens in with a 16-token chunk, in a pool
    that holds its 20 blocks of the full group and its sliding group's window, but not 10 hits more: the
    sliding group's hits below the window become placeholders at once instead of being taken (and freed
    after), so the admission that fits is not refused, in groups or in one windowed table."""
    bs, window, prompt = 4, 4, list(range(40))
    for make in (lambda: GroupedKVCacheManager(26, bs, True, LayerGroups.of([None, window])),
                 lambda: KVCacheManager(12, bs, True, sliding_window=window)):
        km = make()
        done, hashes = 0, []
        while done < 40:
            assert km.allocate_slots(1, prompt, done, 8, None, hashes)
            done += 8
        km.free(1)
        longer, hashes = prompt + list(range(100, 132)), []
        computed = km.get_computed_blocks(longer, hashes)
        assert computed.num_tokens == 40
        assert km.allocate_slots(2, longer, 40, 16, computed, hashes)
        sliding = km.groups[1] if isinstance(km, GroupedKVCacheManager) else km
        assert sliding.num_held_blocks(2) <= -(-(window - 1 + 16) // bs) + 1


def test_a_sliding_group_hits_a_prefix_whose_early_blocks_were_evicted() -> None:
    """Request A (40 tokens) still runs, its sliding group's early blocks freed and then taken by another
    request: a prompt sharing A's first 36 tokens still hits all 36 (9 blocks), the sliding group's below
    its window as placeholders, its window's blocks cached; its keys then read back as A wrote them."""
    bs, window = 4, 4
    km = GroupedKVCacheManager(20, bs, True, LayerGroups.of([None, window]))
    first, done = list(range(40)), 0
    while done < 40:
        assert km.allocate_slots(1, first, done, 8, None, [])
        done += 8
    assert km.allocate_slots(9, [7] * 3, 0, 3, None, [])  # takes the blocks at the free queue's head
    second = first[:36] + [999] * 8
    computed = km.get_computed_blocks(second, [])
    assert computed.num_tokens == 36
    assert km.allocate_slots(2, second, 36, 8, computed, [])
    for g in km.groups:  # the hits the window reads are A's own blocks
        for position in range(36 - (window - 1 if g.sliding_window else 36), 36):
            assert g.slot(2, position) == g.slot(1, position)
