"""Paged attention against an obviously-right reference, and the paged model against the dense one.

The fast path is held to the reference on random batches; the reference itself is held to plain
causal attention over contiguous keys, and the whole paged model (chunked prefill, decode, scattered
and shared blocks) is held to the dense forward on the same weights.
"""

from __future__ import annotations

import random
from unittest import mock

import decoder_bound
import pytest
import torch
import torch.nn.functional as F
from float_bounds import attention_bound
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import FAMILIES, hf_model

from pagedrl.engine import attention, attention_groups
from pagedrl.engine.attention import PagedAttention
from pagedrl.engine.kv_cache import KVCache
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM

pytestmark = pytest.mark.isa  # its paths follow the CPU class: `make test-isa` runs it as each lower one

BLOCK = 4


def scattered_tables(lengths: list[int], num_blocks: int, rng: random.Random) -> list[list[int]]:
    """Block tables drawn from a shuffled free list, so no sequence's blocks are contiguous or ordered."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // BLOCK))] for n in lengths]


def run_both(cache: KVCache, seqs, q, k, v, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference and fast outputs from the same starting cache, and check both leave the same cache."""
    before = cache.data.clone()
    ref = PagedAttention.build(cache, BLOCK, seqs, impl="reference").attend(layer, q, k, v)
    after_ref = cache.data.clone()
    cache.data.copy_(before)
    fast = PagedAttention.build(cache, BLOCK, seqs, impl="fast").attend(layer, q, k, v)
    assert torch.equal(cache.data, after_ref)
    return ref, fast


def exact_attention(cache: KVCache, seqs, q: torch.Tensor, layer: int = 0, block: int = BLOCK, store: float = 0.0
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each new query's attention over its sequence's keys and values as the cache holds them after
    the step, exact, and float32's bound on any computation of it (`float_bounds.attention_bound`: a
    wrong key or a missing mask moves outputs of ~1 by 1e-1, the bound is ~1e-5)."""
    keys, values = cache.key_cache[layer].flatten(0, 1), cache.value_cache[layer].flatten(0, 1)
    heads, groups = q.shape[2], q.shape[2] // keys.shape[1]
    out, bound = torch.zeros(q.shape, dtype=torch.float64), torch.zeros(q.shape, dtype=torch.float64)
    row = 0
    for table, c, n in seqs:
        slots = torch.tensor([table[p // block] * block + p % block for p in range(c + n)])
        for t in range(n):
            seen = slots[:c + t + 1]
            for h in range(heads):
                out[0, row, h], bound[0, row, h] = attention_bound(q[0, row, h], keys[seen, h // groups],
                                                                   values[seen, h // groups], store=store)
            row += 1
    return out, bound


def assert_within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> None:
    assert ((got.double() - exact).abs() <= bound).all()


def random_qkv(n: int, heads: int, kv_heads: int, dim: int, gen: torch.Generator):
    return (torch.randn(1, n, heads, dim, generator=gen), torch.randn(1, n, kv_heads, dim, generator=gen),
            torch.randn(1, n, kv_heads, dim, generator=gen))


# (num_computed, num_new): fresh prefills (0, n), chunked prefills (c > 0, n > 1), decodes (c, 1).
seq_shapes = st.lists(
    st.one_of(
        st.tuples(st.just(0), st.integers(1, 13)),
        st.tuples(st.integers(1, 20), st.integers(2, 9)),
        st.tuples(st.integers(1, 30), st.just(1)),
    ),
    min_size=1, max_size=7,
)


@settings(max_examples=40, deadline=None)
@given(shapes=seq_shapes, heads=st.sampled_from([(4, 4), (6, 2), (9, 3), (4, 1)]), seed=st.integers(0, 2**16),
       gather_bytes=st.sampled_from([1, 3000, attention.CPU_GATHER_BYTES, None]))
def test_fast_path_equals_reference_on_mixed_batches(shapes, heads, seed, gather_bytes) -> None:
    """Across group cuts too: one sequence per group, a few, the CPU default, or (None) one group
    per kind as on a GPU."""
    if gather_bytes is None:
        patch = mock.patch.object(attention, "chunk_tokens_for", lambda cache, device: None)
    else:
        patch = mock.patch.object(attention, "CPU_GATHER_BYTES", gather_bytes)
    with patch:
        check_fast_equals_reference(shapes, heads, seed)


def check_fast_equals_reference(shapes, heads, seed) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    cache = KVCache(2, 96, BLOCK, num_kv_heads, 8)
    cache.data.normal_(generator=gen)  # stale contents everywhere: padding must be masked, not zero
    tables = scattered_tables([c + n for c, n in shapes], 96, rng)
    seqs = [(t, c, n) for t, (c, n) in zip(tables, shapes, strict=True)]
    q, k, v = random_qkv(sum(n for _, n in shapes), num_heads, num_kv_heads, 8, gen)
    ref, fast = run_both(cache, seqs, q, k, v, layer=1)
    assert ref.shape == q.shape
    exact, bound = exact_attention(cache, seqs, q, layer=1)
    assert_within(ref, exact, bound)
    assert_within(fast, exact, bound)


@pytest.mark.parametrize("shapes", [
    [(40, 1), (3, 1), (17, 1), (0, 1)],  # pure decode: the one-query path over the whole batch
    [(0, 9), (0, 9)],  # equal prefills: no padding, no scatter
    [(5, 7)],  # one chunk of a prompt with a cached prefix
    [(12, 1), (0, 6), (30, 1), (8, 3), (2, 1)],  # interleaved decodes and prefills
])
def test_fast_path_equals_reference_on_batch_layouts(shapes) -> None:
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    cache = KVCache(1, 64, BLOCK, 3, 16)
    cache.data.normal_(generator=gen)
    tables = scattered_tables([c + n for c, n in shapes], 64, rng)
    seqs = [(t, c, n) for t, (c, n) in zip(tables, shapes, strict=True)]
    q, k, v = random_qkv(sum(n for _, n in shapes), 9, 3, 16, gen)
    ref, fast = run_both(cache, seqs, q, k, v)
    exact, bound = exact_attention(cache, seqs, q)
    assert_within(ref, exact, bound)
    assert_within(fast, exact, bound)


@pytest.mark.parametrize("impl", ["reference", "fast"])
def test_fresh_prefills_equal_plain_causal_attention(impl: str) -> None:
    """The semantics, not just agreement: prompts written and attended in one step are ordinary
    causal attention (with GQA) over their own tokens."""
    rng, gen = random.Random(1), torch.Generator().manual_seed(1)
    lengths = [7, 1, 12]
    cache = KVCache(1, 32, BLOCK, 2, 8)
    seqs = [(t, 0, n) for t, n in zip(scattered_tables(lengths, 32, rng), lengths, strict=True)]
    q, k, v = random_qkv(sum(lengths), 6, 2, 8, gen)
    out = PagedAttention.build(cache, BLOCK, seqs, impl=impl).attend(0, q, k, v)
    _, bound = exact_attention(cache, seqs, q)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        qh, kh, vh = (t[:, sl].transpose(1, 2).double() for t in (q, k, v))
        kh, vh = kh.repeat_interleave(3, 1), vh.repeat_interleave(3, 1)
        expected = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2)
        assert_within(out[:, sl], expected, bound[:, sl])
        start += n


def test_groups_cover_every_row_once_and_cut_as_asked() -> None:
    q_lens = [1, 1, 1, 1, 6, 6]
    seq_lens = [40, 12, 33, 10, 6, 30]
    tables = torch.arange(6 * 10).view(6, 10)
    one_per_kind = attention.plan_groups(q_lens, seq_lens, tables, BLOCK, torch.device("cpu"), torch.float32)
    assert [(g.is_decode, g.num_seqs) for g in one_per_kind] == [(True, 4), (False, 2)]
    cut = attention.plan_groups(q_lens, seq_lens, tables, BLOCK, torch.device("cpu"), torch.float32,
                                chunk_tokens=2 * 40)
    # Decodes longest first: (40, 33) fit 2 * 40 keys, then (12, 10); the 6-token prompt and the
    # 6-token chunk over 24 cached tokens are apart, padding would be most of their work.
    assert [(g.is_decode, g.num_seqs, g.num_blocks) for g in cut] == [
        (True, 2, 10), (True, 2, 3), (False, 1, 8), (False, 1, 2)]
    rows = torch.cat([g.out_rows for g in cut])
    assert sorted(rows.tolist()) == list(range(sum(q_lens)))


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=40), block_size=st.sampled_from([1, 4, 16]),
       chunk_tokens=st.integers(1, 400))
def test_decode_cut_by_runs_equals_the_greedy_cut_one_sequence_at_a_time(lengths: list[int], block_size: int,
                                                                          chunk_tokens: int) -> None:
    """The decode groups are cut a run of equal block counts at a time, in closed form; the same cut
    one sequence at a time (longest first: start a new group when the next sequence would take the
    group past `chunk_tokens` keys, or its padding past a fifth of its work in whole blocks) is
    the reference."""
    own = sorted((-(-n // block_size) * block_size for n in lengths), reverse=True)
    expected, start, real = [], 0, 0
    for i, keys_i in enumerate(own):
        size = i - start + 1
        keys = own[start]
        if size > 1 and (size * keys > chunk_tokens or 4 * size * keys > 5 * (real + keys_i)):
            expected.append((start, i, keys // block_size))
            start, real = i, 0
        real += keys_i
    expected.append((start, len(own), own[start] // block_size))
    values, counts = torch.unique_consecutive(torch.tensor(own) // block_size, return_counts=True)
    assert attention_groups.cut_decodes(values.tolist(), counts.tolist(), block_size, chunk_tokens) == expected


def test_new_keys_and_values_land_in_their_slots() -> None:
    cache = KVCache(2, 8, BLOCK, 1, 2)
    seqs = [([5, 2], 3, 2)]  # positions 3 and 4: block 5 offset 3, block 2 offset 0
    meta = PagedAttention.build(cache, BLOCK, seqs)
    assert meta.slot_mapping.tolist() == [5 * BLOCK + 3, 2 * BLOCK + 0]
    assert meta.positions.tolist() == [3, 4]
    assert meta.query_start_loc.tolist() == [0, 2] and meta.seq_lens.tolist() == [5]
    k = torch.tensor([[[[1.0, 2.0]], [[3.0, 4.0]]]])
    meta.attend(1, torch.zeros(1, 2, 1, 2), k, -k)
    assert cache.key_cache[1][5, 3, 0].tolist() == [1.0, 2.0]
    assert cache.value_cache[1][2, 0, 0].tolist() == [-3.0, -4.0]
    assert cache.key_cache[0].abs().sum() == 0  # another layer untouched


def test_attend_works_in_and_out_of_inference_mode() -> None:
    """The engine runs under inference mode; a later plain no-grad call must not trip over
    buffers made there."""
    gen = torch.Generator().manual_seed(8)
    cache = KVCache(1, 8, BLOCK, 2, 4)
    seqs = [([1, 2], 3, 2), ([5], 0, 3)]
    q, k, v = random_qkv(5, 4, 2, 4, gen)
    with torch.inference_mode():
        first = PagedAttention.build(cache, BLOCK, seqs).attend(0, q, k, v)
    with torch.no_grad():
        second = PagedAttention.build(cache, BLOCK, seqs).attend(0, q, k, v)
    torch.testing.assert_close(first, second, atol=0, rtol=0)


def test_metadata_built_by_hand_plans_itself() -> None:
    rng, gen = random.Random(2), torch.Generator().manual_seed(2)
    cache = KVCache(1, 32, BLOCK, 2, 8)
    cache.data.normal_(generator=gen)
    shapes = [(6, 1), (0, 5), (9, 2)]
    seqs = [(t, c, n) for t, (c, n) in zip(scattered_tables([c + n for c, n in shapes], 32, rng), shapes, strict=True)]
    built = PagedAttention.build(cache, BLOCK, seqs)
    by_hand = PagedAttention(cache, built.slot_mapping, built.query_start_loc, built.seq_lens, built.block_tables)
    q, k, v = random_qkv(8, 4, 2, 8, gen)
    torch.testing.assert_close(by_hand.attend(0, q, k, v), built.attend(0, q, k, v), atol=0, rtol=0)


def test_sequences_sharing_prefix_blocks_read_the_same_keys() -> None:
    """Two decodes whose tables share their first two blocks (8 cached tokens) and hold the same
    new token in private blocks see identical keys; changing a shared block changes both."""
    gen = torch.Generator().manual_seed(3)
    cache = KVCache(1, 16, BLOCK, 2, 8)
    cache.data.normal_(generator=gen)
    seqs = [([3, 9, 4], 8, 1), ([3, 9, 11], 8, 1)]
    q1, k1, v1 = random_qkv(1, 4, 2, 8, gen)
    q, k, v = (torch.cat([t, t], dim=1) for t in (q1, k1, v1))
    for impl in ("reference", "fast"):
        out = PagedAttention.build(cache, BLOCK, seqs, impl=impl).attend(0, q, k, v)
        torch.testing.assert_close(out[:, 0], out[:, 1], atol=0, rtol=0)
    private = [([3, 9, 4], 8, 1), ([7, 9, 11], 8, 1)]  # first block no longer shared
    out = PagedAttention.build(cache, BLOCK, private).attend(0, q, k, v)
    assert (out[:, 0] - out[:, 1]).abs().max() > 1e-3


def test_build_and_attend_reject_bad_input() -> None:
    cache = KVCache(1, 8, BLOCK, 2, 4)
    with pytest.raises(ValueError, match="block_table has 1 blocks"):
        PagedAttention.build(cache, BLOCK, [([0], 3, 2)])
    with pytest.raises(ValueError, match="outside"):
        PagedAttention.build(cache, BLOCK, [([8], 0, 2)])
    with pytest.raises(ValueError, match="num_new_tokens"):
        PagedAttention.build(cache, BLOCK, [([0], 2, 0)])
    with pytest.raises(ValueError, match="block_size"):
        PagedAttention.build(cache, 8, [([0], 0, 2)])
    with pytest.raises(ValueError, match="impl"):
        PagedAttention.build(cache, BLOCK, [([0], 0, 2)], impl="flash")
    with pytest.raises(ValueError, match="same cache slot"):  # both write block 1 offset 1
        PagedAttention.build(cache, BLOCK, [([0, 1], 5, 1), ([2, 1], 5, 1)])
    meta = PagedAttention.build(cache, BLOCK, [([0], 0, 2)])
    with pytest.raises(ValueError, match="q must have shape"):
        meta.attend(0, torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, 2, 4), torch.zeros(1, 3, 2, 4))
    with pytest.raises(ValueError, match="multiple"):
        meta.attend(0, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))


# ---- the paged model against the dense model ----------------------------------------------------


def tiny_lm(family: str) -> CausalLM:
    hf = hf_model(FAMILIES[family])
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=False)
    return model.eval()


def paged_step(model: CausalLM, cache: KVCache, batch: list[tuple[list[int], list[int], int, int]],
               impl: str) -> list[torch.Tensor]:
    """One engine step: each entry is (tokens, block_table, num_computed, num_new); returns the
    last new token's logits per sequence."""
    meta = PagedAttention.build(cache, BLOCK, [(t, c, n) for _, t, c, n in batch], impl=impl)
    ids = torch.tensor([tok for tokens, _, c, n in batch for tok in tokens[c:c + n]])[None]
    hidden = model(ids, positions=meta.positions[None], meta=meta)
    return list(model.logits(hidden[0, meta.query_start_loc[1:] - 1]))


def dense_last_logits(model: CausalLM, tokens: list[int]) -> torch.Tensor:
    return model.logits(model(torch.tensor([tokens])))[0, -1]


@pytest.mark.parametrize("impl", ["reference", "fast"])
@pytest.mark.parametrize("family", ["llama-gqa-untied", "qwen3-qknorm", "llama-mha-tied-bias", "mixtral", "qwen3-moe"])
def test_chunked_prefill_and_decode_match_dense_logits(family: str, impl: str) -> None:
    """Two prompts in flight together, on different schedules: chunks of 5 then 7 then single-token
    decodes for one, a 9-token prefill then a mix for the other; blocks scattered."""
    torch.manual_seed(5)
    model = tiny_lm(family)
    cfg = model.config
    cache = KVCache(cfg.num_hidden_layers, 40, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    tokens = [torch.randint(3, cfg.vocab_size, (20,)).tolist(), torch.randint(3, cfg.vocab_size, (19,)).tolist()]
    schedules = [[5, 7, 1, 1, 1, 1, 1, 1, 1, 1], [9, 1, 1, 2, 3, 1, 1, 1]]
    tables = scattered_tables([20, 19], 40, random.Random(6))
    exact = [decoder_bound.logits(model, torch.tensor([t])) for t in tokens]  # causal: every prefix's last row
    done = [0, 0]
    with torch.no_grad():
        for step in range(max(len(s) for s in schedules)):
            active = [i for i in range(2) if step < len(schedules[i])]
            batch = [(tokens[i], tables[i], done[i], schedules[i][step]) for i in active]
            for i, logits in zip(active, paged_step(model, cache, batch, impl), strict=True):
                done[i] += schedules[i][step]
                expected = dense_last_logits(model, tokens[i][:done[i]])
                row, bound = exact[i].exact[0, done[i] - 1], exact[i].bound()[0, done[i] - 1]
                assert_within(logits, row, bound)  # the paged forward and the dense one, within float32's
                assert_within(expected, row, bound)  # bound (~1e-5; a stale or misplaced key: 1e-2)
    assert done == [20, 19]


def test_prefix_blocks_shared_after_copy_on_write_match_dense_logits() -> None:
    """A prompt of 10 tokens (2 full blocks + a partial one) is prefilled once; a second sequence
    reuses the 2 full blocks, gets a copy of the partial one, and both continue differently."""
    torch.manual_seed(7)
    model = tiny_lm("llama-gqa-untied")
    cfg = model.config
    cache = KVCache(cfg.num_hidden_layers, 16, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    prompt = torch.randint(3, cfg.vocab_size, (10,)).tolist()
    first = prompt + [11, 12, 13]
    second = prompt + [21, 22, 23, 24]
    with torch.no_grad():
        paged_step(model, cache, [(first, [6, 2, 9], 0, 10)], "fast")
        cache.copy_blocks([(9, 4)])
        batch = [(first, [6, 2, 9, 13], 10, 3), (second, [6, 2, 4, 1], 10, 4)]
        exact = [decoder_bound.logits(model, torch.tensor([t])) for t in (first, second)]
        for impl in ("reference", "fast"):
            got = paged_step(model, cache, batch, impl)
            for logits, tokens, probed in zip(got, (first, second), exact, strict=True):
                for row in (logits, dense_last_logits(model, tokens)):
                    assert_within(row, probed.exact[0, -1], probed.bound()[0, -1])
