"""Greedy generation from the paged engine equals transformers' greedy `generate`, token for token,
however the engine schedules: prefix caching on or off, chunked prefill, heavy preemption."""

from __future__ import annotations

import pytest
import torch
from tiny import FAMILIES, hf_model

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM

MAX_NEW = 12


def prompts(vocab: int, seed: int = 0, prefix: int = 20,
            lengths: tuple[int, ...] = (3, 17, 33, 5, 26, 41)) -> list[list[int]]:
    """Mixed lengths, with a shared `prefix`-token prefix on half of them so prefix caching has work."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, vocab, (prefix,), generator=g).tolist()
    out = []
    for i, n in enumerate(lengths):
        tail = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append(shared + tail if i % 2 else tail)
    return out


def reference(hf: torch.nn.Module, batch: list[list[int]], max_new: int = MAX_NEW, **generate: object) -> list[list[int]]:
    """transformers' greedy tokens (`generate` adds logits processors: `sequence_bias`, `bad_words_ids`)."""
    outs = []
    for ids in batch:
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0, **generate)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def engine_for(hf: torch.nn.Module, **kwargs) -> LLM:
    model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
    model.load_state_dict(hf.state_dict(), strict=False)
    return LLM.from_module(model.eval(), **kwargs)


def strip_eos(tokens: list[int], eos: int = 2) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request):
    hf = hf_model(FAMILIES[request.param])
    batch = prompts(hf.config.vocab_size)
    return hf, batch, reference(hf, batch)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers(family, prefix_caching: bool) -> None:
    hf, batch, expected = family
    llm = engine_for(hf, enable_prefix_caching=prefix_caching, kv_cache_tokens=4096)
    # Run twice so the second pass reads the first pass's cached prefixes.
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
        assert [strip_eos(g) for g in got] == [strip_eos(e) for e in expected]
    stats = llm.stats()
    assert stats["num_blocks_used"] == 0
    if prefix_caching:
        assert stats["prefix_cache_hits"] > 0
    else:
        assert stats["prefix_cache_hits"] == 0


def test_chunked_prefill_and_reference_attention(family) -> None:
    hf, batch, expected = family
    llm = engine_for(hf, max_num_batched_tokens=7, block_size=4, kv_cache_tokens=1024, attention_impl="reference")
    got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY, use_tqdm=False)]
    assert [strip_eos(g) for g in got] == [strip_eos(e) for e in expected]


def test_heavy_preemption(family) -> None:
    hf, batch, expected = family
    # The cache holds the longest request and little more: twelve requests must take turns.
    longest = max(len(p) for p in batch) + MAX_NEW
    llm = engine_for(hf, block_size=4, kv_cache_tokens=longest + 8, max_num_batched_tokens=16)
    got = [o.outputs[0].token_ids for o in llm.generate(batch + batch, GREEDY, use_tqdm=False)]
    assert [strip_eos(g) for g in got] == [strip_eos(e) for e in expected + expected]
    stats = llm.stats()
    assert stats["num_preemptions"] >= 5
    assert stats["num_blocks_used"] == 0
