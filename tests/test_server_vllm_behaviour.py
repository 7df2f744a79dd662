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


@pytest.mark.parametrize("field,value,param", [
    ("prompt_embeds", "AAAA", "prompt_embeds"),
    ("thinking_token_budget", 10, "thinking_token_budget"), ("priority", 1, "priority"),
    ("truncation_side", "right", "truncation_side"), ("repetition_detection", {"min_pattern_size": 2}, None),
    ("cache_salt", "s" * 1025, "cache_salt"),  # vLLM's bound
])
def test_vllms_fields_that_would_change_the_answer_are_refused_not_ignored(http, field, value, param):
    body = {"prompt": PROMPT, "max_tokens": 2, field: value}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == (param or field), r.text
    assert complete(http, priority=0, thinking_token_budget=-1, truncation_side="left").status_code == 200


class TemplateRecorder:
    """A tokenizer that records what the chat template is given and whether special tokens are added."""

    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.kwargs: dict[str, Any] = {}
        self.special: list[bool] = []

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> str:
        self.kwargs = kwargs
        return "rendered"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.special.append(add_special_tokens)
        return [0, 5, 6] if add_special_tokens else [5, 6]  # a BOS, as Llama's tokenizers add


def test_documents_reasoning_effort_and_special_tokens_reach_the_prompt_as_in_vllm():
    from pagedrl.server.inputs import chat_inputs, completion_inputs
    from pagedrl.server.protocol import ChatCompletionRequest, CompletionRequest

    tok = TemplateRecorder()
    docs = [{"title": "a", "text": "b"}]
    req = ChatCompletionRequest(messages=CHAT, documents=docs, reasoning_effort="low",
                                chat_template_kwargs={"reasoning_effort": "high", "enable_thinking": False})
    assert chat_inputs(req, tok)[0] == [5, 6] and tok.special == [False]  # the template writes its own
    assert tok.kwargs["documents"] == docs and tok.kwargs["reasoning_effort"] == "low" and not tok.kwargs[
        "enable_thinking"]
    assert chat_inputs(ChatCompletionRequest(messages=CHAT, add_special_tokens=True), tok)[0] == [0, 5, 6]
    assert completion_inputs(CompletionRequest(prompt="hi", add_special_tokens=False), tokenizer=tok)[0] == [[5, 6]]
    assert completion_inputs(CompletionRequest(prompt="hi"), tokenizer=tok)[0] == ["hi"]  # the engine adds the BOS


def test_vllms_server_flags_reach_uvicorn(tmp_path):
    from pagedrl.server.serve import build_parser, ssl_problem, uvicorn_options

    args = build_parser().parse_args(["--uvicorn-log-level", "debug", "--disable-uvicorn-access-log",
                                      "--root-path", "/llm", "--ssl-keyfile", "k.pem", "--ssl-certfile", "c.pem"])
    options = uvicorn_options(args)
    assert (options["log_level"], options["access_log"], options["root_path"]) == ("debug", False, "/llm")
    assert (options["ssl_keyfile"], options["ssl_certfile"]) == ("k.pem", "c.pem")
    assert ssl_problem(args) == "k.pem: no such file (--ssl-keyfile, --ssl-certfile)"
    assert "needs --ssl-certfile" in ssl_problem(build_parser().parse_args(["--ssl-keyfile", "k.pem"]))
    assert ssl_problem(build_parser().parse_args(["--ssl-certfile", __file__])) is None  # the key in the same file


def test_the_document_names_the_root_path_a_proxy_serves_it_under(loaded) -> None:
    """Behind --root-path, the API document's `servers` is that prefix, so a client generated from it
    (or the docs page's "Try it out") calls the paths the proxy serves."""
    engine = LLMEngine(loaded.model, loaded.tokenizer, EngineConfig(kv_cache_tokens=512),
                       eos_token_ids=loaded.eos_token_ids)
    with TestClient(build_app(AsyncEngine(engine), served_model_name="tiny", ui=False), root_path="/llm") as client:
        assert client.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]


def test_a_responses_store_of_no_bytes_is_refused_by_its_flag_before_the_model_loads(capsys) -> None:
    from pagedrl.server.serve import serve_main

    assert serve_main(["/no/such/model", "--enable-responses-store", "--responses-store-bytes", "0"]) == 2
    assert capsys.readouterr().err.strip() == "pagedrl serve: --responses-store-bytes must be positive"


def test_a_background_response_needs_a_server_that_keeps_responses(http) -> None:
    """As vLLM without VLLM_ENABLE_RESPONSES_API_STORE: a 400 naming `background` and the flag that
    allows it, before any engine request starts, and the server serves on."""
    before = prompt_tokens_total(http)
    r = http.post("/v1/responses", json={"input": "x", "background": True, "max_output_tokens": 1})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "background" and "--enable-responses-store" in error["message"]
    served = http.post("/v1/responses", json={"input": "x", "max_output_tokens": 1}).json()
    assert served["status"] == "incomplete"  # the engine (first come, first served) prefilled this one alone
    assert prompt_tokens_total(http) == before + served["usage"]["input_tokens"]
