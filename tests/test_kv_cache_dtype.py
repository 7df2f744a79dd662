"""A float32 model's KV cache in bf16 (`kv_cache_dtype="bfloat16"`): each key and value rounded to bf16
as it is stored (to nearest even, as `Tensor.to` rounds), then attended in float32 by the CPU kernels,
which widen the cache's values as they read them. So a bf16 cache gives, bit for bit, what a float32
cache holding the same rounded values gives: the row kernel, the prefill tiles, and whole engines
(decode program and modules, layer rules) against an engine whose stores round. The float64 loop is
the independent reference for the kernels' numbers."""

from __future__ import annotations

import pytest
import torch
from test_engine_precision import peaked
from tiny import GEMMA_FAMILIES

from pagedrl.engine import cpu_decode
from pagedrl.engine.engine_config import EngineConfig
from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.kernels import ops
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM

pytestmark = pytest.mark.isa  # the float32 vector chunks follow the CPU class: `make test-isa` runs each

GREEDY = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True, logprobs=2)


@pytest.fixture(autouse=True)
def kernels() -> None:
    assert ops.available()  # loaded (built on every class the suite runs on)


def caches(head_dim: int, seed: int, blocks: int = 24, block: int = 16, kv_heads: int = 3
           ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (blocks, block, kv_heads, head_dim)
    return torch.randn(shape, generator=gen).bfloat16(), torch.randn(shape, generator=gen).bfloat16()


def float64_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, tables: torch.Tensor,
                 row_seqs: list[int], row_lens: list[int], scale: float, window: int = 0) -> torch.Tensor:
    """Each row's softmax(q k^T * scale) v over its sequence's first row_lens[r] positions, in float64."""
    block, kv_heads = keys.shape[1], keys.shape[2]
    groups = q.shape[1] // kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    for r, (s, n) in enumerate(zip(row_seqs, row_lens, strict=True)):
        lo = max(0, n - window) if window else 0
        slots = [int(tables[s, p // block]) * block + p % block for p in range(lo, n)]
        k = keys.reshape(-1, kv_heads, keys.shape[3])[slots].double()
        v = values.reshape(-1, kv_heads, keys.shape[3])[slots].double()
        for h in range(q.shape[1]):
            probs = torch.softmax(k[:, h // groups] @ q[r, h].double() * scale, 0)
            out[r, h] = probs @ v[:, h // groups]
    return out


def test_stores_round_as_tensor_to_does() -> None:
    """Float32 keys into a bf16 cache: the bits `Tensor.to(torch.bfloat16)` gives, ties to even, in the
    slots named and nowhere else."""
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(5, 2, 8, generator=gen) * 100
    ties = torch.tensor([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3.0e38, 1e-40, 0.0, -0.0, 7.0])
    k[0, 0] = ties  # halfway cases round to the even neighbour: 1.0, 1.0 + 2^-6, -1.0, ...
    v = -k
    key_cache, value_cache = torch.ones(4, 4, 2, 8, dtype=torch.bfloat16), torch.ones(4, 4, 2, 8, dtype=torch.bfloat16)
    slots = torch.tensor([3, 14, 0, 9, 7])
    ops.store_kv(k, v, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.view(16, 2, 8), value_cache.view(16, 2, 8)
    assert torch.equal(flat_k[slots].view(torch.int16), k.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(flat_v[slots].view(torch.int16), v.to(torch.bfloat16).view(torch.int16))
    others = [i for i in range(16) if i not in slots.tolist()]
    assert bool((flat_k[others] == 1).all()) and bool((flat_v[others] == 1).all())
    with pytest.raises(RuntimeError, match="float32 for bfloat16 caches"):
        ops.store_kv(k.half(), v.half(), key_cache, value_cache, slots)


@pytest.mark.parametrize("head_dim", [64, 128, 80])  # 80: the loops sized at run time
@pytest.mark.parametrize("window", [0, 21])
def test_rows_over_a_bf16_cache_are_the_float32_rows_over_its_values(head_dim: int, window: int) -> None:
    keys, values = caches(head_dim, head_dim + window)
    tables = torch.randperm(24, generator=torch.Generator().manual_seed(1))[:18].view(3, 6)
    row_seqs, row_lens = [0, 1, 2, 1, 0], [37, 96, 5, 70, 1]
    q = torch.randn(5, 9, head_dim, generator=torch.Generator().manual_seed(2))
    scale = head_dim**-0.5
    args = (tables, torch.tensor(row_lens), scale, torch.tensor(row_seqs))
    out, lse = ops.paged_attention(q, keys, values, *args, with_lse=True, window=window or None)
    same, same_lse = ops.paged_attention(q, keys.float(), values.float(), *args, with_lse=True, window=window or None)
    assert out.dtype == torch.float32 and torch.equal(out, same) and torch.equal(lse, same_lse)
    exact = float64_rows(q, keys, values, tables, row_seqs, row_lens, scale, window)
    assert float((out.double() - exact).abs().max()) < 2e-6
    # The bound is tight enough to tell: keys off by about a bf16 rounding (2^-9 relative) are far off it.
    noise = 1 + 2.0**-9 * torch.randn(keys.shape, generator=torch.Generator().manual_seed(8))
    moved = float64_rows(q, keys.float() * noise, values, tables, row_seqs, row_lens, scale, window)
    assert float((out.double() - moved).abs().max()) > 1e-5
    # Soft-capped scores and sinks, the layer rules of Gemma 2 and gpt-oss, the same way.
    sinks = torch.randn(9, generator=torch.Generator().manual_seed(3))
    ruled = ops.paged_attention(q, keys, values, *args, softcap=5.0, sinks=sinks)[0]
    assert torch.equal(ruled, ops.paged_attention(q, keys.float(), values.float(), *args, softcap=5.0,
                                                  sinks=sinks)[0])


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_tiles_over_a_bf16_cache_are_the_float32_tiles_over_its_values(head_dim: int) -> None:
    """A step of prompt chunks (rows of 3 sequences, one after cached positions): the float32 tiles."""
    assert ops.paged_prefill_float32()
    keys, values = caches(head_dim, 7)
    tables = torch.randperm(24, generator=torch.Generator().manual_seed(4))[:18].view(3, 6)
    query_start_loc, seq_lens = torch.tensor([0, 40, 47, 80]), torch.tensor([40, 90, 33])
    q = torch.randn(80, 9, head_dim, generator=torch.Generator().manual_seed(5))
    scale = head_dim**-0.5
    row_seqs = [0] * 40 + [1] * 7 + [2] * 33
    row_lens = list(range(1, 41)) + list(range(84, 91)) + list(range(1, 34))
    for window in (0, 12):
        out = ops.paged_prefill(q, keys, values, tables, query_start_loc, seq_lens, scale, window=window or None)
        same = ops.paged_prefill(q, keys.float(), values.float(), tables, query_start_loc, seq_lens, scale,
                                 window=window or None)
        assert out.dtype == torch.float32 and torch.equal(out, same)
        exact = float64_rows(q, keys, values, tables, row_seqs, row_lens, scale, window)
        assert float((out.double() - exact).abs().max()) < 2e-6


def rounding_stores(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every `store_kv` into a float32 cache rounds the keys and values to bf16 first. The decode program
    runs its layers as its Python loop, whose stores go through `ops.store_kv` (its one call,
    `ops.decode_layers`, calls the op from C++; it gives the loop's bits: `test_cpu_decode.py`)."""
    monkeypatch.setattr(cpu_decode, "flat_layers", lambda model, layers, bf16: None)
    store = ops.store_kv

    def rounded(k, v, key_cache, value_cache, slots):  # noqa: ANN001, ANN202
        if key_cache.dtype == torch.float32:
            k, v = k.to(torch.bfloat16).float(), v.to(torch.bfloat16).float()
        return store(k, v, key_cache, value_cache, slots)

    monkeypatch.setattr(ops, "store_kv", rounded)


def gemma2() -> CausalLM:
    torch.manual_seed(6)
    model = CausalLM(ModelConfig.from_dict(GEMMA_FAMILIES["gemma2"])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.15)
    return model


def outputs(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list[float], list]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].processed_logprobs, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("family", ["llama-gqa-untied", "qwen3-qknorm", "gemma2"])
@pytest.mark.parametrize("eager", [False, True])
def test_an_engine_over_a_bf16_cache_is_one_over_rounded_float32_keys(monkeypatch, family: str, eager: bool) -> None:
    """Prompts of 3-45 tokens chunked at 37 (prompt chunks beside decodes), then decode steps, through the
    decode program or the modules (`enforce_eager`); Gemma 2's windows and capped scores through the
    layer rules. The bf16 cache's tokens, log-probs and alternatives equal those of a float32 cache whose
    stores round, and its blocks are twice as many in the same bytes."""
    model = gemma2() if family == "gemma2" else peaked(family, 3)
    prompts = [torch.randint(3, 211, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (3, 45, 18)]
    args = dict(kv_cache_bytes=1 << 20, max_num_batched_tokens=37, enable_prefix_caching=False, enforce_eager=eager)
    llm = LLM.from_module(model, kv_cache_dtype="bfloat16", **args)
    assert llm.engine.kv_cache.dtype == torch.bfloat16 and " in bfloat16" in llm.engine.kv_layout()
    got = outputs(llm, prompts)
    with monkeypatch.context() as patch:
        rounding_stores(patch)
        float_cache = LLM.from_module(model, **args)
        assert float_cache.engine.kv_cache.dtype == torch.float32
        assert llm.engine.kv_manager.num_blocks_total == 2 * float_cache.engine.kv_manager.num_blocks_total
        assert got == outputs(float_cache, prompts)
    assert got != outputs(float_cache, prompts)  # unrounded stores: other log-probs


def test_kv_cache_dtype_is_checked() -> None:
    for bad, why in (("fp8", " \\(fp8 caches are not built\\)"), ("float16", "")):
        with pytest.raises(ValueError, match=f"^kv_cache_dtype must be one of auto, bfloat16, got '{bad}'{why}$"):
            EngineConfig(kv_cache_dtype=bad).validate()
    assert EngineConfig().cache_dtype(torch.float32) == torch.float32
    assert EngineConfig(kv_cache_dtype="bfloat16").cache_dtype(torch.float32) == torch.bfloat16
