"""No request can take a real `pagedrl serve` process down: `n` is capped, admission counts sequences
(a request with n samples counts n), a refused request is answered at once while others keep flowing,
and past `--shutdown-timeout` every response still ends in OpenAI's shape."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from server_process import running_server

PROMPT = "the cat sat on the mat"
MAX_NUM_SEQS = 4
MAX_N = 8


@pytest.fixture(scope="module")
def server(tiny_train_model, tmp_path_factory):
    # 4 running + 4 waiting sequences in flight at most
    with running_server(tiny_train_model, tmp_path_factory.mktemp("serve-limits"), "--kv-cache-tokens", "4096",
                        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", "4",
                        "--max-n", str(MAX_N), "--no-ui") as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    return r.json()["error"]


def stream_events(r: httpx.Response) -> tuple[list[dict], list[str]]:
    lines = [line for line in r.iter_lines() if line]
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")], lines


def test_no_ui_leaves_the_root_unanswered(server, http):
    r = http.get("/")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_huge_n_is_400_at_once_while_other_requests_flow(server, http):
    body = {"prompt": PROMPT, "max_tokens": 60, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as other, other.stream("POST", "/v1/completions",
                                                                                   json=body) as r:
        assert r.status_code == 200
        for n in (1099511627776, 10**30, MAX_N + 1):
            t0 = time.monotonic()
            err = error_of(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "n": n}), 400)
            assert time.monotonic() - t0 < 1.0
            assert err["param"] == "n" and str(MAX_N) in err["message"]
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "n": 1099511627776}
        assert error_of(http.post("/v1/chat/completions", json=chat), 400)["param"] == "n"
        # allowed by --max-n but more than one engine step runs side by side: refused, naming both
        err = error_of(http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "n": MAX_NUM_SEQS + 1}),
                       400)
        assert err["param"] == "n" and "max_num_seqs" in err["message"]
        # each prompt fits a step, but together they are more sequences than the server ever holds
        # (4 running + 4 waiting): a 400 naming the limit, not a 503 a client would retry forever
        err = error_of(http.post("/v1/completions", json={"prompt": ["Hi"] * 3, "max_tokens": 1, "n": MAX_NUM_SEQS}),
                       400)
        assert err["param"] == "n" and "at most 8 at once" in err["message"]
        assert http.get("/health", timeout=1).status_code == 200
        ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        events, lines = stream_events(r)
    assert lines[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "length"
    assert server.wait_idle()["pagedrl:num_blocks_used"] == 0


def test_admission_counts_sequences_not_requests(server, http):
    body = {"prompt": PROMPT, "max_tokens": 150, "stream": True, "ignore_eos": True, "n": MAX_NUM_SEQS}
    with httpx.Client(base_url=server.base_url, timeout=60) as a, httpx.Client(base_url=server.base_url,
                                                                               timeout=60) as b:
        with a.stream("POST", "/v1/completions", json=body) as first, \
                b.stream("POST", "/v1/completions", json=body) as second:
            assert first.status_code == second.status_code == 200  # 4 running + 4 waiting sequences
            # two requests in flight, but eight sequences: a ninth is refused
            err = error_of(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}), 503)
            assert err["code"] == "server_overloaded" and "sequences" in err["message"]
            for r in (first, second):
                events, _ = stream_events(r)
                finished = {e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]}
                assert finished == set(range(MAX_NUM_SEQS))
    assert server.wait_idle()["pagedrl:num_blocks_used"] == 0
    ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 2})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


def test_requests_past_the_shutdown_timeout_end_with_openai_errors(tiny_train_model, tmp_path):
    with running_server(tiny_train_model, tmp_path, "--kv-cache-tokens", "8192", "--shutdown-timeout", "0.05",
                        "--max-num-seqs", "64") as s:
        # 32 sequences of 230 tokens each: far longer than the 0.05 s the shutdown allows
        long = {"prompt": PROMPT, "max_tokens": 230, "ignore_eos": True, "n": 32}
        plain: dict = {}

        def post_plain() -> None:
            plain["response"] = httpx.post(s.base_url + "/v1/completions", json=long, timeout=60)

        with httpx.stream("POST", s.base_url + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 230, "ignore_eos": True,
                "n": 32, "stream": True}) as r:
            it = r.iter_lines()
            first = next(it)
            poster = threading.Thread(target=post_plain)
            poster.start()
            time.sleep(0.3)  # the plain request is in flight
            stopper = threading.Thread(target=s.stop)
            stopper.start()
            lines = [first, *it]
        stopper.join()
        poster.join()
    lines = [line for line in lines if line]
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["error"]["type"] == "server_error" and "shutting down" in last["error"]["message"]
    err = error_of(plain["response"], 503)
    assert "shutting down" in err["message"]
    assert s.proc.returncode == 0
    assert "Traceback" not in s.log() and "CancelledError" not in s.log()


def test_requests_arriving_while_draining_get_503_not_a_closed_connection(tiny_train_model, tmp_path):
    """After SIGTERM the server keeps accepting: every request sent meanwhile on a fresh connection is
    answered (503 server_shutting_down, Connection: close), the stream in flight ends normally, and
    the process exits soon after it. The senders' clients are made before the signal (making 16 took
    longer than the stream's generation on a loaded machine, and a request sent after the server's exit
    is refused, not answered); each opens its connection after it, and they send once a probe is answered
    503 (a request sent before the server takes the signal is served)."""
    with running_server(tiny_train_model, tmp_path, "--kv-cache-tokens", "4096", "--shutdown-timeout", "30") as s:
        answers: list = []
        go = threading.Event()

        clients = [httpx.Client(timeout=30) for _ in range(16)]  # no connection until a request

        def post_new(client: httpx.Client) -> None:
            go.wait(30)  # threads started before the signal: only the request is left to send after it
            try:
                r = client.post(s.base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
                answers.append((r.status_code, r.headers.get("connection"), r.json()))
            except httpx.TransportError as e:
                answers.append(e)
            finally:
                client.close()

        with httpx.stream("POST", s.base_url + "/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            it = r.iter_lines()
            first = next(it)
            posters = [threading.Thread(target=post_new, args=(c,)) for c in clients]
            for t in posters:
                t.start()
            s.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            while httpx.post(s.base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 1},
                             timeout=30).status_code != 503:  # until the server has taken the signal
                time.sleep(0.01)
            go.set()
            for t in posters:
                t.join()
            lines = [first, *it]
        ended = time.monotonic()
        s.proc.wait(timeout=30)
        exited = time.monotonic()
    assert [line for line in lines if line][-1] == "data: [DONE]"
    assert len(answers) == 16 and all(isinstance(a, tuple) for a in answers), answers
    for status, connection, body in answers:
        assert (status, connection, body["error"]["code"]) == (503, "close", "server_shutting_down")
    assert s.proc.returncode == 0
    # about 1.3 s on a quiet machine; far below the 30 s drain it would otherwise wait out (6-9 s were seen
    # with every core busy with other tests)
    assert exited - ended < 15.0, f"exited {exited - ended:.1f} s after the last stream ended"
    assert ended - signalled < 25


def post_raw(http: httpx.Client, path: str, raw: str) -> httpx.Response:
    return http.post(path, content=raw.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/v1/completions", '{"prompt": "Hi \\ud800", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "Hi \\udfff"], "max_tokens": 1}', "prompt.1"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi \\ud800"}]}', "messages.0.content"),
    ("/tokenize", '{"prompt": "Hi \\ud800"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages.0.content"),
])
def test_lone_surrogate_is_400_naming_the_field(http, path, raw, param):
    assert error_of(post_raw(http, path, raw), 400)["param"] == param
    # the same text with a whole surrogate pair is fine
    assert post_raw(http, "/tokenize", '{"prompt": "Hi \\ud83c\\udf55"}').status_code == 200


@pytest.mark.parametrize(("field", "value"), [
    ("seed", str(2**64)), ("seed", str(-(2**63) - 1)), ("temperature", "Infinity"),
    ("repetition_penalty", "Infinity"), ("top_p", "NaN"), ("presence_penalty", "-Infinity"),
])
def test_out_of_range_seed_and_non_finite_numbers_are_400_naming_the_field(http, field, value):
    raw = f'{{"prompt": "{PROMPT}", "max_tokens": 1, "{field}": {value}}}'
    assert error_of(post_raw(http, "/v1/completions", raw), 400)["param"] == field
    chat = f'{{"messages": [{{"role": "user", "content": "Hi"}}], "max_tokens": 1, "{field}": {value}}}'
    assert error_of(post_raw(http, "/v1/chat/completions", chat), 400)["param"] == field


def test_the_largest_seed_is_served(http):
    for seed in (2**64 - 1, -(2**63)):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "n": 2, "seed": seed})
        assert r.status_code == 200, r.text


def test_deeply_nested_json_is_400(http):
    for raw in ("[" * 100_000, '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}",
                '{"prompt": "x", "user": ' + "[" * 500 + "]" * 500 + "}"):
        err = error_of(post_raw(http, "/v1/completions", raw), 400)
        assert "nested" in err["message"] or "JSON" in err["message"]
    assert http.get("/health").status_code == 200


def test_assistant_content_null_is_accepted_and_other_roles_are_told(http):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "again"}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    err = error_of(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": None}]}), 400)
    assert err["param"] == "messages.0.content" and "null" in err["message"]


def test_openapi_describes_every_body_error_and_content_type(http):
    doc = http.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]

    def refs(node):
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "$ref":
                    yield v
                else:
                    yield from refs(v)
        elif isinstance(node, list):
            for v in node:
                yield from refs(v)

    for ref in refs(doc):  # every reference resolves
        assert ref.startswith("#/components/schemas/") and ref.rsplit("/", 1)[1] in schemas, ref
    bodies = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
              "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}
    for path, model in bodies.items():
        op = doc["paths"][path]["post"]
        assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/" + model)
        assert "400" in op["responses"] and "413" in op["responses"]
    assert set(schemas["CompletionRequest"]["required"]) == {"prompt"}
    assert set(schemas["ChatCompletionRequest"]["required"]) == {"messages"}
    for path, item in doc["paths"].items():
        for op in item.values():
            for status, resp in op["responses"].items():
                if int(status) >= 400:
                    assert resp["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse"), path
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "text/event-stream" in doc["paths"][path]["post"]["responses"]["200"]["content"]
    assert doc["paths"]["/health"]["get"]["responses"]["200"]["content"] == {}
    metrics = doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == [http.get("/metrics").headers["content-type"]]


def test_a_second_ctrl_c_stops_at_once_and_in_order(tiny_train_model, tmp_path):
    """Ctrl+C drains (up to --shutdown-timeout, 60 s here); a second one ends what is in flight at once, still
    in OpenAI's shape, stops the engine and exits 0 without a traceback (it waited out the whole drain, then
    skipped the engine's shutdown). An empty --api-key is no key, as in vLLM."""
    with running_server(tiny_train_model, tmp_path, "--kv-cache-tokens", "4096", "--shutdown-timeout", "60",
                        "--api-key", "", "--max-num-seqs", "1") as s:
        assert httpx.get(s.base_url + "/v1/models").status_code == 200
        replies: list = []

        def post() -> None:  # 80 requests one at a time, each to the end of the context: many seconds
            try:
                replies.append(httpx.post(s.base_url + "/v1/completions", timeout=60, json={
                    "prompt": PROMPT, "max_tokens": 230, "ignore_eos": True}))
            except httpx.HTTPError as e:
                replies.append(e)

        posters = [threading.Thread(target=post) for _ in range(80)]
        for t in posters:
            t.start()
        time.sleep(1.0)
        s.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        assert s.proc.poll() is None  # draining
        started = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(timeout=30) == 0
        assert time.monotonic() - started < 15
        for t in posters:
            t.join()
    assert all(isinstance(r, httpx.Response) for r in replies), replies  # no connection cut without an answer
    stopped = [r for r in replies if r.status_code == 503 and "stopped at once" in r.json()["error"]["message"]]
    assert stopped and all(r.status_code in (200, 503) for r in replies)
    log = s.log()
    assert "draining:" in log and "Ctrl+C again to stop at once" in log
    assert "Traceback" not in log and "CancelledError" not in log
