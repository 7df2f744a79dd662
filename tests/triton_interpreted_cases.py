"""The Triton paged-attention kernels against the reference path, on the CPU under Triton's interpreter.

Run by tests/test_triton_attention.py in a fresh interpreter with TRITON_INTERPRET=1: the variable
must be set before triton is first imported (its standard library is decorated then), and in the
test session other modules (transformers' models) import triton first. The interpreter has no
bfloat16: float32 and float16 here, bfloat16 on a GPU (bench/cuda_check.py).
"""

from __future__ import annotations

import os
import random
from unittest import mock

if os.environ.get("TRITON_INTERPRET") != "1":
    raise RuntimeError("run these cases with TRITON_INTERPRET=1 set before python starts "
                       "(tests/test_triton_attention.py does)")

import pytest  # noqa: E402
import torch  # noqa: E402
from test_paged_attention import exact_attention  # noqa: E402
from tiny import DEEPSEEK_FAMILIES, FAMILIES, GEMMA_FAMILIES, GPT_OSS_FAMILIES, hf_model  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from pagedrl.engine import triton_attention  # noqa: E402
from pagedrl.engine.attention import PagedAttention  # noqa: E402
from pagedrl.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from pagedrl.engine.kv_cache import KVCache  # noqa: E402
from pagedrl.engine.llm import LLM  # noqa: E402
from pagedrl.engine.sampling_params import SamplingParams  # noqa: E402
from pagedrl.model.config import ModelConfig  # noqa: E402
from pagedrl.model.decoder import CausalLM  # noqa: E402

BLOCK = 16
STORE = {torch.float32: 0.0, torch.float16: 2.0**-11}  # float16: probabilities and outputs rounded to it


def test_kernels_run_under_the_interpreter() -> None:
    assert isinstance(triton_attention._paged_attention_kernel, InterpretedFunction)
    assert isinstance(triton_attention._store_kv_kernel, InterpretedFunction)


def scattered_tables(lengths: list[int], num_blocks: int, rng: random.Random) -> list[list[int]]:
    free = list(range(num_blocks))
    rng.shuffle(free)
    return [[free.pop() for _ in range(-(-n // BLOCK))] for n in lengths]


def check_against_reference(shapes: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int,
                            dtype: torch.dtype, seed: int = 0, tables: list[list[int]] | None = None,
                            tile: int = 16) -> None:
    """Write and attend one step of (num_computed, num_new) sequences with both paths, from the same
    stale cache: the caches after the step are equal and the outputs agree."""
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    cache = KVCache(2, 24, BLOCK, kv_heads, head_dim, dtype=dtype)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))  # stale values: must be masked, not zero
    if tables is None:
        tables = scattered_tables([c + n for c, n in shapes], 24, rng)
    seqs = [(t, c, n) for t, (c, n) in zip(tables, shapes, strict=True)]
    n = sum(new for _, new in shapes)
    q = torch.randn(1, n, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(1, n, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(1, n, kv_heads, head_dim, generator=gen).to(dtype)
    before = cache.data.clone()
    ref = PagedAttention.build(cache, BLOCK, seqs, impl="reference").attend(1, q, k, v)
    after_ref = cache.data.clone()
    cache.data.copy_(before)
    meta = PagedAttention.build(cache, BLOCK, seqs, impl="triton")
    with mock.patch.object(triton_attention, "TILE_N", tile):
        got = meta.attend(1, q, k, v)
    assert torch.equal(cache.data, after_ref)
    assert got.dtype == dtype and got.shape == q.shape
    # both within their dtype's bound of exact attention over the keys the cache holds after the step
    exact, bound = exact_attention(cache, seqs, q, layer=1, block=BLOCK, store=STORE[dtype])
    for out in (got, ref):
        assert ((out.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_with_gqa_and_partial_last_blocks(dtype: torch.dtype) -> None:
    """One new token each over 40, 3, 16 (a full last block), 17 (one key in the last) cached."""
    check_against_reference([(40, 1), (3, 1), (15, 1), (16, 1)], heads=6, kv_heads=2, head_dim=16, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_step_fresh_prompt_chunked_prefill_and_decodes(dtype: torch.dtype) -> None:
    """A fresh prompt, the second chunk of a prompt (its first 20 tokens cached), decodes, in one step;
    head_dim 24 (not a power of two: padded and masked) and 3 query heads per KV head."""
    check_against_reference([(0, 21), (20, 13), (33, 1), (5, 1)], heads=6, kv_heads=2, head_dim=24, dtype=dtype)


def test_prefix_hit_reads_shared_blocks() -> None:
    """Two prompts whose first 32 tokens are the same two cached blocks (a prefix-cache hit): each
    computes only its own tail, over the shared blocks, through its own table."""
    shared = [7, 2]
    tables = [shared + [11, 5], shared + [19]]
    check_against_reference([(32, 17), (32, 9)], heads=4, kv_heads=4, head_dim=16, dtype=torch.float32,
                            tables=tables)


def test_query_tiles_and_key_tiles_cut_anywhere() -> None:
    """A prompt longer than a query tile, with keys walked 8 at a time (half a block): the cuts of
    queries into tiles and of keys into tiles change nothing. One KV head for 8 query heads."""
    check_against_reference([(9, 70), (0, 1)], heads=8, kv_heads=1, head_dim=32, dtype=torch.float32, tile=8)


def test_store_kv_skips_negative_slots_and_converts_dtype() -> None:
    cache = KVCache(1, 4, BLOCK, 2, 24, dtype=torch.float16)
    key, value = torch.randn(3, 2, 24), torch.randn(3, 2, 24)
    slots = torch.tensor([5, -1, 2 * BLOCK + 3])
    triton_attention.store_kv(key, value, cache.key_cache[0], cache.value_cache[0], slots)
    flat_k = cache.key_cache[0].reshape(-1, 2, 24)
    flat_v = cache.value_cache[0].reshape(-1, 2, 24)
    assert torch.equal(flat_k[5], key[0].half()) and torch.equal(flat_v[2 * BLOCK + 3], value[2].half())
    written = torch.zeros(flat_k.shape[0], dtype=torch.bool)
    written[[5, 2 * BLOCK + 3]] = True
    assert flat_k[~written].abs().sum() == 0 and flat_v[~written].abs().sum() == 0


@pytest.mark.parametrize("family", ["qwen3-qknorm", "deepseek-v3", "gemma2", "gpt-oss"])
def test_engine_greedy_with_triton_attention_equals_reference(family: str) -> None:
    """The whole engine (chunked prefill of 37-token budgets, prefix caching, decodes) on Qwen3's
    shape (q/k-norm, head_dim 24, GQA), on DeepSeek-V3's latent attention (its cached latents the
    keys of one 40-wide KV head, whose values are their first 32 features), on Gemma 2's and gpt-oss's
    sliding layers beside full ones (their groups' own block tables; capped scores, sinks): the same
    tokens as with the reference attention (which, for latents, up-projects them)."""
    hf = hf_model({**FAMILIES, **DEEPSEEK_FAMILIES, **GEMMA_FAMILIES, **GPT_OSS_FAMILIES}[family])
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=False)
    model.eval()
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(3, 211, (20,), generator=gen).tolist()
    prompts = [prefix + torch.randint(3, 211, (n,), generator=gen).tolist() for n in (5, 30, 1)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = {}
    for impl in ("reference", "triton"):
        llm = LLM.from_module(model, kv_cache_tokens=512, max_num_batched_tokens=37, attention_impl=impl)
        first = llm.generate(prompts[:1], params, use_tqdm=False)  # its prefix blocks are then cached
        outs[impl] = [o.outputs[0].token_ids for o in first + llm.generate(prompts[1:], params, use_tqdm=False)]
        assert llm.stats()["prefix_cache_hits"] > 0
    assert outs["triton"] == outs["reference"]


def test_decode_steps_from_persistent_padded_batches_equal_reference() -> None:
    """The CUDA-graph path's bookkeeping, run eagerly: decode steps fed from persistent tensors
    padded to the ladder's sizes (3 sequences ride in 4 rows, 5 in 8, with n=2 forks sharing prompt
    blocks) give the reference path's tokens, and the padding rows write no cache slot."""
    hf = hf_model(FAMILIES["llama-gqa-untied"])
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=False)
    model.eval()
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 211, (n,), generator=gen).tolist() for n in (3, 18, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    forked = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, n=2, seed=1)
    outs, replays = {}, []
    for impl in ("reference", "triton"):
        llm = LLM.from_module(model, kv_cache_tokens=512, attention_impl=impl, max_num_seqs=8)
        runner = llm.engine.runner
        if impl == "triton":
            graphs = runner.graphs = DecodeGraphs(model, runner.kv_cache, 16, 8, 256, runner.precision, record=False)
            run = graphs.run

            def counted(*args, run=run):
                replays.append(len(args[0]))
                return run(*args)

            graphs.run = counted
        greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        sampled = [c.token_ids for o in llm.generate(prompts, forked,
                                                      use_tqdm=False) for c in o.outputs]
        outs[impl] = (greedy, sampled)
    assert outs["triton"][0] == outs["reference"][0]
    assert outs["triton"][1] == outs["reference"][1]
    assert 3 in replays and 6 in replays  # 3 greedy sequences, then 3 prompts × 2 samples
    assert (graphs.slot_mapping[6:8] == -1).all()  # the last step's padding rows wrote nothing



class FakeGraph:
    """Stands in for torch.cuda.CUDAGraph on a CPU: replaying re-runs the recorded step eagerly on the
    persistent tensors and writes the graph's output tensor in place, which is what a replay does."""

    owner: DecodeGraphs | None = None

    def pool(self) -> object:
        return object()

    def replay(self) -> None:
        owner = FakeGraph.owner
        assert owner is not None
        size, out = next((s, o) for s, (g, o) in owner.graphs.items() if g is self)
        out.copy_(owner._forward(size))


def test_recorded_decode_graphs_equal_reference() -> None:
    """The recording path, CUDA's calls faked on the CPU: graphs recorded at start-up and recorded
    again when the KV cache moves (sleep and wake), with live sequences' inputs never overwritten by
    a recording (a size first needed mid-run is recorded before the step's inputs are written)."""
    hf = hf_model(FAMILIES["smollm2-like"])
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=False)
    model.eval()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 211, (n,), generator=gen).tolist() for n in (4, 21, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM.from_module(model, kv_cache_tokens=512, attention_impl="reference")
                .generate(prompts, params, use_tqdm=False)]
    fake = mock.MagicMock()
    with mock.patch.multiple(torch.cuda, CUDAGraph=FakeGraph, graph=lambda g, pool=None: mock.MagicMock(),
                             Stream=fake, stream=lambda s: mock.MagicMock(), current_stream=fake,
                             device=lambda d: mock.MagicMock()):
        llm = LLM.from_module(model, kv_cache_tokens=512, attention_impl="triton", max_num_seqs=8)
        runner = llm.engine.runner
        graphs = runner.graphs = DecodeGraphs(model, runner.kv_cache, 16, 8, 256, runner.precision)
        FakeGraph.owner = graphs
        graphs.capture_all()
        assert sorted(graphs.graphs) == [1, 2, 4, 8]
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.sleep()  # the cache is released: the graphs go, and come back one size at a time
        assert not graphs.graphs
        again = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert sorted(graphs.graphs) == [4]  # three sequences decode in the 4-row graph
    assert got == expected and again == expected
