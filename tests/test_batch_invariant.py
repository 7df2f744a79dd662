"""Batch-invariant computation (`model/batch_invariant.py`): a row's matmul and a query's attention
give the same bits whatever else is in the batch, they compute what the plain paths compute, and
their gradients are the plain paths' gradients. The end-to-end pin (a bf16 GRPO rollout's sampled
log-probs equal to the trainer's recompute) is in test_grpo.py."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from cpu_class import needs
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import FAMILIES

from pagedrl.engine.attention import PagedAttention
from pagedrl.engine.kv_cache import KVCache
from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.kernels import ops, products
from pagedrl.model import batch_invariant
from pagedrl.model.attention import DenseAttention
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM
from pagedrl.model.rope import rope_cos_sin, rope_inv_freq
from pagedrl.train.rl.online import choose_batch_invariance

pytestmark = pytest.mark.isa  # its paths follow the CPU class: `make test-isa` runs it as each lower one


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(0, 5000), safe=st.sampled_from([(), (1024, 768), (512, 384, 256)]))
def test_row_splits_cover_the_rows_with_safe_calls(rows, safe) -> None:
    sizes = batch_invariant.row_splits(rows, safe)
    assert sum(sizes) == rows
    assert all(s in safe or 0 < s <= batch_invariant.SMALL_ROWS for s in sizes)
    assert all(s >= batch_invariant.SMALL_ROWS for s in sizes[:-1])  # only the last call is short (padded)


SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # SmolLM2-135M's projections


def operands(shape: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1200, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    b = torch.randn(out_features, generator=gen)
    return x, w, b


@pytest.mark.parametrize("packed", [False, True])
@settings(max_examples=15, deadline=None)
@given(shape=st.sampled_from(SHAPES), rows=st.integers(1, 1100), offset=st.integers(0, 100),
       under_autocast=st.booleans(), amx=st.booleans(), seed=st.integers(0, 2**16))
def test_a_rows_product_does_not_depend_on_the_batch(packed, shape, rows, offset, under_autocast, amx, seed) -> None:
    """bf16 (or float32 masters under bf16 autocast, as a trainer runs): any slice of rows gets the
    bits those rows get in 32-row calls, here 48- or 300-row products get other bits for some rows.
    Both ways: the engine's AMX kernel in one call (where the CPU has AMX), and oneDNN cut into
    calls (`amx` False: as on a CPU without it), on a packed copy of a bf16 weight (`packed`, where
    oneDNN can pack bf16 and the probe finds it computes as the plain calls do) or not."""
    if packed:
        needs("avx512", "oneDNN's packed bf16 weights")
    x, w, _ = operands(shape, seed)
    if not under_autocast:
        x, w = x.bfloat16(), w.bfloat16()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
        reference = torch.cat([F.linear(x[i:i + 32], w) for i in range(0, x.shape[0], 32)])
        with batch_invariant.scope(), mock.patch.object(ops, "decode_linear_amx",
                                                        ops.decode_linear_amx if amx else lambda: False), \
                mock.patch.object(products, "packs_weights", lambda: packed):
            part = F.linear(x[offset:offset + rows], w)
            layer = torch.nn.Linear(shape[1], shape[0], bias=False)
            layer.weight.data = w
            through_module = layer(x[offset:offset + rows])
    assert part.dtype == torch.bfloat16
    assert torch.equal(part, reference[offset:offset + rows])
    assert torch.equal(through_module, part)


@pytest.mark.parametrize("broadcast", [True, False])
def test_addmm_rows_do_not_depend_on_the_batch(broadcast) -> None:
    """`torch.addmm` (what a LoRA adapter adds to its base projection) row by row alike."""
    x, w, b = (t.bfloat16() for t in operands((576, 576), 1))
    added = b if broadcast else torch.randn(x.shape[0], 576).bfloat16()
    reference = torch.cat([torch.addmm(added if broadcast else added[i:i + 32], x[i:i + 32], w.t())
                           for i in range(0, x.shape[0], 32)])
    with batch_invariant.scope():
        for first, rows in ((0, 1200), (7, 45), (300, 700), (1199, 1)):
            part = torch.addmm(added if broadcast else added[first:first + rows], x[first:first + rows], w.t())
            assert torch.equal(part, reference[first:first + rows])


def test_a_positions_rotary_table_does_not_depend_on_the_batch() -> None:
    """Each position's cos and sin are the float32 roundings of the exact values at its float32
    angle (Python's float64 math as the reference), computed for 4096 positions at once or for a
    decode step's few: float32's own cos took other bits on a vector math library's threads
    (13.7 k of these 262 k values, and a bf16 rollout off the trainer's by 3e-2 in some processes)."""
    import math

    inv_freq = rope_inv_freq(64, 100000.0, None)
    positions = torch.arange(4096)
    cos, sin = rope_cos_sin(positions, inv_freq, torch.float32)
    angles = (positions.float().unsqueeze(-1) * inv_freq).tolist()
    half = inv_freq.shape[0]
    assert cos[:, :half].tolist() == torch.tensor([[math.cos(a) for a in row] for row in angles]).tolist()
    assert sin[:, :half].tolist() == torch.tensor([[math.sin(a) for a in row] for row in angles]).tolist()
    assert torch.equal(cos[:, half:], cos[:, :half]) and torch.equal(sin[:, half:], sin[:, :half])
    for few in ([0], [7, 300, 4095], list(range(1000, 1064))):
        c, s = rope_cos_sin(torch.tensor(few), inv_freq, torch.float32)
        assert torch.equal(c, cos[few]) and torch.equal(s, sin[few])


def test_the_mode_is_scoped_and_not_nested() -> None:
    assert not batch_invariant.active()
    with batch_invariant.scope():
        assert batch_invariant.active()
        with batch_invariant.scope():
            assert batch_invariant.active()
        assert batch_invariant.active()
    with batch_invariant.scope(False):
        assert not batch_invariant.active()
    assert not batch_invariant.active()


def masks(kind: str, batch: int, seq_len: int) -> tuple[DenseAttention, torch.Tensor]:
    """The attention of a kind of batch, and its real query rows [B, T] (a padding row's output is
    ignored)."""
    real = torch.ones(batch, seq_len, dtype=torch.long)
    if kind == "causal":
        return DenseAttention(None), real
    if kind == "padded":
        real[0, :5] = 0  # left padding
        real[-1, -3:] = 0  # right padding
        return DenseAttention.causal(real), real
    # packed: a prompt and three completions that each see it, not each other
    seg = torch.tensor([0] * 9 + [1] * 10 + [2] * (seq_len - 29) + [3] * 10)
    return DenseAttention.segments(seg[None].expand(batch, seq_len), torch.tensor([-1, 0, 0, 0])), real


@pytest.mark.parametrize("kind", ["causal", "padded", "packed"])
@pytest.mark.parametrize("heads,head_dim", [((6, 2), 64), ((4, 4), 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_attention_computes_what_sdpa_computes(kind, heads, head_dim, dtype) -> None:
    """Forward and gradients against torch's attention over the same mask (the training path):
    float32 to float32 rounding, bf16 within bf16's."""
    B, T = 2, 41
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, T, heads[0], head_dim, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(B, T, heads[1], head_dim, generator=gen).to(dtype).requires_grad_()
    v = torch.randn(B, T, heads[1], head_dim, generator=gen).to(dtype).requires_grad_()
    meta, real = masks(kind, B, T)
    grad = torch.randn(B, T, heads[0], head_dim, generator=gen).to(dtype)
    expected = meta.attend(0, q, k, v)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    with batch_invariant.scope():
        got = meta.attend(0, q, k, v)
    assert meta.key_tables is not None  # the row kernel ran
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    real = real.bool()[..., None, None]
    torch.testing.assert_close(got.float() * real, expected.float() * real, **tol)
    for g, e in zip(got_grads, expected_grads, strict=True):
        torch.testing.assert_close(g.float(), e.float(), **tol)


def test_a_queries_attention_does_not_depend_on_the_batch() -> None:
    """bf16: a sequence attended alone and packed after others (at other rows, beside other
    segments) gets the same bits."""
    gen = torch.Generator().manual_seed(2)
    alone = [torch.randn(1, 23, h, 64, generator=gen).bfloat16() for h in (6, 2, 2)]
    other = [torch.randn(1, 30, h, 64, generator=gen).bfloat16() for h in (6, 2, 2)]
    packed = [torch.cat([o, a], 1) for o, a in zip(other, alone, strict=True)]
    seg = torch.tensor([[0] * 30 + [1] * 23])
    with batch_invariant.scope():
        single = DenseAttention(None).attend(0, *alone)
        both = DenseAttention.segments(seg).attend(0, *packed)
    assert torch.equal(both[:, 30:], single)


def paged_step(cache: KVCache, table: list[int], computed: int, new: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
    meta = PagedAttention.build(cache, cache.block_size, [(table, computed, new.shape[1])])
    return meta.attend(0, new, k, v)


@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_the_engine_computes_a_tokens_attention_as_the_trainer_does(block_size) -> None:
    """A sequence fed to the paged cache as a chunked prefill and then one decode at a time, its
    blocks scattered: each token's output equals, bit for bit, what the trainer's dense forward over
    the whole sequence computes for it (bf16, grouped-query heads)."""
    gen = torch.Generator().manual_seed(block_size)
    T = 53
    q = torch.randn(1, T, 6, 64, generator=gen).bfloat16()
    k = torch.randn(1, T, 2, 64, generator=gen).bfloat16()
    v = torch.randn(1, T, 2, 64, generator=gen).bfloat16()
    with batch_invariant.scope():
        dense = DenseAttention(None).attend(0, q, k, v)
        cache = KVCache(1, 40, block_size, 2, 64, dtype=torch.bfloat16)
        table = random.Random(0).sample(range(40), -(-T // block_size))
        outs, done = [], 0
        for n in [13, 20] + [1] * (T - 33):  # two prefill chunks, then decodes
            outs.append(paged_step(cache, table, done, q[:, done:done + n], k[:, done:done + n], v[:, done:done + n]))
            done += n
    assert torch.equal(torch.cat(outs, 1), dense)


def test_a_models_gradients_are_the_plain_paths_gradients() -> None:
    """A float32 decoder's loss and gradients with batch invariance on equal the plain forward's to
    float32 rounding (a different reduction order, the same function)."""
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(FAMILIES["llama-gqa-untied"]))
    ids = torch.randint(3, 211, (2, 40))

    def loss_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        hidden = model(ids)
        loss = F.cross_entropy(model.logits(hidden[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain_loss, plain = loss_and_grads()
    assert batch_invariant.enable(model) == 1
    invariant_loss, invariant = loss_and_grads()
    torch.testing.assert_close(invariant_loss, plain_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(invariant, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_online_algorithms_choose_it_where_bf16_meets_a_cpu() -> None:
    cpu = torch.device("cpu")
    assert choose_batch_invariance(None, True, cpu)  # bf16 on a CPU: on
    assert not choose_batch_invariance(None, False, cpu)  # float32 is 3e-6 apart without it
    assert choose_batch_invariance(True, False, cpu) and not choose_batch_invariance(False, True, cpu)
    assert not choose_batch_invariance(None, True, torch.device("cuda"))
    with pytest.raises(ValueError, match="batch_invariant: true runs on a CPU only"):
        choose_batch_invariance(True, True, torch.device("cuda"))


def wide_model(seed: int) -> CausalLM:
    """A 2-layer bf16 decoder of SmolLM2-135M's width (hidden 576, MLP 1536, 9 heads over 3), whose
    projections this CPU's bf16 kernels round differently by batch size; weights of std 0.05 so its
    distributions are not flat."""
    torch.manual_seed(seed)
    raw = dict(FAMILIES["llama-gqa-untied"], hidden_size=576, intermediate_size=1536, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=300)
    model = CausalLM(ModelConfig.from_dict(raw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05)
    return model.to(torch.bfloat16)


def alone_and_among_others(llm: LLM) -> tuple[list[float], list[float]]:
    """The processed log-probs of one seeded request run alone, then beside 40 others."""
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, 300, (19,), generator=gen).tolist()
    others = [torch.randint(3, 300, (int(n),), generator=gen).tolist() for n in torch.randint(3, 60, (40,))]
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    among = llm.generate(others[:17] + [prompt] + others[17:], params, use_tqdm=False)[17].outputs[0]
    return alone.processed_logprobs, among.processed_logprobs


def torch_rounds_by_row_count(model: CausalLM) -> bool:
    """Whether this CPU's bf16 matmul gives a row other bits among others than alone, on the model's
    MLP projection: oneDNN's AMX kernels do (they block rows), its AVX512-BF16 kernels do not."""
    weight = model.model.layers[0].mlp.gate_proj.weight.detach()
    rows = torch.randn(64, weight.shape[1], generator=torch.Generator().manual_seed(3)).to(weight.dtype)
    with torch.no_grad():
        alone = torch.cat([F.linear(rows[i:i + 1], weight) for i in range(rows.shape[0])])
        return any(not torch.equal(F.linear(rows[:n], weight), alone[:n]) for n in (2, 17, 33, 64))


def test_an_engine_requests_numbers_do_not_depend_on_its_neighbours() -> None:
    """`LLM(batch_invariant=True)`: a seeded request's log-probs are the same bits alone and among 40
    other requests (whose prefills and decodes share its steps); with torch's kernels they are not,
    on a CPU whose matmul rounds by row count. (The engine's own bf16 CPU kernels, on by default,
    compute each row alone too, so they are turned off for that plain case. Elsewhere a plain
    engine's neighbours can still change its bits, through the attention kernel a step's mix of
    prompts and decodes picks, but not by a rule a test can pin.)"""
    invariant = LLM.from_module(wide_model(0), kv_cache_tokens=4096, batch_invariant=True)
    assert invariant.engine.model.model.batch_invariant
    alone, among = alone_and_among_others(invariant)
    assert alone == among
    if torch_rounds_by_row_count(wide_model(0)):  # what batch invariance removes, shown where it exists
        plain = LLM.from_module(wide_model(0), kv_cache_tokens=4096)
        plain.engine.runner.cpu_routes = False
        plain_alone, plain_among = alone_and_among_others(plain)
        assert plain_alone != plain_among


def test_batch_invariance_needs_a_cpu() -> None:
    with pytest.raises(ValueError, match="batch_invariant runs on a CPU"):
        LLM.from_module(wide_model(0).to("meta"), kv_cache_tokens=64, batch_invariant=True)


def test_suspended_turns_the_flags_off_and_back() -> None:
    model = CausalLM(ModelConfig.from_dict(FAMILIES["llama-gqa-untied"]))
    batch_invariant.enable(model)
    with batch_invariant.suspended(model):
        assert not model.model.batch_invariant
    assert model.model.batch_invariant
    batch_invariant.enable(model, False)
    with batch_invariant.suspended(model):  # nothing was on: nothing is turned on after
        pass
    assert not model.model.batch_invariant
