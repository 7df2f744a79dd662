"""What a vLLM client or operator relies on beyond the OpenAI shapes, checked on the app in process (no
server process to start): request ids, the model's default sampling settings, the log-prob limit,
special tokens, and vLLM's fields that are refused rather than ignored."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pagedrl.engine.async_engine import AsyncEngine
from pagedrl.engine.llm_engine import EngineConfig, LLMEngine
from pagedrl.model.loader import load_model
from pagedrl.server.app import build_app

PROMPT = "the cat sat on the mat"
CHAT = [{"role": "user", "content": "what is two plus three"}]


@pytest.fixture(scope="module")
def loaded(tiny_train_model):
    return load_model(tiny_train_model, device="cpu")


def app_client(loaded, **app_args: Any) -> Iterator[TestClient]:
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_cache_tokens=2048, max_logprobs=30),
                       eos_token_ids=loaded.eos_token_ids)
    with TestClient(build_app(AsyncEngine(engine), served_model_name="tiny", ui=False, **app_args)) as client:
        yield client


@pytest.fixture(scope="module")
def http(loaded) -> Iterator[TestClient]:
    yield from app_client(loaded, request_id_headers=True)


def complete(http: TestClient, **body: Any) -> Any:
    return http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **body})


def test_a_request_is_named_by_its_x_request_id_else_its_request_id(http):
    r = complete(http, request_id="body-1")
    assert r.json()["id"] == "cmpl-body-1" and len(r.headers["x-request-id"]) == 32  # a fresh one: no header
    # the header wins over the body, and names every chunk
    r = http.post("/v1/completions", headers={"X-Request-Id": "trace-7"},
                  json={"prompt": PROMPT, "max_tokens": 2, "request_id": "body-1", "stream": True})
    ids = {line for line in r.text.splitlines() if line.startswith("data: {")}
    assert ids and all('"id":"cmpl-trace-7"' in line for line in ids) and r.headers["x-request-id"] == "trace-7"
    r = http.post("/v1/chat/completions", headers={"X-Request-Id": "trace-8"}, json={"messages": CHAT, "max_tokens": 2})
    assert r.json()["id"] == "chatcmpl-trace-8" and r.headers["x-request-id"] == "trace-8"
    assert http.get("/health", headers={"X-Request-Id": "h"}).headers["x-request-id"] == "h"


def prompt_tokens_total(http: TestClient) -> float:
    line = next(x for x in http.get("/metrics").text.splitlines() if x.startswith("pagedrl:prompt_tokens_total"))
    return float(line.rsplit(" ", 1)[1])


def test_prompt_tokens_are_counted_per_sample_once_prefilled_as_vllm_counts_them(http, loaded):
    before = prompt_tokens_total(http)
    assert complete(http, n=2, temperature=1.0).status_code == 200
    assert prompt_tokens_total(http) - before == 2 * len(loaded.tokenizer.encode(PROMPT))


@pytest.fixture(scope="module")
def http_defaults(loaded) -> Iterator[TestClient]:
    """A server whose model recommends max_new_tokens 3, and whose operator capped every request at 5."""
    yield from app_client(loaded, sampling_defaults={"max_tokens": 3}, max_tokens_cap=5)


def test_max_tokens_defaults_and_cap_as_vllm_sets_them(http_defaults):
    def length(path: str, **body: Any) -> int:
        body = {"ignore_eos": True, **body}
        r = http_defaults.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["completion_tokens"]

    # /v1/completions' own default (16) wins over the model's 3, and the operator's cap over both
    assert length("/v1/completions", prompt=PROMPT) == 5
    assert length("/v1/completions", prompt=PROMPT, max_tokens=None) == 3  # null: the model's default
    assert length("/v1/completions", prompt=PROMPT, max_tokens=4) == 4
    assert length("/v1/chat/completions", messages=CHAT) == 3
    assert length("/v1/chat/completions", messages=CHAT, max_tokens=9) == 5


def test_max_logprobs_is_the_servers_limit_on_alternatives(http):
    """The engine's max_logprobs (--max-logprobs, 30 here), not OpenAI's 20, bounds both routes and the schema."""
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": 25})
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 25
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "logprobs": True, "top_logprobs": 31})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs", r.text
    r = complete(http, logprobs=31)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs" and "max_logprobs (30)" in r.text
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["logprobs"]["anyOf"][0]["maximum"] == 30
