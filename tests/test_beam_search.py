"""`LLM.beam_search` against a plain beam search written here over transformers' float64 logits, following
vLLM's rules (2 * beam_width candidates a beam, EOS completes a beam, the best beam_width by cumulative
log-prob live on, the final ranking by get_beam_search_score): the same tokens, the same cumulative
log-probs, for several widths, with EOS inside and length penalties other than 1."""

from __future__ import annotations

import pytest
import torch
from test_engine_greedy import engine_for
from tiny import FAMILIES, hf_model

from pagedrl.engine.beam_search import BeamSearchParams, get_beam_search_score
from pagedrl.engine.request_stream import RequestFailed
from pagedrl.engine.sampling_params import SamplingParams

EOS = 2
MAX_NEW = 5


def reference(hf64: torch.nn.Module, prompt: list[int], width: int, max_tokens: int, length_penalty: float,
              ignore_eos: bool = False, allowed: list[int] | None = None) -> list[tuple[list[int], float]]:
    """The best `width` (tokens, cumulative log-prob) of a beam search over float64 log-softmax, each beam's
    logits from a whole forward of its tokens (no cache). With `allowed` (vLLM's rule), the candidates are
    every allowed token of a list of at most 128, else the allowed ones among the 2 * width most likely."""
    beams: list[tuple[list[int], float]] = [(prompt, 0.0)]
    completed: list[tuple[list[int], float]] = []

    def score(beam: tuple[list[int], float]) -> float:
        tokens, cum = beam
        return cum / (len(tokens) - (tokens[-1] == EOS)) ** length_penalty

    for _ in range(max_tokens):
        candidates = []
        for tokens, cum in beams:
            with torch.no_grad():
                logp = hf64(torch.tensor([tokens])).logits[0, -1].log_softmax(-1)
            if allowed is not None and len(allowed) <= 128:
                pairs = [(logp[t].item(), t) for t in allowed]
            else:
                top = logp.topk(2 * width)
                pairs = [(v, t) for v, t in zip(top.values.tolist(), top.indices.tolist(), strict=True)
                         if allowed is None or t in allowed]
            for value, token in pairs:
                new = (tokens + [token], cum + value)
                (completed if token == EOS and not ignore_eos else candidates).append(new)
        beams = sorted(candidates, key=lambda b: b[1], reverse=True)[:width]
    return sorted(completed + beams, key=score, reverse=True)[:width]


@pytest.fixture(scope="module")
def models():
    hf = hf_model(FAMILIES["llama-gqa-untied"])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist() for n in (21, 7)]
    return hf, hf.double(), engine_for(hf_model(FAMILIES["llama-gqa-untied"]), kv_cache_tokens=1024), prompts


@pytest.mark.parametrize("width,length_penalty", [(1, 1.0), (2, 0.5), (4, 2.0), (4, 1.0)])
def test_beam_search_equals_a_float64_reference(models, width, length_penalty):
    _, hf64, llm, prompts = models
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_NEW, length_penalty=length_penalty)
    outs = llm.beam_search(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        ref = reference(hf64, prompt, width, MAX_NEW, length_penalty)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in ref]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([cum for _, cum in ref], abs=1e-4)
        assert all(len(s.logprobs) == len(s.tokens) - len(prompt) for s in out.sequences)
        scores = [get_beam_search_score(s.tokens, s.cum_logprob, EOS, length_penalty) for s in out.sequences]
        assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("width,many", [(2, False), (4, False), (3, True)])
def test_allowed_token_ids_are_each_beams_only_candidates(models, width, many):
    """A short list: every allowed token is a candidate, however unlikely (vLLM asks for their log-probs by
    id); a list over 128: the allowed ones among the 2 * width most likely."""
    hf, hf64, llm, prompts = models
    g = torch.Generator().manual_seed(width)
    vocab = hf.config.vocab_size
    allowed = torch.randperm(vocab, generator=g)[: 200 if many else 9].tolist()
    allowed = [EOS] + [t for t in allowed if t != EOS]
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_NEW, length_penalty=0.5, allowed_token_ids=allowed)
    for prompt, out in zip(prompts, llm.beam_search(prompts, params), strict=True):
        ref = reference(hf64, prompt, width, MAX_NEW, 0.5, allowed=allowed)
        assert [s.tokens for s in out.sequences] == [tokens for tokens, _ in ref]
        assert [s.cum_logprob for s in out.sequences] == pytest.approx([cum for _, cum in ref], abs=1e-4)
        assert all(set(s.tokens[len(prompt):]) <= set(allowed) for s in out.sequences)
    plain = llm.beam_search(prompts, BeamSearchParams(beam_width=width, max_tokens=MAX_NEW, length_penalty=0.5))
    assert [[s.tokens for s in o.sequences] for o in plain] != \
        [[s.tokens for s in o.sequences] for o in llm.beam_search(prompts, params)]  # the list changed the search


def test_eos_ends_beams_inside_the_search(models):
    """The cases above hold beams that end at EOS before max_tokens (else EOS would go untested)."""
    _, _, llm, prompts = models
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=MAX_NEW, length_penalty=0.5))
    ended = [s for out in outs for s in out.sequences if s.tokens[-1] == EOS]
    assert ended and all(len(s.tokens) - len(p) < MAX_NEW for s, p in zip(ended, prompts, strict=False))
    ignored = llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=MAX_NEW, ignore_eos=True))
    assert all(len(s.tokens) == len(p) + MAX_NEW for out, p in zip(ignored, prompts, strict=True) for s in out.sequences)


def test_width_one_without_eos_is_greedy_generate(models):
    _, hf64, llm, prompts = models
    beam = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=MAX_NEW, ignore_eos=True))
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=0),
                          use_tqdm=False)
    for prompt, b, g in zip(prompts, beam, greedy, strict=True):
        (seq,) = b.sequences
        assert seq.tokens == prompt + g.outputs[0].token_ids
        assert seq.cum_logprob == pytest.approx(g.outputs[0].cumulative_logprob, abs=1e-5)
        ref = reference(hf64, prompt, 1, MAX_NEW, 1.0, ignore_eos=True)
        assert seq.tokens == ref[0][0]


def test_beams_share_their_prefix_blocks(models):
    """Every step after the first finds each beam's prompt blocks in the prefix cache."""
    _, _, llm, prompts = models
    before = llm.stats()["prefix_cache_hits"]
    llm.beam_search([prompts[0]], BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True))
    block = llm.block_size
    assert llm.stats()["prefix_cache_hits"] - before >= 2 * 2 * (len(prompts[0]) // block) * block


def test_salted_prompts_and_a_concurrency_limit_find_the_same_beams(models):
    _, _, llm, prompts = models
    params = BeamSearchParams(beam_width=2, max_tokens=3)
    plain = llm.beam_search(prompts, params)
    salted = llm.beam_search([{"prompt_token_ids": p, "cache_salt": "s"} for p in prompts], params, concurrency_limit=1)
    assert [[(s.tokens, s.cum_logprob) for s in o.sequences] for o in salted] == \
        [[(s.tokens, pytest.approx(s.cum_logprob, abs=1e-5)) for s in o.sequences] for o in plain]


def fail_the_nth_finished_request(engine, n: int) -> None:
    """Make `engine.step` end its n-th finished request as the engine ends one whose logits went NaN:
    finish_reason "error", no token, the reason in `error`."""
    step, finished = engine.step, []

    def failing_step() -> list:
        outs = step()
        for out in outs:
            if out.finished:
                finished.append(out.request_id)
                if len(finished) == n:
                    c = out.outputs[0]
                    c.finish_reason, c.error, c.token_ids, c.logprobs = "error", "logits are NaN", [], None
        return outs

    engine.step = failing_step


def test_a_beam_whose_request_fails_fails_the_search(models):
    """As vLLM's server stops the search: `LLM.beam_search` raises, rather than ranking the other beams."""
    _, _, llm, prompts = models
    fail_the_nth_finished_request(llm.engine, 3)
    try:
        with pytest.raises(RequestFailed, match="failed a beam's request: logits are NaN"):
            llm.beam_search(prompts, BeamSearchParams(beam_width=2, max_tokens=4))
    finally:
        del llm.engine.step  # the instance's own step again
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("field,value", [("beam_width", 0), ("max_tokens", 0), ("temperature", -1.0),
                                         ("length_penalty", float("nan")), ("beam_width", 1.5),
                                         ("allowed_token_ids", []), ("allowed_token_ids", [-2])])
def test_bad_params_name_the_field(field, value):
    kwargs = dict(beam_width=2, max_tokens=4)
    kwargs[field] = value
    with pytest.raises(ValueError, match=f"BeamSearchParams.{field}"):
        BeamSearchParams(**kwargs)


def test_a_width_over_max_logprobs_is_refused(models):
    _, _, llm, prompts = models
    with pytest.raises(ValueError, match="beam_width 11"):
        llm.beam_search(prompts, BeamSearchParams(beam_width=11, max_tokens=2))
    # a short allowed list asks for its ids' log-probs, not 2 * beam_width alternatives
    out = llm.beam_search(prompts[:1], BeamSearchParams(beam_width=11, max_tokens=2, allowed_token_ids=list(range(3, 40))))
    assert len(out[0].sequences) == 11


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_the_servers_answer_is_the_same_beams_as_completions(models, include_stop_str_in_output):
    """vLLM's server shape: each choice the completion's tokens (EOS only with include_stop_str_in_output),
    finish_reason "stop" with EOS as stop_reason, else "length"."""
    import asyncio

    from pagedrl.engine.beam_search import step_params
    from pagedrl.server.beam_search import run_beam_search

    _, _, llm, prompts = models
    beam = BeamSearchParams(beam_width=2, max_tokens=MAX_NEW, length_penalty=0.5,
                            include_stop_str_in_output=include_stop_str_in_output)

    async def run_step(step_prompts):
        return llm.generate(step_prompts, step_params(beam), use_tqdm=False)

    answers = asyncio.run(run_beam_search(prompts, beam, run_step, [EOS], llm.max_model_len, "x", None))
    offline = llm.beam_search(prompts, beam)
    for prompt, answer, out in zip(prompts, answers, offline, strict=True):
        assert answer.prompt_token_ids == prompt
        for c, s in zip(answer.outputs, out.sequences, strict=True):
            ended = s.tokens[-1] == EOS
            keep = len(s.tokens) if include_stop_str_in_output or not ended else -1
            assert c.token_ids == s.tokens[len(prompt):keep] and c.cumulative_logprob == s.cum_logprob
            assert (c.finish_reason, c.stop_reason) == (("stop", EOS) if ended else ("length", None))
    assert any(c.finish_reason == "stop" for a in answers for c in a.outputs)
