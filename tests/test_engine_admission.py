"""Admission under memory pressure: requests that wait for KV blocks hold none while they wait, and
the prefix cache counts each request once, when it is admitted, however often it was retried."""

from __future__ import annotations

import pytest
import torch
from tiny import FAMILIES, hf_model

from pagedrl.engine import prefix_lookup
from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM

BLOCK = 4
SHARED = 8  # two full blocks every prompt starts with
NUM_PROMPTS = 6
PARAMS = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model() -> CausalLM:
    hf = hf_model(FAMILIES["llama-gqa-untied"])
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=False)
    return model.eval()


def prompts(vocab: int) -> list[list[int]]:
    """The shared two blocks, then one token of each prompt's own: 9 tokens, 12 with the outputs."""
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, vocab, (SHARED,), generator=g).tolist()
    return [shared + [3 + i] for i in range(NUM_PROMPTS)]


def run(model: CausalLM, kv_cache_tokens: int, monkeypatch: pytest.MonkeyPatch) -> tuple[list, dict, list]:
    hashed: list[tuple[int, ...]] = []
    real = prefix_lookup.hash_block_tokens
    monkeypatch.setattr(prefix_lookup, "hash_block_tokens",
                        lambda parent, tokens, version, salt: hashed.append(tuple(tokens)) or real(parent, tokens, version, salt))
    llm = LLM.from_module(model, block_size=BLOCK, kv_cache_tokens=kv_cache_tokens)
    engine = llm.engine
    for p in prompts(model.config.vocab_size):
        engine.add_request(p, PARAMS)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
    monkeypatch.undo()
    return [outputs[k] for k in sorted(outputs, key=int)], llm.stats(), hashed


def test_prefix_cache_counts_each_request_once_under_admission_pressure(model, monkeypatch) -> None:
    # Five blocks: the first request takes three (the shared two and its own), the next two one each;
    # the other three must wait until those finish, and are refused on every step before that.
    tight, tight_stats, tight_hashed = run(model, 5 * BLOCK, monkeypatch)
    roomy, roomy_stats, roomy_hashed = run(model, 64 * BLOCK, monkeypatch)
    assert tight_stats["num_blocks_total"] == 5 and tight_stats["num_preemptions"] == 0
    assert tight == roomy
    # Every prompt is looked up once (9 tokens); all but the first find the shared 8 tokens.
    expected = (NUM_PROMPTS * (SHARED + 1), (NUM_PROMPTS - 1) * SHARED)
    assert (tight_stats["prefix_cache_queries"], tight_stats["prefix_cache_hits"]) == expected
    assert (roomy_stats["prefix_cache_queries"], roomy_stats["prefix_cache_hits"]) == expected
    # Each request hashes its prompt's two full blocks once, however often it was refused (the last
    # block of each sequence never fills with computed tokens: the last sampled token is not fed back).
    assert len(tight_hashed) == len(roomy_hashed) == NUM_PROMPTS * 2


def test_a_waiting_request_holds_no_blocks(model) -> None:
    llm = LLM.from_module(model, block_size=BLOCK, kv_cache_tokens=5 * BLOCK)
    engine = llm.engine
    for p in prompts(model.config.vocab_size):
        engine.add_request(p, PARAMS)
    engine.step()
    stats = engine.stats()
    assert stats["num_requests_running"] == 3 and stats["num_requests_waiting"] == 3
    held = sum(b.ref_count for b in engine.kv_manager.pool.blocks)
    # Three running tables of three blocks each: the shared two are held three times over.
    assert held == 3 * 3 and stats["num_blocks_used"] == 5
    for seq in engine.scheduler.waiting:
        assert seq.num_computed_tokens == 0
        assert seq.seq_id not in engine.kv_manager or engine.kv_manager.block_table(seq.seq_id) == []
