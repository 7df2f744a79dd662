"""A real `pagedrl serve` process under concurrent load: streamed, non-streamed and cancelled requests
at once, with a KV cache small enough to force preemption. Every request must end correctly, and
afterwards no KV block may be held by a request (blocks kept only as prefix cache are free)."""

from __future__ import annotations

import asyncio

import openai
import pytest
from server_process import running_server

PROMPTS = ["the cat sat on the mat", "a dog ran in the park", "what is two plus three", "hello there",
           "red green blue yellow", "one two three four five six"]
LONG = 200  # tokens a cancelled request would generate if it were not aborted


@pytest.fixture(scope="module")
def server(tiny_train_model, tmp_path_factory):
    # 32 sequences per step and 512 KV tokens: most requests wait, and running ones get preempted.
    with running_server(tiny_train_model, tmp_path_factory.mktemp("serve-load"), "--kv-cache-tokens", "512",
                        "--max-num-seqs", "32", "--max-waiting-requests", "512") as s:
        yield s


async def non_streamed(client, model, i):
    n_tokens = 8 + i % 17
    r = await client.completions.create(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=n_tokens,
                                        temperature=0.8, seed=i, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == n_tokens
    return "non-streamed"


async def streamed_chat(client, model, i):
    n_tokens = 6 + i % 13
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], max_tokens=n_tokens,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = [c async for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == n_tokens
    return "streamed"


async def streamed_n2(client, model, i):
    stream = await client.completions.create(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=10, n=2,
                                             stream=True, extra_body={"ignore_eos": True})
    finished = {c.choices[0].index async for c in stream if c.choices[0].finish_reason == "length"}
    assert finished == {0, 1}
    return "streamed-n2"


async def cancelled_stream(client, model, i):
    stream = await client.completions.create(model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=LONG,
                                             stream=True, extra_body={"ignore_eos": True})
    seen = 0
    async for chunk in stream:
        assert chunk.choices[0].finish_reason is None
        seen += 1
        if seen == 3:
            break
    await stream.close()
    return "cancelled-stream"


async def cancelled_request(client, model, i):
    task = asyncio.ensure_future(client.completions.create(
        model=model, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=LONG, extra_body={"ignore_eos": True}))
    await asyncio.sleep(0.05 + 0.01 * (i % 5))
    task.cancel()
    try:
        await task
        return "cancelled-late"  # finished before the cancel: also a correct end
    except asyncio.CancelledError:
        return "cancelled-request"


KINDS = [non_streamed] * 4 + [streamed_chat] * 4 + [cancelled_stream] * 2 + [streamed_n2, cancelled_request]


async def run_load(base_url: str, model: str, num_requests: int) -> list[str]:
    async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        jobs = [KINDS[i % len(KINDS)](client, model, i) for i in range(num_requests)]
        return await asyncio.gather(*jobs)


def test_concurrent_mixed_requests_all_end_and_free_every_block(server):
    model = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused").models.list().data[0].id
    before = server.metrics()
    results = asyncio.run(run_load(server.base_url, model, 120))
    assert len(results) == 120
    assert results.count("cancelled-stream") == 20 and results.count("non-streamed") == 40
    after = server.wait_idle()
    assert after["pagedrl:num_blocks_used"] == 0
    assert after["pagedrl:kv_cache_usage_perc"] == 0
    aborted = after['pagedrl:request_success_total{finished_reason="abort"}'] - \
        before['pagedrl:request_success_total{finished_reason="abort"}']
    # A cancelled stream ends as an abort, or as "length" when the engine generated its last token before
    # the hang-up reached the server (a busy event loop can take longer to see it than the tiny model
    # takes for LONG tokens): both are correct ends, and the sum below counts each request once.
    # `test_disconnect_aborts_the_request_at_once` pins that a hang-up aborts, on a quiet server.
    assert aborted >= 1
    finished = after['pagedrl:request_success_total{finished_reason="length"}'] - \
        before['pagedrl:request_success_total{finished_reason="length"}']
    # a request cancelled before its body reached the server is never seen by it
    assert 120 - results.count("cancelled-request") <= finished + aborted <= 120
    assert after["pagedrl:num_preemptions_total"] > 0  # the small cache was really contended
    # the server still answers, and correctly, after the storm
    r = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused").completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=5, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_disconnect_aborts_the_request_at_once(server):
    model = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused").models.list().data[0].id
    server.wait_idle()
    before = server.metrics()

    async def one():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
            return await cancelled_stream(client, model, 0)

    assert asyncio.run(one()) == "cancelled-stream"
    after = server.wait_idle()
    assert after["pagedrl:num_blocks_used"] == 0
    assert after['pagedrl:request_success_total{finished_reason="abort"}'] == \
        before['pagedrl:request_success_total{finished_reason="abort"}'] + 1
    assert after['pagedrl:request_success_total{finished_reason="length"}'] == \
        before['pagedrl:request_success_total{finished_reason="length"}']
    generated = after["pagedrl:generation_tokens_total"] - before["pagedrl:generation_tokens_total"]
    assert 3 <= generated < LONG


def test_disconnect_of_a_non_streamed_request_aborts_it(server):
    model = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused").models.list().data[0].id
    server.wait_idle()
    before = server.metrics()

    async def one():
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as client:
            task = asyncio.ensure_future(client.completions.create(
                model=model, prompt=PROMPTS[0], max_tokens=240, n=4, extra_body={"ignore_eos": True}))
            while server.metrics()["pagedrl:generation_tokens_total"] == before["pagedrl:generation_tokens_total"]:
                await asyncio.sleep(0.01)  # wait until it is generating, then hang up
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(one())
    after = server.wait_idle()
    assert after["pagedrl:num_blocks_used"] == 0
    assert after['pagedrl:request_success_total{finished_reason="abort"}'] == \
        before['pagedrl:request_success_total{finished_reason="abort"}'] + 1
    assert after["pagedrl:generation_tokens_total"] - before["pagedrl:generation_tokens_total"] < 4 * 240
