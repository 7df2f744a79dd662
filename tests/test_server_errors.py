"""Bad input to a real `pagedrl serve` process: each error comes back in OpenAI's JSON shape with the
right status, and after each one the server still gives the right answer to a good request. Ends
with SIGTERM during a stream: the stream is drained and the process exits with status 0."""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
from server_process import running_server

KEY = "sk-test-key"
PROMPT = "the cat sat on the mat"
BODY_LIMIT = 65536


@pytest.fixture(scope="module")
def server(tiny_train_model, tmp_path_factory):
    # one running sequence and one waiting request: a third concurrent request is refused
    with running_server(tiny_train_model, tmp_path_factory.mktemp("serve-errors"), "--api-key", KEY,
                        "--kv-cache-tokens", "2048", "--max-num-seqs", "1", "--max-waiting-requests", "1",
                        "--max-request-body-bytes", str(BODY_LIMIT), "--served-model-name", "tiny",
                        "--allowed-origins", '["https://app.example"]') as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(client):
    """The greedy answer of an idle server, which every later check must reproduce."""
    return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text


@pytest.fixture
def still_serving(client, reference):
    yield
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text == reference


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def test_malformed_json_is_400(http, still_serving):
    for raw in (b"{not json", b"", b"\xff\xfe", b'{"prompt": "x",}'):
        err = error_of(http.post("/v1/completions", content=raw, headers={"content-type": "application/json"}), 400)
        assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    err = error_of(http.post("/v1/completions", json=["a", "list"]), 400)
    assert "JSON object" in err["message"]


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "ten"), ("temperature", "hot"), ("n", 1.5), ("stream", "yes"), ("prompt", {"a": 1}),
    ("prompt", [1, "a"]), ("stop", 3), ("seed", "7"), ("logprobs", True), ("stream_options", {"include_usage": 1}),
])
def test_wrong_types_are_400_naming_the_field(http, still_serving, field, value):
    body = {"model": "tiny", "prompt": PROMPT, field: value}
    err = error_of(http.post("/v1/completions", json=body), 400)
    assert err["param"].split(".")[0] == field, err


@pytest.mark.parametrize("field,value", [
    ("max_tokens", 0), ("n", 0), ("temperature", -1.0), ("top_p", 2.0), ("min_p", 1.5), ("top_k", -5),
    ("presence_penalty", 3.0), ("frequency_penalty", -3.0), ("logprobs", 50), ("stop", [""]),
])
def test_bad_values_are_400_naming_the_field(http, still_serving, field, value):
    err = error_of(http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, field: value}), 400)
    assert err["param"] == field, err
    assert field in err["message"]


def test_bad_token_choices_are_400_naming_the_field(http, still_serving):
    vocab = http.get("/openapi.json").json()["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"][
        "items"]["maximum"] + 1
    for extra, param in (({"logit_bias": {"5": 101}}, "logit_bias.5"), ({"logit_bias": {"x": 1}}, "logit_bias.x"),
                         ({"logit_bias": {str(vocab): 1}}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids"),
                         ({"allowed_token_ids": [vocab + 3]}, "allowed_token_ids"), ({"bad_words": [" "]}, "bad_words.0")):
        err = error_of(http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, **extra}), 400)
        assert err["param"] == param, (extra, err)
        assert param.split(".")[0] in err["message"], err


def test_a_union_field_is_named_where_the_client_went_wrong(http, still_serving):
    # `prompt` is text, texts, token ids or lists of them: the error is the branch the value took
    for prompt, param, words in (([-1], "prompt.0", "greater than or equal to 0"), ([1, "a"], "prompt.1", "integer"),
                                 ([], "prompt", "at least 1")):
        err = error_of(http.post("/v1/completions", json={"model": "tiny", "prompt": prompt}), 400)
        assert err["param"] == param and words in err["message"], (prompt, err)
    err = error_of(http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                      "stream_options": {"include_usage": True}}), 400)
    assert err["param"] == "stream_options"


def test_bad_chat_messages_are_400(http, still_serving):
    for messages, param in (("hello", "messages"), ([], "messages"), ([{"content": "no role"}], "messages.0.role"),
                            ([{"role": "user", "content": [{"type": "image_url"}]}], "messages.0.content.0")):
        err = error_of(http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages}), 400)
        assert err["param"] == param, err
    err = error_of(http.post("/v1/chat/completions", json={"model": "tiny", "messages": [
        {"role": "user", "content": "hi"}], "top_logprobs": 30, "logprobs": True}), 400)
    assert err["param"] == "top_logprobs"


def test_unsupported_fields_are_refused_not_ignored(http, still_serving):
    for field, value in (("suffix", "x"), ("best_of", 3)):
        err = error_of(http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, field: value}), 400)
        assert err["param"] == field


def test_prompt_longer_than_context_is_400_naming_both_lengths(client, http, still_serving):
    max_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    long_prompt = " ".join(["the cat sat on the mat"] * 60)
    n = http.post("/tokenize", json={"prompt": long_prompt}).json()["count"]
    assert n > max_len
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=long_prompt, max_tokens=4)
    err = e.value.body
    assert e.value.status_code == 400 and err["code"] == "context_length_exceeded"
    assert str(n) in err["message"] and str(max_len) in err["message"]
    # prompt fits, prompt + max_tokens does not: the completion ends at the context, as in vLLM
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=max_len, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == max_len
    with pytest.raises(openai.BadRequestError) as e:  # token ids outside the vocabulary
        client.completions.create(model="tiny", prompt=[1, 2, 10**9], max_tokens=4)
    assert "vocabulary" in e.value.body["message"]


def test_missing_or_wrong_api_key_is_401(server, still_serving):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        err = error_of(httpx.post(server.base_url + "/v1/completions", json={"model": "tiny", "prompt": "x"},
                                  headers=headers), 401)
        assert err["code"] == "invalid_api_key"
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
    assert httpx.get(server.base_url + "/health").status_code == 200  # health needs no key
    for method in ("GET", "POST"):  # nor its SageMaker name
        assert httpx.request(method, server.base_url + "/ping").status_code == 200
    assert httpx.get(server.base_url + "/metrics").status_code == 401  # its labels name the served model


def test_only_the_allowed_origin_may_call_from_a_browser(server, still_serving):
    """CORS as vLLM's --allowed-origins: a preflight from the allowed origin passes before the API key
    is asked for (the browser sends the key with the real request); another origin gets no grant."""
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(server.base_url + "/v1/chat/completions", headers={"Origin": "https://app.example", **preflight})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "https://app.example"
    other = httpx.options(server.base_url + "/v1/chat/completions", headers={"Origin": "https://evil.example",
                                                                             **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    real = httpx.get(server.base_url + "/v1/models", headers={"Origin": "https://app.example",
                                                              "Authorization": f"Bearer {KEY}"})
    assert real.status_code == 200 and real.headers["access-control-allow-origin"] == "https://app.example"


def test_no_route_tells_the_served_names_without_the_key(server, http, still_serving):
    """/v1/models asks for the key, so nothing reachable without it lists what the server serves:
    /tokenize and /detokenize (vLLM's, outside /v1) answer an unknown model's 404 without the names."""
    for route, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        anonymous = error_of(httpx.post(server.base_url + route, json={**body, "model": "nope"}), 404)
        assert anonymous["code"] == "model_not_found" and "tiny" not in anonymous["message"]
        known = error_of(http.post(route, json={**body, "model": "nope"}), 404)
        assert "'tiny'" in known["message"]  # with the key, as /v1/models would tell
        assert httpx.post(server.base_url + route, json={**body, "model": "tiny"}).status_code == 200
    assert "tiny" in http.get("/metrics").text


def test_unknown_model_and_route_are_404(client, http, still_serving):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and "gpt-17" in e.value.body["message"]
    error_of(http.get("/v1/no-such-endpoint"), 404)


def test_oversized_body_is_413(http, still_serving):
    body = json.dumps({"model": "tiny", "prompt": "x" * (4 * BODY_LIMIT)}).encode()
    err = error_of(http.post("/v1/completions", content=body, headers={"content-type": "application/json"}), 413)
    assert str(BODY_LIMIT) in err["message"]

    def chunks():  # no Content-Length: the limit holds while reading
        for _ in range(8):
            yield body[: BODY_LIMIT // 2]

    error_of(http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)


def test_bad_tokenize_requests_are_400(http, still_serving):
    error_of(http.post("/detokenize", json={"tokens": [1, -4]}), 400)
    error_of(http.post("/detokenize", json={"tokens": "abc"}), 400)
    error_of(http.post("/tokenize", json={}), 400)


def test_overload_is_503_and_clears(server, client, still_serving):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as a, \
            httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as b:
        with a.stream("POST", "/v1/completions", json=body) as first, \
                b.stream("POST", "/v1/completions", json=body) as second:
            assert first.status_code == second.status_code == 200  # both admitted: one runs, one waits
            with pytest.raises(openai.InternalServerError) as e:
                client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
            assert e.value.status_code == 503 and e.value.body["code"] == "server_overloaded"
            assert e.value.response.headers["retry-after"] == "1"
    assert server.wait_idle()["pagedrl:num_blocks_used"] == 0  # closing both streams aborted both


def test_the_served_schema_and_the_validation_agree(http, still_serving):
    """Bodies schemathesis found where /openapi.json and the server disagreed: each is now either
    valid by the schema and answered 200, or invalid by it and answered 400."""
    import jsonschema_rs

    doc = http.get("/openapi.json").json()

    def valid(model: str, body: dict) -> bool:
        schema = {"$ref": f"#/components/schemas/{model}", "components": doc["components"]}
        return jsonschema_rs.validator_for(schema).is_valid(body)

    vocab = doc["components"]["schemas"]["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] + 1
    chat = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    cases = [  # (route, schema, body, accepted)
        ("/detokenize", "DetokenizeRequest", {"tokens": [5.0, 7]}, True),  # JSON Schema: 5.0 is an integer
        ("/detokenize", "DetokenizeRequest", {"tokens": [vocab - 1]}, True),
        ("/detokenize", "DetokenizeRequest", {"tokens": [vocab]}, False),
        ("/detokenize", "DetokenizeRequest", {"tokens": [5.5]}, False),
        ("/tokenize", "TokenizeRequest", {"prompt": "hi"}, True),
        ("/tokenize", "TokenizeRequest", {"prompt": None, "messages": None}, False),
        ("/tokenize", "TokenizeRequest", {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, False),
        ("/tokenize", "TokenizeRequest", {"messages": [{"role": "user"}]}, False),
        ("/tokenize", "TokenizeRequest", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, False),
        ("/tokenize", "TokenizeRequest", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]},
                                                        {"role": "assistant", "content": None}]}, True),
        ("/v1/completions", "CompletionRequest", {"model": "tiny", "prompt": [vocab], "max_tokens": 1}, False),
        ("/v1/completions", "CompletionRequest", {"model": "tiny", "prompt": PROMPT, "max_tokens": 2.0, "n": 1.0},
         True),
        ("/v1/completions", "CompletionRequest", {"model": "tiny", "prompt": PROMPT, "max_tokens": 1,
                                                  "stop_token_ids": [vocab + 5]}, True),
        # max_tokens is 16 unless given, as in vLLM: a min_tokens above it needs a max_tokens
        ("/v1/completions", "CompletionRequest", {"model": "tiny", "prompt": PROMPT, "min_tokens": 17}, False),
        ("/v1/completions", "CompletionRequest", {"model": "tiny", "prompt": PROMPT, "min_tokens": 16}, True),
        ("/v1/completions", "CompletionRequest", {"model": "tiny", "prompt": PROMPT, "min_tokens": 17,
                                                  "max_tokens": 18}, True),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": chat, "min_tokens": 20}, True),
        # a token id as logit_bias's key: a decimal string within the vocabulary
        ("/v1/completions", "CompletionRequest", {"model": "tiny", "prompt": PROMPT, "max_tokens": 1,
                                                  "logit_bias": {str(vocab - 1): -100, "0": 100}}, True),
        ("/v1/completions", "CompletionRequest", {"model": "tiny", "prompt": PROMPT, "logit_bias": {str(vocab): 1}},
         False),
        ("/v1/completions", "CompletionRequest", {"model": "tiny", "prompt": PROMPT, "logit_bias": {"07": 1}}, False),
        ("/v1/completions", "CompletionRequest", {"model": "tiny", "prompt": PROMPT, "logit_bias": {"7": 100.5}},
         False),
        # stream_options only with stream, prompt_logprobs only without
        ("/v1/completions", "CompletionRequest", {"model": "tiny", "prompt": PROMPT,
                                                  "stream_options": {"include_usage": True}}, False),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": chat, "prompt_logprobs": 1, "stream": True},
         False),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": chat, "prompt_logprobs": 1, "max_tokens": 1},
         True),
        # continuing the final message needs add_generation_prompt false (true by default), as in vLLM
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": chat, "continue_final_message": True}, False),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": chat, "continue_final_message": True,
                                                           "add_generation_prompt": False, "max_tokens": 1}, True),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": chat, "allowed_token_ids": [vocab]}, False),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": chat, "allowed_token_ids": [vocab - 1],
                                                           "max_tokens": 1}, True),
        # without --enable-auto-tool-choice, tools without a tool_choice (i.e. "auto") are refused, as by vLLM
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": chat, "tools": tools}, False),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": chat, "tools": tools, "tool_choice": "auto"},
         False),
        ("/v1/chat/completions", "ChatCompletionRequest", {"messages": chat, "tools": [], "max_tokens": 2}, True),
        ("/tokenize", "TokenizeRequest", {"prompt": "hi", "tools": tools}, False),
        ("/tokenize", "TokenizeRequest", {"messages": chat, "tools": tools}, True),
        ("/tokenize", "TokenizeRequest", {"messages": chat, "continue_final_message": True}, False),
        ("/tokenize", "TokenizeRequest", {"messages": chat, "continue_final_message": True,
                                          "add_generation_prompt": False}, True),
    ]
    for route, model, body, accepted in cases:
        assert valid(model, body) == accepted, (model, body)
        r = http.post(route, json=body)
        assert r.status_code == (200 if accepted else 400), (route, body, r.text)


def test_sigterm_drains_the_stream_in_flight_and_exits_cleanly(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 120, "stream": True, "ignore_eos": True}
    lines = []
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        it = r.iter_lines()
        lines.append(next(it))
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        lines.extend(it)
    stopper.join()
    lines = [line for line in lines if line]
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert lines[-1] == "data: [DONE]"
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert server.proc.returncode == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(server.base_url + "/health", timeout=2)
