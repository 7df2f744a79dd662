"""The KV cache itself: its layout per layer, block copies (copy-on-write's half in the cache), and the
budgets that size it, in tokens, bytes or the engine's CPU default."""

from __future__ import annotations

import pytest
import torch
from tiny import FAMILIES, hf_model

from pagedrl.engine.kv_cache import DEFAULT_CPU_BYTES, DEFAULT_CPU_TOKENS, KVCache, num_blocks_for_budget
from pagedrl.model.config import ModelConfig

BLOCK = 4


def test_copy_blocks_copies_every_layer_and_reads_before_writing() -> None:
    gen = torch.Generator().manual_seed(4)
    cache = KVCache(3, 10, BLOCK, 2, 4)
    cache.data.normal_(generator=gen)
    before = cache.data.clone()
    cache.copy_blocks([(1, 5), (5, 6), (2, 7)])  # 5 -> 6 must see block 5 as it was
    for layer in range(3):
        for src, dst in ((1, 5), (5, 6), (2, 7)):
            assert torch.equal(cache.key_cache[layer][dst], before[layer, 0, src])
            assert torch.equal(cache.value_cache[layer][dst], before[layer, 1, src])
        for untouched in (0, 1, 2, 3, 4, 8, 9):
            assert torch.equal(cache.data[layer, :, untouched], before[layer, :, untouched])


def test_copy_blocks_rejects_bad_pairs() -> None:
    cache = KVCache(1, 4, BLOCK, 1, 2)
    with pytest.raises(ValueError, match="pairs"):
        cache.copy_blocks([(0, 4)])
    with pytest.raises(ValueError, match="destination block appears twice"):
        cache.copy_blocks([(0, 2), (1, 2)])


def test_cache_layout_and_budgets() -> None:
    cache = KVCache(3, 5, 16, 2, 8, dtype=torch.float32)
    assert tuple(cache.key_cache[2].shape) == (5, 16, 2, 8) and len(cache.value_cache) == 3
    per_block = KVCache.bytes_per_block(3, 16, 2, 8, torch.float32)
    assert per_block == 2 * 3 * 16 * 2 * 8 * 4 and cache.nbytes == 5 * per_block
    assert KVCache.bytes_per_block(3, 16, 2, 8, torch.bfloat16) == per_block // 2
    shape = dict(num_layers=3, block_size=16, num_kv_heads=2, head_dim=8)
    assert KVCache.num_blocks_for(**shape, max_tokens=33) == 3
    assert KVCache.num_blocks_for(**shape, max_bytes=per_block * 7 + 1) == 7
    with pytest.raises(ValueError, match="exactly one"):
        KVCache.num_blocks_for(**shape)
    with pytest.raises(ValueError, match="exactly one"):
        KVCache.num_blocks_for(**shape, max_tokens=10, max_bytes=10**6)
    with pytest.raises(ValueError, match="less than one block"):
        KVCache.num_blocks_for(**shape, max_bytes=per_block - 1)
    with pytest.raises(ValueError, match="CUDA"):
        KVCache.num_blocks_for(**shape, memory_fraction=0.5, device="cpu")
    with pytest.raises(ValueError, match="num_kv_heads"):
        KVCache(1, 4, 16, 0, 8)
    cfg = ModelConfig.from_dict(hf_model(FAMILIES["qwen3-qknorm"]).config.to_dict())
    sized = KVCache.for_model(cfg, block_size=8, max_tokens=100)
    assert tuple(sized.key_cache[0].shape) == (13, 8, cfg.num_key_value_heads, cfg.head_dim)
    assert len(sized.key_cache) == cfg.num_hidden_layers


def test_engine_budget_rule() -> None:
    cfg = ModelConfig.from_dict(hf_model(FAMILIES["llama-gqa-untied"]).config.to_dict())
    f32 = torch.float32
    assert num_blocks_for_budget(cfg, 16, "cpu", f32, tokens=40) == 3
    per_block = KVCache.bytes_per_block(cfg.num_hidden_layers, 16, cfg.num_key_value_heads, cfg.head_dim, f32)
    assert num_blocks_for_budget(cfg, 16, "cpu", f32, nbytes=5 * per_block) == 5
    assert num_blocks_for_budget(cfg, 16, "cpu", f32) == min(DEFAULT_CPU_TOKENS // 16, DEFAULT_CPU_BYTES // per_block)
    with pytest.raises(ValueError, match="at most one"):
        num_blocks_for_budget(cfg, 16, "cpu", f32, tokens=40, nbytes=10**6)
