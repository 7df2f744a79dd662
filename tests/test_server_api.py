"""The OpenAI API of a real `pagedrl serve` process, through the official `openai` client.

The reference for every answer is the offline engine (`LLM.generate` / `LLM.chat`) on the same tiny
model in this process: the server must add nothing and lose nothing on the way (text, token counts,
logprobs, finish reasons, seeded sampling).
"""

from __future__ import annotations

import httpx
import pytest
from server_process import running_server

from pagedrl.engine.llm import LLM
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.model.loader import load_model

PROMPT = "the cat sat on the mat"
CHAT = [{"role": "user", "content": "what is two plus three"}]


@pytest.fixture(scope="module")
def server(tiny_train_model, tmp_path_factory):
    with running_server(tiny_train_model, tmp_path_factory.mktemp("serve-api"), "--kv-cache-tokens", "4096") as s:
        yield s


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def offline(tiny_train_model):
    loaded = load_model(tiny_train_model, device="cpu")
    return LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=4096)


def test_models_health_and_tokenizer_endpoints(server, client, model_name, offline, tiny_train_model):
    assert model_name == str(tiny_train_model)
    card = httpx.get(server.base_url + "/v1/models").json()["data"][0]
    assert card["max_model_len"] == offline.max_model_len
    assert httpx.get(server.base_url + "/health").status_code == 200
    tok = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tok["tokens"] == offline.tokenizer.encode(PROMPT) and tok["count"] == len(tok["tokens"])
    chat_ids = httpx.post(server.base_url + "/tokenize", json={"messages": CHAT}).json()["tokens"]
    template = offline.tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)
    assert chat_ids == offline.tokenizer.encode(template, add_special_tokens=False)
    text = httpx.post(server.base_url + "/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"]
    assert text == offline.tokenizer.decode(tok["tokens"])


def test_tokenize_renders_tools_as_the_chat_route_does(server, model_name):
    """The tools a chat request shows the model count in /tokenize as in the chat route: the tiny model's
    context is too short for the tools' preamble, so the count compared is the one its 400 names."""

    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    plain = httpx.post(server.base_url + "/tokenize", json={"messages": CHAT}).json()["count"]
    counted = httpx.post(server.base_url + "/tokenize", json={"messages": CHAT, "tools": tools}).json()["count"]
    chat = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": model_name, "messages": CHAT, "tools": tools, "tool_choice": "none", "max_tokens": 1}).json()
    assert chat["error"]["code"] == "context_length_exceeded"
    assert counted > plain and f"prompt is {counted} tokens" in chat["error"]["message"]
    with_prompt = httpx.post(server.base_url + "/tokenize", json={"prompt": PROMPT, "tools": tools})
    assert with_prompt.status_code == 400 and with_prompt.json()["error"]["param"] == "tools"


def test_the_chat_page_is_served_at_the_root_and_calls_only_its_own_server(server):
    """`/` is the chat page: one self-contained file whose every fetch, link and source is relative
    (so it only ever talks to the server it came from), pinned by its Content-Security-Policy, and
    which never puts the model's text on the page as HTML."""
    import re

    r = httpx.get(server.base_url + "/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    page = r.text
    assert re.findall(r'fetch\("([^"]+)"', page) == ["v1/models", "v1/chat/completions"]
    assert not re.search(r'(src|href)\s*=\s*"(https?:)?//', page) and "@import" not in page
    assert "connect-src 'self'" in page and "default-src 'self'" in page
    assert "innerHTML" not in page and "insertAdjacentHTML" not in page and "document.write" not in page
    assert "/" not in httpx.get(server.base_url + "/openapi.json").json()["paths"]  # not part of the API


def test_completion_matches_offline_engine_and_usage_matches_tokenizer(client, model_name, offline):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert r.object == "text_completion" and r.model == model_name and len(r.choices) == 1
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(offline.tokenizer.encode(PROMPT))
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_completion_stream_concatenates_to_the_same_text(client, model_name):
    kwargs = dict(model=model_name, prompt=PROMPT, max_tokens=10, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in text_chunks)


def test_raw_stream_ends_with_done(server, model_name):
    body = {"model": model_name, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]" and len(lines) >= 2


def test_chat_matches_offline_engine_streamed_and_not(client, model_name, offline):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    ref = offline.chat(CHAT, params, use_tqdm=False)[0]
    kwargs = dict(model=model_name, messages=CHAT, max_completion_tokens=10, temperature=0,
                  extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**kwargs)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 10

    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == ref.outputs[0].text
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens and chunks[-1].usage.completion_tokens == 10


def test_n2_gives_two_choices_and_counts_both(client, model_name):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, n=2, seed=3, temperature=1.0,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].text != r.choices[1].text  # independent samples of a near-uniform model
    assert r.usage.completion_tokens == 16
    chunks = list(client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=6, n=2, seed=3,
                                                 stream=True, extra_body={"ignore_eos": True}))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason == "length"}
    assert finished == {0, 1}


def test_seed_makes_sampling_reproducible_and_matches_offline(client, model_name, offline):
    kwargs = dict(model=model_name, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.95,
                  extra_body={"ignore_eos": True, "top_k": 50, "min_p": 0.001})
    a = client.completions.create(seed=7, **kwargs).choices[0].text
    b = client.completions.create(seed=7, **kwargs).choices[0].text
    c = client.completions.create(seed=8, **kwargs).choices[0].text
    assert a == b and a != c
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50,
                                                  min_p=0.001, seed=7, ignore_eos=True), use_tqdm=False)[0]
    assert a == ref.outputs[0].text


def test_penalties_reach_the_sampler(client, model_name, offline):
    # greedy decoding of a random model loops on one token; a frequency penalty breaks the loop
    kwargs = dict(max_tokens=16, temperature=0.0, presence_penalty=0.5, frequency_penalty=2.0)
    r = client.completions.create(model=model_name, prompt=PROMPT, extra_body={"ignore_eos": True}, **kwargs)
    ref = offline.generate(PROMPT, SamplingParams(ignore_eos=True, **kwargs), use_tqdm=False)[0].outputs[0]
    plain = offline.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == ref.text
    assert len(set(plain.token_ids)) < len(set(ref.token_ids))


def test_token_choices_reach_the_sampler(client, model_name, offline):
    """logit_bias (OpenAI's, decimal keys), allowed_token_ids and bad_words (vLLM's extras) give what
    the offline engine gives with the same SamplingParams, and change the greedy answer."""
    plain = offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    first = plain.token_ids[0]
    allowed = sorted({5, 9, 40, 100} - {first})
    word = offline.tokenizer.decode(plain.token_ids[:2]).strip() or "cat"
    for body, params in (
            ({"logit_bias": {str(first): -100}}, dict(logit_bias={first: -100.0})),
            ({"extra_body": {"allowed_token_ids": allowed, "ignore_eos": True}}, dict(allowed_token_ids=allowed)),
            ({"extra_body": {"bad_words": [word], "ignore_eos": True}}, dict(bad_words=[word]))):
        extra = body.pop("extra_body", {"ignore_eos": True})
        r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                      extra_body=extra, **body)
        ref = offline.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **params),
                               use_tqdm=False)[0].outputs[0]
        assert r.choices[0].text == ref.text and ref.token_ids != plain.token_ids, params
        if "allowed_token_ids" in params:
            assert set(ref.token_ids) <= set(allowed)


def test_completion_logprobs_match_offline_engine(client, model_name, offline):
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 6
    for i, (token_id, entry) in enumerate(zip(ref.token_ids, ref.logprobs, strict=True)):
        assert lp.token_logprobs[i] == pytest.approx(entry[token_id].logprob, abs=1e-5)
        assert lp.tokens[i] == entry[token_id].decoded_token
        assert 3 <= len(lp.top_logprobs[i]) <= 4
        # greedy: the chosen token is the most likely one
        assert lp.token_logprobs[i] == pytest.approx(max(lp.top_logprobs[i].values()), abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]


def test_chat_logprobs_are_ranked_top_lists(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].token == item.token and item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert item.bytes == list(item.token.encode())


def test_prompt_logprobs_are_the_offline_engines(client, model_name, offline):
    """vLLM's `prompt_logprobs`: per prompt token (None for the first) the token's log-prob, rank and text
    and its best alternatives', keyed by token id; on a completion choice and on a chat response."""
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2),
                           use_tqdm=False)[0]
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2, temperature=0.0,
                                  extra_body={"prompt_logprobs": 2}).model_dump()
    got = r["choices"][0]["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ref.prompt_token_ids)
    for entry, expected in zip(got[1:], ref.prompt_logprobs[1:], strict=True):
        assert {int(t): (e["logprob"], e["rank"], e["decoded_token"]) for t, e in entry.items()} == {
            t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in expected.items()}
    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=1, extra_body={
        "prompt_logprobs": 0}).model_dump()
    entries = chat["prompt_logprobs"]
    assert entries[0] is None and all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in entries[1:])
    assert chat["usage"]["prompt_tokens"] == len(entries)


def test_truncate_prompt_tokens_keeps_the_prompts_end(client, model_name, offline):
    ids = offline.tokenizer.encode(PROMPT)
    r = client.completions.create(model=model_name, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                  extra_body={"truncate_prompt_tokens": 3, "ignore_eos": True})
    ref = offline.generate([ids[-3:]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                           use_tqdm=False)[0].outputs[0]
    assert r.usage.prompt_tokens == 3 and r.choices[0].text == ref.text
    whole = offline.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, truncate_prompt_tokens=-1),
                             use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids  # -1: as many as the context holds


def test_sampled_chat_logprobs_keep_top_logprobs_alternatives(client, model_name):
    # a sampled token outside the top 2 is reported on its own, not as a third alternative
    r = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=12, temperature=1.5, seed=5,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert all(len(item.top_logprobs) == 2 for item in content)
    assert any(item.logprob < item.top_logprobs[1].logprob for item in content)  # some token drawn outside them


def _stop_across_tokens(text: str, tokens: list[str], offsets: list[int]) -> tuple[str, int]:
    """A 2-character stop string made of the end of one token and the start of the next, and the
    offset where it first occurs in the text: it can only be found after both tokens arrived.
    (Tokens named `bytes:...` hold part of a character and are not text.)"""
    for i in range(len(tokens) - 1):
        (a, at_a), (b, offset) = (tokens[i], offsets[i]), (tokens[i + 1], offsets[i + 1])
        whole = not a.startswith("bytes:") and not b.startswith("bytes:") and offset == at_a + len(a)
        if whole and a and b and a.isprintable() and b.isprintable() and "\ufffd" not in a + b and offset > 1:
            stop = a[-1] + b[0]
            if text.find(stop) == offset - 1:
                return stop, offset - 1
    raise AssertionError(f"no usable stop string in {tokens!r}")


def test_stop_string_cuts_text_streamed_and_not(client, model_name):
    base = dict(model=model_name, prompt=PROMPT, max_tokens=24, temperature=1.0, seed=11,
                extra_body={"ignore_eos": True})
    full = client.completions.create(logprobs=0, **base).choices[0]
    stop, at = _stop_across_tokens(full.text, full.logprobs.tokens, full.logprobs.text_offset)
    r = client.completions.create(stop=[stop, "never-generated"], **base).choices[0]
    assert r.text == full.text[:at] and r.finish_reason == "stop" and r.stop_reason == stop
    streamed = list(client.completions.create(stop=stop, stream=True, **base))
    assert "".join(c.choices[0].text for c in streamed) == full.text[:at]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_metrics_use_vllm_names(server, client, model_name):
    client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2)
    m = server.metrics()
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count",
                 "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count"):
        assert "pagedrl:" + name in m, name
    assert m['pagedrl:request_success_total{finished_reason="length"}'] >= 1
    assert m["pagedrl:prefix_cache_hits_total"] > 0  # the same prompt was sent many times
    assert m["pagedrl:time_to_first_token_seconds_count"] == m["pagedrl:e2e_request_latency_seconds_count"]


def test_per_request_token_histograms_count_what_was_asked(server, client, model_name):
    """vLLM's request_prompt_tokens, request_generation_tokens, request_params_n and
    request_time_per_output_token_seconds: one observation per request, of its own numbers."""
    before = server.metrics()
    prompt_len = len(client.completions.create(model=model_name, prompt=PROMPT, max_tokens=1, logprobs=0,
                                               echo=True).choices[0].logprobs.tokens) - 1
    client.completions.create(model=model_name, prompt=PROMPT, max_tokens=5, n=3, extra_body={"ignore_eos": True})
    after = server.metrics()

    def added(name: str) -> float:
        return after["pagedrl:" + name] - before.get("pagedrl:" + name, 0.0)

    assert added("request_prompt_tokens_count") == 2 and added("request_prompt_tokens_sum") == 2 * prompt_len
    assert added("request_generation_tokens_count") == 2 and added("request_generation_tokens_sum") == 1 + 15
    assert added("request_params_n_sum") == 1 + 3 and added('request_params_n_bucket{le="2.0"}') == 1
    assert added("request_time_per_output_token_seconds_count") == 1  # the one-token request has no gap
    assert after['pagedrl:request_prompt_tokens_bucket{le="+Inf"}'] == after["pagedrl:request_prompt_tokens_count"]
