"""`use_beam_search` on the app in process: which request fields it refuses (those it would not apply, set to
a value that asks for something) and which it lets through (left out, or set to a value that asks for
nothing), and `--enable-log-requests` logging a search once, with its BeamSearchParams, not each step."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from pagedrl.engine.async_engine import AsyncEngine
from pagedrl.engine.beam_search import BeamSearchParams
from pagedrl.engine.llm import LLM
from pagedrl.engine.llm_engine import EngineConfig, LLMEngine
from pagedrl.model.loader import load_model
from pagedrl.server.app import build_app

BEAM = {"use_beam_search": True, "n": 2, "max_tokens": 3, "temperature": 0}
CHAT = {**BEAM, "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {**BEAM, "prompt": "the cat sat"}


@pytest.fixture(scope="module")
def http(tiny_train_model) -> Iterator[TestClient]:
    loaded = load_model(tiny_train_model, device="cpu")
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_cache_tokens=2048),
                       eos_token_ids=loaded.eos_token_ids)
    app = build_app(AsyncEngine(engine), served_model_name="tiny", ui=False, enable_log_requests=True)
    with TestClient(app) as client:
        yield client


@pytest.mark.parametrize("route,body,param", [
    ("completions", {"logprobs": 0}, "logprobs"),  # the sampled token's log-prob: asked for, never given
    ("completions", {"top_p": 0.9}, "top_p"),
    ("completions", {"top_k": 5}, "top_k"),
    ("completions", {"min_p": 0.1}, "min_p"),
    ("completions", {"seed": 3}, "seed"),
    ("completions", {"logprob_token_ids": [1, 2]}, "logprob_token_ids"),
    ("completions", {"logit_bias": {"1": 5}}, "logit_bias"),
    ("completions", {"stop": ["x"]}, "stop"),
    ("chat/completions", {"logprobs": True}, "logprobs"),
    ("chat/completions", {"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tools"),
])
def test_a_field_beam_search_would_not_apply_is_a_400_naming_it(http, route, body, param):
    base = CHAT if route.startswith("chat") else COMPLETION
    r = http.post(f"/v1/{route}", json={**base, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "use_beam_search" in r.json()["error"]["message"]


@pytest.mark.parametrize("route,body", [
    ("completions", {"logit_bias": {}, "stop": [], "stop_token_ids": [], "bad_words": [], "echo": False}),
    ("completions", {"top_p": 1, "top_k": -1, "min_p": 0, "seed": -1, "min_tokens": 0, "logprobs": None}),
    ("completions", {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1}),
    ("chat/completions", {"logprobs": False, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}}),
])
def test_a_value_that_asks_for_nothing_is_the_same_search(http, route, body):
    base = CHAT if route.startswith("chat") else COMPLETION
    plain = http.post(f"/v1/{route}", json=base)
    r = http.post(f"/v1/{route}", json={**base, **body})
    assert plain.status_code == r.status_code == 200, r.text
    assert r.json()["choices"] == plain.json()["choices"] and len(r.json()["choices"]) == 2


def test_a_search_is_logged_once_with_its_own_params(http, caplog):
    with caplog.at_level(logging.INFO, logger="pagedrl.server.requests"):
        r = http.post("/v1/completions", json={**COMPLETION, "max_tokens": 6, "request_id": "beam-log",
                                               "ignore_eos": True})
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json={**CHAT, "request_id": "beam-chat"})
        assert r.status_code == 200, r.text
    received = [r for r in caplog.records if r.msg.startswith("Received request")]
    assert [r.args[0] for r in received] == ["cmpl-beam-log", "chatcmpl-beam-chat"]
    params = [str(r.args[1]) for r in received]
    assert params[0].startswith("BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True, temperature=0")
    assert params[1].startswith("BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=False")


def test_allowed_token_ids_is_applied_as_the_offline_search_applies_it(http, tiny_train_model):
    """vLLM's beam search applies allowed_token_ids: the server's beams are the offline search's, each token
    allowed; an id outside the vocabulary is a 400 naming the field."""
    loaded = load_model(tiny_train_model, device="cpu")
    llm = LLM.from_module(loaded.model, loaded.tokenizer, eos_token_ids=loaded.eos_token_ids, kv_cache_tokens=1024)
    allowed = [7, 11, 42, 99, 180]
    r = http.post("/v1/completions", json={**COMPLETION, "allowed_token_ids": allowed, "return_token_ids": True})
    assert r.status_code == 200, r.text
    prompt = loaded.tokenizer.encode("the cat sat")
    (out,) = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3, temperature=0,
                                                        allowed_token_ids=allowed))
    assert [c["token_ids"] for c in r.json()["choices"]] == [s.tokens[len(prompt):] for s in out.sequences]
    assert all(set(c["token_ids"]) <= set(allowed) for c in r.json()["choices"])
    r = http.post("/v1/completions", json={**COMPLETION, "allowed_token_ids": [7, 10**6]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
