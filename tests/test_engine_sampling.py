"""The engine's sampling behaviour: seeds, the logprob contract, n > 1 forks, stops, bad input."""

from __future__ import annotations

import threading

import decoder_bound
import pytest
import torch
from test_engine_greedy import engine_for, prompts
from tiny import FAMILIES, MOE_FAMILIES, hf_model

from pagedrl.engine.logits_processing import processed_logprobs
from pagedrl.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def hf():
    return hf_model(FAMILIES["qwen2-bias-tied"])


def test_seeded_requests_reproduce_across_batch_compositions(hf) -> None:
    batch = prompts(hf.config.vocab_size)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=10, seed=1234, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True)
    alone = engine_for(hf).generate([batch[1]], seeded, use_tqdm=False)[0].outputs[0].token_ids
    crowd = engine_for(hf, max_num_batched_tokens=19).generate(
        [batch[0], batch[3], batch[1], batch[5]], [other, other, seeded, other], use_tqdm=False)
    assert crowd[2].outputs[0].token_ids == alone
    reversed_order = engine_for(hf, seed=7).generate([batch[1], batch[4]], [seeded, other], use_tqdm=False)
    assert reversed_order[0].outputs[0].token_ids == alone


def test_processed_logprobs_equal_dense_recompute(hf) -> None:
    """The logprob contract: what the engine reports for each sampled token is the log-prob under the
    distribution it was drawn from, which the training forward reproduces with the same settings."""
    assert_logprob_contract(hf)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_processed_logprobs_equal_dense_recompute_with_experts(family: str) -> None:
    """The contract for a mixture of experts, whose rows are grouped by expert differently in the
    engine's batches and in the training forward."""
    assert_logprob_contract(hf_model(FAMILIES[family]))


def assert_logprob_contract(hf) -> None:
    model_llm = engine_for(hf)
    model = model_llm.engine.model
    params = SamplingParams(temperature=0.7, top_p=0.8, top_k=50, max_tokens=16, seed=3, n=2, ignore_eos=True)
    batch = prompts(hf.config.vocab_size)[:3]
    outs = model_llm.generate(batch, params, use_tqdm=False)
    decided = total = 0
    for prompt, out in zip(batch, outs, strict=True):
        for comp in out.outputs:
            ids = torch.tensor([prompt + comp.token_ids])
            with torch.no_grad():
                logits = model.logits(model(ids))[0, len(prompt) - 1:-1]
            tokens = torch.tensor(comp.token_ids)
            dense = processed_logprobs(logits, tokens, temperature=0.7, top_k=50, top_p=0.8)
            raw = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
            # both within float32's bound of the exact log-probs (`decoder_bound`, ~3e-5 here); a
            # top-k/top-p cut float32 rounding could move (the bound is infinite there) is left out
            exact, bound = decoder_bound.completion_logprobs(model, prompt, comp.token_ids, temperature=0.7,
                                                             top_k=50, top_p=0.8)
            for got in (torch.tensor(comp.processed_logprobs), dense):
                assert ((got.double() - exact).abs() <= bound).all()
            exact, bound = decoder_bound.completion_logprobs(model, prompt, comp.token_ids)
            for got in (torch.tensor(comp.raw_logprobs), raw):
                assert ((got.double() - exact).abs() <= bound).all()
            decided, total = decided + int(torch.isfinite(bound).sum()), total + len(tokens)
    assert decided >= 0.9 * total  # not vacuous


def test_n_samples_fork_the_prompt_blocks(hf) -> None:
    llm = engine_for(hf, block_size=4)
    prompt = prompts(hf.config.vocab_size)[5]  # 61 tokens: a partial last block to copy on write
    params = SamplingParams(n=6, temperature=1.0, max_tokens=5, seed=0, ignore_eos=True)
    engine = llm.engine
    engine.add_request(prompt, params, request_id="r")
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        peak = max(peak, engine.kv_manager.num_blocks_used)
    prompt_blocks = len(prompt) // 4 + 1
    # The prompt's blocks once, plus per sample at most the copied partial block and its new blocks.
    assert peak <= prompt_blocks + 6 * 2
    assert peak < 6 * prompt_blocks


def test_stop_strings_token_ids_and_min_tokens(hf) -> None:
    llm = engine_for(hf)
    prompt = prompts(hf.config.vocab_size)[2]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    stop_tok = tokens[4]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    first = tokens.index(stop_tok)
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_tok
    late = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, min_tokens=first + 2,
                                                 stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert len(late.token_ids) >= first + 2
    assert free[0].outputs[0].finish_reason == "length"


def test_bad_input_raises_and_engine_keeps_serving(hf) -> None:
    llm = engine_for(hf, max_model_len=64)
    good = prompts(hf.config.vocab_size)[0]
    vocab = hf.config.vocab_size
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 211\)"):
        llm.generate([good + [vocab]], SamplingParams())
    with pytest.raises(ValueError, match="-1"):
        llm.generate([[-1, 5]], SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([list(range(3, 70))], SamplingParams())
    # a max_tokens past the context is not an error (vLLM's rule): the completion ends at the context
    (past,) = llm.generate([good], SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert past.outputs[0].finish_reason == "length" and len(good) + len(past.outputs[0].token_ids) == 64
    with pytest.raises(ValueError, match="no room for a completion token"):
        llm.generate([list(range(3, 67))], SamplingParams())
    for bad in (dict(max_tokens=0), dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(n=0)):
        name = next(iter(bad))
        with pytest.raises(ValueError, match=name):
            SamplingParams(**bad)
    # A batch with one bad prompt is rejected whole and leaves nothing behind.
    with pytest.raises(ValueError):
        llm.generate([good, [vocab + 5]], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([good], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.stats()["num_blocks_used"] == 0


def test_stats_are_readable_while_generating(hf) -> None:
    llm = engine_for(hf)
    seen: list[dict] = []
    stop = threading.Event()

    def poll() -> None:  # a read each millisecond: spinning on the GIL slowed the generation 20x
        while not stop.wait(0.001):
            seen.append(llm.stats())

    t = threading.Thread(target=poll)
    t.start()
    try:
        llm.generate(prompts(hf.config.vocab_size), SamplingParams(max_tokens=20, ignore_eos=True), use_tqdm=False)
    finally:
        stop.set()
        t.join()
    keys = {"num_blocks_total", "num_blocks_used", "num_blocks_cached", "prefix_cache_queries",
            "prefix_cache_hits", "num_preemptions", "generation_tokens"}
    assert seen and keys <= set(seen[-1])
    assert max(s["num_blocks_used"] for s in seen) > 0
    assert llm.stats()["generation_tokens"] == 6 * 20


def test_what_callers_read_and_reseeding(hf) -> None:
    llm = engine_for(hf, block_size=8, max_model_len=64)
    assert (llm.block_size, llm.max_model_len, llm.vocab_size) == (8, 64, hf.config.vocab_size)
    batch = prompts(hf.config.vocab_size)[:3]
    unseeded = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)

    def draw(seed: int) -> list[list[int]]:
        llm.reseed(seed)
        return [o.outputs[0].token_ids for o in llm.generate(batch, unseeded, use_tqdm=False)]

    first = draw(5)
    assert draw(5) == first  # the same stream again
    assert draw(6) != first
    assert llm.stats()["prompt_tokens"] == 3 * sum(len(p) for p in batch)


def test_a_step_observer_sees_every_step_until_removed(hf) -> None:
    """`add_step_observer`: called once per step with the engine and that step's outputs (the
    finished requests among them); removing it stops the calls."""
    llm = engine_for(hf)
    seen: list[tuple[int, list[str]]] = []
    stop = llm.engine.add_step_observer(lambda engine, outputs: seen.append(
        (len(engine.block_tables()), [o.request_id for o in outputs if o.finished])))
    before = llm.engine.num_steps
    outs = llm.generate(prompts(hf.config.vocab_size)[:3], SamplingParams(max_tokens=5, ignore_eos=True),
                        use_tqdm=False)
    assert len(seen) == llm.engine.num_steps - before > 0
    assert sorted(rid for _, done in seen for rid in done) == sorted(o.request_id for o in outs)
    assert max(n for n, _ in seen) > 0
    stop()
    calls = len(seen)
    llm.generate(prompts(hf.config.vocab_size)[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(seen) == calls
