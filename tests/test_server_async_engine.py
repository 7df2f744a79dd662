"""The engine thread behind the server, in process: same outputs as the offline engine, steps off the
event loop, aborts applied before the next step, bounded admission, and recovery from a failed step."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pagedrl.engine.async_engine import AsyncEngine, EngineOverloaded, RequestAborted
from pagedrl.engine.llm import LLM
from pagedrl.engine.llm_engine import EngineConfig, LLMEngine
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.loader import load_model

PROMPTS = ["the cat sat on the mat", "a dog ran in the park", "what is two plus three", "hello there"]


@pytest.fixture(scope="module")
def loaded(tiny_train_model):
    return load_model(tiny_train_model, device="cpu")


def make_engine(loaded, **config) -> LLMEngine:
    cfg = EngineConfig(kv_cache_tokens=1024, **config)
    return LLMEngine(loaded.model, loaded.tokenizer, cfg, eos_token_ids=loaded.eos_token_ids)


def run(coro):
    return asyncio.run(coro)


def test_outputs_match_offline_generate_and_steps_run_off_the_event_loop(loaded):
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=1, ignore_eos=True, n=2)
    offline = LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids,
                              kv_cache_tokens=1024)
    expected = [[c.token_ids for c in o.outputs] for o in offline.generate(PROMPTS, params, use_tqdm=False)]
    engine = make_engine(loaded)
    step_threads = set()
    original_step = engine.step

    def recording_step():
        step_threads.add(threading.get_ident())
        return original_step()

    engine.step = recording_step

    async def main():
        aeng = AsyncEngine(engine)
        aeng.start()
        try:
            groups = [await aeng.submit([p], params) for p in PROMPTS]
            finals = await asyncio.gather(*(g.final_outputs() for g in groups))
            return [[c.token_ids for c in f[0].outputs] for f in finals], threading.get_ident()
        finally:
            await aeng.shutdown()

    got, loop_thread = run(main())
    assert got == expected
    assert step_threads and loop_thread not in step_threads
    assert engine.stats()["num_blocks_used"] == 0


def test_abort_frees_blocks_before_the_next_step(loaded):
    engine = make_engine(loaded)
    events: list[tuple] = []  # appended from both threads, in the order things happened
    original_step, original_abort = engine.step, engine.abort_request
    aborted: dict[str, str] = {}

    def recording_step():
        events.append(("step", engine.stats()["num_blocks_used"], aborted.get("id") in engine.requests))
        return original_step()

    def recording_abort(request_id):
        events.append(("abort applied", request_id))
        return original_abort(request_id)

    engine.step, engine.abort_request = recording_step, recording_abort

    async def main():
        aeng = AsyncEngine(engine)
        aeng.start()
        try:
            group = await aeng.submit([PROMPTS[0]], SamplingParams(max_tokens=200, ignore_eos=True))
            aborted["id"] = group.streams[0].request_id
            async for _ in group:
                break
            events.append(("abort called",))
            group.abort()
            await (await aeng.submit([PROMPTS[1]], SamplingParams(max_tokens=3, temperature=0))).final_outputs()
            with pytest.raises(RequestAborted):
                await group.final_outputs()
        finally:
            await aeng.shutdown()

    run(main())
    called = events.index(("abort called",))
    applied = events.index(("abort applied", aborted["id"]))
    # at most the one step already running when abort() was called comes before the abort is applied
    assert len([e for e in events[called:applied] if e[0] == "step"]) <= 1
    later_steps = [e for e in events[applied:] if e[0] == "step"]
    assert later_steps and all(not alive and used <= 1 for _, used, alive in later_steps)
    assert engine.stats()["num_blocks_used"] == 0


def test_admission_is_bounded_and_all_or_nothing(loaded):
    engine = make_engine(loaded, max_num_seqs=2)

    async def main():
        aeng = AsyncEngine(engine, max_waiting_requests=1)
        aeng.start()
        try:
            params = SamplingParams(max_tokens=50, ignore_eos=True)
            with pytest.raises(ValueError, match="at most 3 at once"):
                await aeng.submit(PROMPTS, params)  # 4 prompts > 2 + 1 could never be admitted: none is queued
            assert aeng.num_in_flight == 0
            with pytest.raises(ValueError, match="max_model_len"):
                await aeng.submit(["the cat " * 200], params)
            groups = [await aeng.submit([p], params) for p in PROMPTS[:3]]
            with pytest.raises(EngineOverloaded):
                await aeng.submit([PROMPTS[3]], params)
            for g in groups:
                g.abort()
            again = await aeng.submit([PROMPTS[3]], SamplingParams(max_tokens=2))
            assert len((await again.final_outputs())[0].outputs[0].token_ids) == 2
        finally:
            await aeng.shutdown()

    run(main())


def test_a_failed_step_fails_its_requests_and_the_engine_carries_on(loaded):
    engine = make_engine(loaded)
    original_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return original_step()

    engine.step = flaky_step

    async def main():
        aeng = AsyncEngine(engine)
        aeng.start()
        try:
            group = await aeng.submit(PROMPTS[:2], SamplingParams(max_tokens=20, ignore_eos=True))
            with pytest.raises(RequestAborted, match="boom"):
                await group.final_outputs()
            assert aeng.is_healthy and engine.stats()["num_blocks_used"] == 0
            ok = await aeng.submit([PROMPTS[2]], SamplingParams(max_tokens=4, ignore_eos=True))
            return await ok.final_outputs()
        finally:
            await aeng.shutdown()

    out = run(main())
    assert out[0].finished and len(out[0].outputs[0].token_ids) == 4


def test_what_the_server_reads_comes_from_the_engine(loaded):
    engine = make_engine(loaded, block_size=8)
    aeng = AsyncEngine(engine)
    assert aeng.tokenizer is loaded.tokenizer
    assert (aeng.max_model_len, aeng.vocab_size, aeng.block_size) == (
        engine.max_model_len, loaded.model.config.vocab_size, 8)
