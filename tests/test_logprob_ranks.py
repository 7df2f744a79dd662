"""Each log-prob entry carries its token's rank and name, as vLLM's `Logprob` does: the sampled token's
rank whether or not it is among the alternatives asked for, and every prompt token's, checked against
the whole distribution asked for in a second run with the same seed."""

from __future__ import annotations

import pytest

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.loader import load_model


@pytest.fixture(scope="module")
def llm(tiny_train_model):
    loaded = load_model(tiny_train_model, device="cpu")
    return LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=1024,
                           max_logprobs=-1)  # the whole distribution, to rank against


def rank_in(distribution: dict, token: int) -> int:
    return 1 + sum(lp.logprob > distribution[token].logprob for lp in distribution.values())


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_sampled_and_prompt_tokens_carry_their_rank_and_name(llm, mode):
    vocab = llm.engine.vocab_size
    few = SamplingParams(max_tokens=10, temperature=1.5, top_k=50, seed=4, ignore_eos=True, logprobs=1,
                         prompt_logprobs=1, logprobs_mode=mode)
    (short,) = llm.generate("the cat sat on the mat", few, use_tqdm=False)
    (full,) = llm.generate("the cat sat on the mat", few.clone(logprobs=vocab, prompt_logprobs=vocab), use_tqdm=False)
    a, b = short.outputs[0], full.outputs[0]
    assert a.token_ids == b.token_ids  # the same draws: the alternatives asked for change no noise
    outside = 0
    for token, entry, whole in zip(a.token_ids, a.logprobs, b.logprobs, strict=True):
        assert entry[token].rank == rank_in(whole, token) and entry[token].decoded_token == llm.tokenizer.token_name(token)
        outside += entry[token].rank > 1
        assert len(entry) == (1 if entry[token].rank == 1 else 2)
    assert outside  # some tokens were drawn below the top one
    assert short.prompt_logprobs[0] is None
    for token, entry, whole in zip(short.prompt_token_ids[1:], short.prompt_logprobs[1:], full.prompt_logprobs[1:],
                                   strict=True):
        assert entry[token].rank == rank_in(whole, token) and entry[token].decoded_token is not None
        best = min(entry.values(), key=lambda lp: lp.rank)
        assert best.rank == 1 and best.logprob == max(lp.logprob for lp in whole.values())


def test_alternatives_beyond_max_logprobs_are_refused(tiny_train_model):
    loaded = load_model(tiny_train_model, device="cpu")
    llm = LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=1024)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{name} \(21\) exceeds max_logprobs \(20\)"):
            llm.generate("the cat", SamplingParams(max_tokens=2, **{name: 21}), use_tqdm=False)
    assert llm.generate("the cat", SamplingParams(max_tokens=2, logprobs=20), use_tqdm=False)[0].outputs[0].logprobs
