"""`SamplingParams.logprob_token_ids` (vLLM's): the log-probs of exactly the ids asked for at every output
token, whatever their rank, each with its rank in the whole distribution; checked against the whole
distribution asked for in a second run with the same seed, and held to vLLM's rules on the params."""

from __future__ import annotations

import pytest
from test_logprob_ranks import rank_in
from test_server_vllm_behaviour import app_client

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import MAX_LOGPROB_TOKEN_IDS, SamplingParams
from pagedrl.model.loader import load_model


@pytest.fixture(scope="module")
def llm(tiny_train_model):
    loaded = load_model(tiny_train_model, device="cpu")
    return LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=1024,
                           max_logprobs=-1)  # the whole distribution, to check against


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_the_named_ids_log_probs_and_ranks_are_the_whole_distributions(llm, mode):
    vocab = llm.engine.vocab_size
    named = [vocab - 1, 7, vocab // 2, 5]  # an order that is not the ids' nor their likelihoods'
    params = SamplingParams(max_tokens=8, temperature=1.2, top_k=40, seed=3, ignore_eos=True,
                            logprob_token_ids=named, logprobs_mode=mode)
    (out,) = llm.generate("the cat sat on the mat", params, use_tqdm=False)
    (whole,) = llm.generate("the cat sat on the mat", params.clone(logprob_token_ids=None, logprobs=vocab),
                            use_tqdm=False)
    a, b = out.outputs[0], whole.outputs[0]
    assert a.token_ids == b.token_ids  # the ids asked for change no draw
    assert a.cumulative_logprob == pytest.approx(b.cumulative_logprob)
    low = 0
    for token, entry, dist in zip(a.token_ids, a.logprobs, b.logprobs, strict=True):
        assert list(entry) == [token] + [t for t in named if t != token]  # sampled first, then as named
        for t, lp in entry.items():
            assert lp.logprob == dist[t].logprob and lp.rank == rank_in(dist, t)
            assert lp.decoded_token == llm.tokenizer.token_name(t)
        low += any(entry[t].rank > 20 for t in named)
    assert low  # ids far below any top-k were scored


def test_logprobs_must_equal_the_number_of_named_ids():
    assert SamplingParams(logprob_token_ids=[1, 2], logprobs=2).num_logprobs == 2
    assert SamplingParams(logprob_token_ids=[1, 1], logprobs=2).logprob_token_ids == [1]  # vLLM counts as sent
    assert SamplingParams(logprob_token_ids=[4, 1, 2]).num_logprobs == 3
    assert SamplingParams(logprob_token_ids=[]).logprob_token_ids is None  # empty: the usual top-k
    assert SamplingParams(logprobs=0).num_logprobs == 0 and SamplingParams().num_logprobs is None
    with pytest.raises(ValueError, match=r"^SamplingParams.logprobs .*must equal len\(logprob_token_ids\) = 2"):
        SamplingParams(logprob_token_ids=[1, 2], logprobs=5)


@pytest.mark.parametrize("ids,match", [
    ([-1], "non-negative"), ("12", "list of int"), ([1.0], "list of int"),
    (list(range(MAX_LOGPROB_TOKEN_IDS + 1)), f"at most {MAX_LOGPROB_TOKEN_IDS}")])
def test_bad_ids_name_the_field(ids, match):
    with pytest.raises(ValueError, match=rf"^SamplingParams.logprob_token_ids .*{match}"):
        SamplingParams(logprob_token_ids=ids)


def test_ids_outside_the_vocabulary_are_refused_by_the_engine(llm):
    vocab = llm.engine.vocab_size
    with pytest.raises(ValueError, match=rf"^logprob_token_ids names token ids outside the vocabulary \[0, {vocab}\)"):
        llm.generate("the cat", SamplingParams(max_tokens=2, logprob_token_ids=[3, vocab]), use_tqdm=False)


def test_more_named_ids_than_max_logprobs_are_scored(tiny_train_model):
    """vLLM bounds the list by its own limit, not by max_logprobs, which bounds a top-k."""
    loaded = load_model(tiny_train_model, device="cpu")
    llm = LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=1024)
    (out,) = llm.generate("the cat", SamplingParams(max_tokens=2, temperature=0, logprob_token_ids=list(range(40))),
                          use_tqdm=False)
    assert all(set(range(40)) <= set(entry) for entry in out.outputs[0].logprobs)


@pytest.fixture(scope="module")
def http(tiny_train_model):
    yield from app_client(load_model(tiny_train_model, device="cpu"))


def test_both_routes_list_the_named_ids_and_the_sampled_token(http, llm):
    """As vLLM's server: with the log-probs switch on, each token lists the sampled token and every named id,
    whatever `top_logprobs` says; the values are the offline engine's."""
    named = [5, 17, 250]
    body = {"max_tokens": 4, "temperature": 0, "logprob_token_ids": named}
    chat = http.post("/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "hi"}],
                                                   "logprobs": True, "top_logprobs": 1}).json()
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else prompt
    (ref,) = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, logprob_token_ids=named), use_tqdm=False)
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ref.outputs[0].token_ids)
    for item, token, entry in zip(content, ref.outputs[0].token_ids, ref.outputs[0].logprobs, strict=True):
        listed = [top["logprob"] for top in item["top_logprobs"]]
        assert listed == [lp.logprob for lp in entry.values()]  # the sampled token, then the ids as named
        assert [t for t in entry if t != token] == [t for t in named if t != token]
    done = http.post("/v1/completions", json={**body, "prompt": "the cat", "logprobs": 0}).json()
    assert all(len(top) == len(set(named) | {token}) for top, token in zip(
        done["choices"][0]["logprobs"]["top_logprobs"], done["choices"][0]["logprobs"]["tokens"], strict=True))
    off = http.post("/v1/completions", json={**body, "prompt": "the cat"}).json()  # the switch off: none
    assert off["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("body,param", [
    ({"logprob_token_ids": [1, 10**6], "logprobs": 1}, "logprob_token_ids"),
    ({"logprob_token_ids": list(range(MAX_LOGPROB_TOKEN_IDS + 1)), "logprobs": 1}, "logprob_token_ids"),
    ({"logprob_token_ids": [1], "logprobs": 1, "echo": True, "max_tokens": 0}, "logprob_token_ids"),
    ({"logprob_token_ids": [1], "use_beam_search": True, "n": 2}, "logprob_token_ids")])
def test_bad_requests_are_a_400_naming_the_field(http, body, param):
    r = http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
