"""vLLM's output kinds: CUMULATIVE, DELTA and FINAL_ONLY give the same final result, and building the
outputs costs work proportional to each step's new tokens (no step rebuilds earlier log-prob entries,
token lists or decoded names)."""

from __future__ import annotations

import pytest

import pagedrl.engine.llm_engine as llm_engine_module
from pagedrl.engine.llm_engine import EngineConfig, LLMEngine
from pagedrl.engine.outputs import RequestOutput
from pagedrl.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedrl.model.loader import load_model

PROMPTS = ["the cat sat on the mat", "a dog ran in the park"]
TOKENS = 120
K = 3


@pytest.fixture(scope="module")
def loaded(tiny_train_model):
    return load_model(tiny_train_model, device="cpu")


def run(loaded, kind: RequestOutputKind, **params) -> tuple[list[list[RequestOutput]], LLMEngine]:
    """Every output of every step, per request, for the two prompts."""
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_cache_tokens=2048),
                       eos_token_ids=loaded.eos_token_ids)
    p = SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=3, ignore_eos=True, logprobs=K, n=2,
                       output_kind=kind, **params)
    ids = [engine.add_request(prompt, p) for prompt in PROMPTS]
    per_request: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            per_request[out.request_id].append(out)
    return [per_request[rid] for rid in ids], engine


def merged(outputs: list[RequestOutput]) -> RequestOutput:
    whole = outputs[0]
    for out in outputs[1:]:
        whole.add(out)
    return whole


def summary(out: RequestOutput) -> list[tuple]:
    return [(c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason, c.processed_logprobs, c.raw_logprobs,
             pytest.approx(c.cumulative_logprob, abs=1e-9),
             [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()} for e in c.logprobs])
            for c in out.outputs]


@pytest.mark.parametrize(("stop", "include"), [(None, False), ([" the", "zz"], False), ([" the", "zz"], True)])
def test_the_three_kinds_end_with_the_same_result(loaded, stop, include):
    """With stop strings too: a DELTA stream holds back text a stop string may still cut."""
    kw = dict(stop=stop, include_stop_str_in_output=include)
    cumulative, _ = run(loaded, RequestOutputKind.CUMULATIVE, **kw)
    delta, _ = run(loaded, RequestOutputKind.DELTA, **kw)
    final, _ = run(loaded, RequestOutputKind.FINAL_ONLY, **kw)
    if stop:
        assert any(c.stop_reason == " the" for outs in cumulative for c in outs[-1].outputs)
    for c_outs, d_outs, f_outs in zip(cumulative, delta, final, strict=True):
        assert len(f_outs) == 1 and f_outs[0].finished
        assert all(not o.finished for o in c_outs[:-1]) and c_outs[-1].finished
        expected = summary(c_outs[-1])
        assert summary(f_outs[0]) == expected
        assert summary(merged(d_outs)) == expected
        if stop is None:
            assert all(len(c.token_ids) == TOKENS for c in c_outs[-1].outputs)


def test_delta_outputs_carry_only_new_tokens(loaded):
    delta, engine = run(loaded, RequestOutputKind.DELTA)
    for outs in delta:
        for i in range(2):
            pieces = [c for o in outs for c in o.outputs if c.index == i]
            # every token is delivered exactly once, with its log-prob entry, and the finish once
            assert sum(len(c.token_ids) for c in pieces) == TOKENS
            assert all(len(c.logprobs) == len(c.token_ids) == len(c.raw_logprobs) for c in pieces)
            assert [c.finish_reason for c in pieces].count("length") == 1 and pieces[-1].finish_reason == "length"
            assert max(len(c.token_ids) for c in pieces) <= 2  # one step adds one token (two at the fork)


def test_output_building_is_proportional_to_new_tokens(loaded, monkeypatch):
    """Counted, not timed: log-prob entries built and token names decoded grow with the tokens generated,
    the same for every kind, where rebuilding each step's cumulative output grew with their square."""
    counts = {"entries": 0, "names": 0}
    real_entry = llm_engine_module.logprob_entry
    real_name = LLMEngine.decode_one

    def counting_entry(*args, **kwargs):
        counts["entries"] += 1
        return real_entry(*args, **kwargs)

    def counting_name(self, token):
        counts["names"] += 1
        return real_name(self, token)

    monkeypatch.setattr(llm_engine_module, "logprob_entry", counting_entry)
    monkeypatch.setattr(LLMEngine, "decode_one", counting_name)
    generated = len(PROMPTS) * 2 * TOKENS
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE):
        counts.update(entries=0, names=0)
        run(loaded, kind)
        assert counts["entries"] == generated
        assert generated <= counts["names"] <= generated * (K + 1)


def test_llm_generate_builds_only_final_outputs(loaded, monkeypatch):
    from pagedrl.engine.llm import LLM

    built = []
    real = llm_engine_module.make_output

    def counting(req):
        out = real(req)
        if out is not None:
            built.append(out.finished)
        return out

    monkeypatch.setattr(llm_engine_module, "make_output", counting)
    llm = LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=2048)
    params = SamplingParams(max_tokens=30, ignore_eos=True, n=3, logprobs=2)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert built == [True] * len(PROMPTS)  # one output per request, when it is done
    assert params.output_kind is RequestOutputKind.CUMULATIVE  # the caller's params are left as they were
    assert all(len(c.token_ids) == len(c.logprobs) == 30 for o in outs for c in o.outputs)


def test_n_is_bounded_by_max_num_seqs_and_admission_counts_samples(loaded):
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_cache_tokens=2048, max_num_seqs=4),
                       eos_token_ids=loaded.eos_token_ids)
    with pytest.raises(ValueError, match=r"^n \(5\) exceeds max_num_seqs"):
        engine.add_request(PROMPTS[0], SamplingParams(n=5))
    assert not engine.has_unfinished_requests()
    first = engine.add_request(PROMPTS[0], SamplingParams(n=3, max_tokens=20, ignore_eos=True))
    second = engine.add_request(PROMPTS[1], SamplingParams(n=2, max_tokens=20, ignore_eos=True))
    most = 0
    while engine.has_unfinished_requests():
        engine.step()
        most = max(most, len(engine.scheduler.running))
        if first in engine.requests and second in engine.requests and engine.requests[first].forked:
            # 3 seats taken: the second request's 2 samples wait instead of running 5 sequences
            assert all(s.status.value == "waiting" for s in engine.requests[second].seqs)
    assert most <= 4


def test_detokenize_false_gives_the_same_tokens_with_no_text(loaded, monkeypatch):
    """vLLM's `detokenize=False`: the same tokens and log-probs, prompt log-probs included, but no text
    and no token names, and nothing decoded on the way."""
    with_text, _ = run(loaded, RequestOutputKind.FINAL_ONLY, prompt_logprobs=2)
    names = []
    monkeypatch.setattr(LLMEngine, "decode_one", lambda self, token: names.append(token))
    bare, _ = run(loaded, RequestOutputKind.FINAL_ONLY, prompt_logprobs=2, detokenize=False)
    assert names == []
    for (a,), (b,) in zip(with_text, bare, strict=True):
        assert [p.keys() for p in a.prompt_logprobs[1:]] == [p.keys() for p in b.prompt_logprobs[1:]]
        assert all(lp.decoded_token is None for entry in b.prompt_logprobs[1:] for lp in entry.values())
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert x.text and y.text == "" and x.token_ids == y.token_ids
            assert [{t: lp.logprob for t, lp in e.items()} for e in x.logprobs] == \
                   [{t: lp.logprob for t, lp in e.items()} for e in y.logprobs]
            assert all(lp.decoded_token is None for e in y.logprobs for lp in e.values())
            assert any(lp.decoded_token for e in x.logprobs for lp in e.values())
