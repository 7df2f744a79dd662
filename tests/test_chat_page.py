"""The chat page at `/` of a real `pagedrl serve` process, in a headless Chromium (skipped, with the
reason, where Playwright or Chromium is missing): a streamed answer appears token by token, Stop ends
it, the log-prob view shows the API's own numbers (not the stop token's), the page asks nothing of any
other host, and text from the model that looks like HTML stays text. Over plain HTTP: the headers that
keep the page from being framed or sniffed, and its icon. The server runs as `pagedrl serve --quantization
int4 --enable-lora --lora-modules` would: the page and its API on a base kept quantized, with an adapter
that answers as the same engine in process does."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import httpx
import pytest
from browser import open_page
from multi_lora_cases import pagedrl_adapter
from server_process import running_server


@pytest.fixture(scope="module")
def adapter(tiny_train_model, tmp_path_factory) -> Path:
    return pagedrl_adapter(tiny_train_model, tmp_path_factory.mktemp("ui-adapter") / "qv2", 2, ["q_proj", "v_proj"], seed=1)


@pytest.fixture(scope="module")
def server(tiny_train_model, adapter, tmp_path_factory):
    with running_server(tiny_train_model, tmp_path_factory.mktemp("serve-ui"), "--kv-cache-tokens", "4096",
                        "--quantization", "int4", "--enable-lora", "--max-lora-rank", "2",
                        "--lora-modules", f"qv2={adapter}") as s:
        yield s


def test_an_int4_base_and_its_adapter_answer_as_the_engine_in_process(server, tiny_train_model, adapter) -> None:
    from pagedrl import LLM, LoRARequest
    from pagedrl.engine.sampling_params import SamplingParams

    assert "int4 weight-only" in server.log()
    messages = [{"role": "user", "content": "count to five"}]
    llm = LLM(str(tiny_train_model), quantization="int4", enable_lora=True, max_lora_rank=2, kv_cache_tokens=1024)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    qv2 = LoRARequest("qv2", 1, str(adapter))
    want = [o.outputs[0].text for o in llm.chat([messages, messages], params, use_tqdm=False, lora_request=[None, qv2])]
    llm.close()
    assert want[0] != want[1]
    models = [m["id"] for m in httpx.get(server.base_url + "/v1/models").json()["data"]]
    assert models[1] == "qv2"
    got = [httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": messages, "temperature": 0, "max_tokens": 12, "ignore_eos": True,
    }).json()["choices"][0]["message"]["content"] for model in models]
    assert got == want


def last_answer(page):
    return page.locator(".assistant").last


def test_the_page_is_sent_with_its_policy_as_headers_and_has_an_icon(server) -> None:
    r = httpx.get(server.base_url + "/")
    policy = r.headers["content-security-policy"]
    directives = {d.strip() for d in policy.split(";")}
    meta = re.search(r'http-equiv="Content-Security-Policy"\s+content="([^"]+)"', r.text).group(1)
    assert {d.strip() for d in meta.split(";")} <= directives  # the header holds the page's own policy, and
    assert "frame-ancestors 'none'" in directives and "frame-ancestors" not in meta  # what only a header can
    assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
    icon = httpx.get(server.base_url + "/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon"
    reserved, kind, count = struct.unpack_from("<HHH", icon.content)
    width, height, _, _, _, bits, size, offset = struct.unpack_from("<BBBBHHII", icon.content, 6)
    assert (reserved, kind, count, width, height, bits) == (0, 1, 1, 16, 16, 32)
    assert offset + size == len(icon.content)
    assert "/favicon.ico" not in httpx.get(server.base_url + "/openapi.json").json()["paths"]


def test_the_stop_token_ends_its_chunk_as_the_page_expects(server, tiny_train_model) -> None:
    """What the log-prob view relies on, from the server: the token that stops an answer (here one of
    stop_token_ids, as the end-of-sequence token does) is the last log-prob entry of the chunk that
    carries finish_reason "stop", whose stop_reason is then no string."""
    from pagedrl.model.tokenizer import Tokenizer

    request = {"messages": [{"role": "user", "content": "count to five"}], "temperature": 1, "seed": 5,
               "max_tokens": 8, "logprobs": True, "ignore_eos": True}
    answer = httpx.post(server.base_url + "/v1/chat/completions", json=request, timeout=60).json()
    names = [e["token"] for e in answer["choices"][0]["logprobs"]["content"]]
    tokenizer = Tokenizer.from_folder(tiny_train_model)
    ids = {tokenizer.token_name(i): i for i in range(tokenizer.vocab_size)}
    stop = next(i for i, name in enumerate(names) if i > 0 and name not in names[:i])  # its first time
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=60, json={
            **request, "stream": True, "stop_token_ids": [ids[names[stop]]]}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    choices = [c for e in events for c in e["choices"]]
    last = choices[-1]
    assert last["finish_reason"] == "stop" and last["stop_reason"] == ids[names[stop]]
    assert last["logprobs"]["content"][-1]["token"] == names[stop]
    assert [e["token"] for c in choices if c["logprobs"] for e in c["logprobs"]["content"]] == names[:stop + 1]


def test_an_answer_streams_in_and_stop_ends_it(server) -> None:
    with open_page(server.base_url + "/") as (page, problems):
        page.goto(server.base_url + "/")
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        model = httpx.get(server.base_url + "/v1/models").json()["data"][0]["id"]
        assert page.locator("#model").input_value() == model
        page.fill("#max_tokens", "48")
        page.fill("#temperature", "0")
        # Record the text after each streamed chunk: it must grow in several steps, not arrive at once.
        page.evaluate("""() => { window.seen = []; new MutationObserver(() => {
            const b = document.querySelectorAll('.assistant .body'); if (b.length) window.seen.push(b[b.length-1].textContent);
        }).observe(document.querySelector('#log'), {subtree: true, childList: true, characterData: true}); }""")
        # Answers reach the page at 4 KB/s (some ten chunks a second), as over a slow link: the text
        # grows in steps, and an answer is still streaming when Stop is clicked, however fast the
        # server generates (a loaded machine's network stack could hand a fast answer over in one piece).
        network = page.context.new_cdp_session(page)
        network.send("Network.enable")
        network.send("Network.emulateNetworkConditions", {"offline": False, "latency": 0,
                                                          "downloadThroughput": 4000, "uploadThroughput": -1})
        page.fill("#input", "hello there")
        page.press("#input", "Enter")
        page.wait_for_function("document.querySelector('.assistant .stats').textContent.includes('finish')")
        api = httpx.post(server.base_url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hello there"}], "temperature": 0, "max_tokens": 48}).json()
        seen = [s for s in page.evaluate("window.seen") if s]
        assert len(set(seen)) >= 3 and all(b.startswith(a) for a, b in zip(seen, seen[1:], strict=False))
        assert last_answer(page).locator(".body").text_content() == api["choices"][0]["message"]["content"]
        stats = last_answer(page).locator(".stats").inner_text()
        assert f"{api['usage']['completion_tokens']} tokens" in stats and "tokens/s" in stats
        assert "first token" in stats and f"finish: {api['choices'][0]['finish_reason']}" in stats
        assert float(last_answer(page).get_attribute("data-ttft")) > 0
        # Stop mid-answer: a long sampled answer, stopped as soon as its first text is on the page.
        card = httpx.get(server.base_url + "/v1/models").json()["data"][0]
        page.fill("#max_tokens", str(card["max_model_len"] - 64))
        page.fill("#temperature", "1")
        page.click("#regenerate")
        page.wait_for_function("document.querySelector('#stop').disabled === false")
        page.wait_for_function("document.querySelectorAll('.assistant .body')[0].textContent.length > 0")
        page.click("#stop")
        page.wait_for_function("document.querySelector('.assistant .stats').textContent.includes('finish: stopped')")
        assert page.locator(".assistant").count() == 1  # regenerate replaced the first answer
        assert not page.locator("#send").is_disabled()
        assert problems == []
    server.wait_idle()  # the stopped request was aborted on the server too


def test_the_log_prob_view_shows_the_apis_numbers(server) -> None:
    request = {"messages": [{"role": "user", "content": "count to five"}], "temperature": 0, "max_tokens": 12,
               "logprobs": True, "top_logprobs": 5}
    expected = httpx.post(server.base_url + "/v1/chat/completions", json=request, timeout=60).json()
    expected = expected["choices"][0]["logprobs"]["content"]
    with open_page(server.base_url + "/") as (page, problems):
        page.goto(server.base_url + "/")
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        page.fill("#max_tokens", "12")
        page.fill("#temperature", "0")
        page.check("#show_logprobs")
        page.fill("#input", "count to five")
        page.press("#input", "Enter")
        page.wait_for_function("document.querySelector('.assistant .stats').textContent.includes('finish')")
        spans = page.locator(".assistant .tok")
        shown = [(spans.nth(i).text_content(), float(spans.nth(i).get_attribute("data-logprob")))
                 for i in range(spans.count())]
        assert shown == [(e["token"], e["logprob"]) for e in expected]
        spans.nth(0).dispatch_event("mousemove", {"clientX": 5, "clientY": 5})  # a newline token has no box to hover
        tip = page.locator("#tip").inner_text()
        assert json.dumps(expected[0]["top_logprobs"][1]["token"]) in tip  # the alternatives are listed
        assert problems == []


def test_the_end_of_sequence_token_is_not_shown_as_part_of_the_answer(server) -> None:
    """A scripted stream as the server sends one that the model ended (the tiny model never does): the
    last chunk carries `<|im_end|>`'s log-prob, no text, finish_reason "stop" and no stop string. The
    view shows the answer's tokens only; an answer a stop string ended keeps all of its tokens."""

    def entry(token: str, logprob: float) -> dict:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode()), "top_logprobs": []}

    def stream(stop_reason) -> str:
        chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None, "stop_reason": None}]}]
        for token in ("one", " two"):
            chunks.append({"choices": [{"index": 0, "delta": {"content": token}, "finish_reason": None,
                                        "logprobs": {"content": [entry(token, -0.5)]}, "stop_reason": None}]})
        last = "<|im_end|>" if stop_reason is None else ","
        chunks.append({"choices": [{"index": 0, "delta": {"content": ""}, "finish_reason": "stop",
                                    "logprobs": {"content": [entry(last, -0.25)]}, "stop_reason": stop_reason}]})
        return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"

    bodies = [stream(None), stream(",")]
    with open_page(server.base_url + "/") as (page, problems):
        page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, body=bodies.pop(0),
                                                                          content_type="text/event-stream"))
        page.goto(server.base_url + "/")
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        page.check("#show_logprobs")
        for n, expected in ((1, ["one", " two"]), (2, ["one", " two", ","])):
            page.fill("#input", "count")
            page.press("#input", "Enter")
            page.wait_for_function(f"document.querySelectorAll('.assistant .stats')[{n - 1}]?.textContent"
                                   ".includes('finish')")
            assert last_answer(page).locator(".body").text_content() == "one two"
            assert last_answer(page).locator(".tok").all_text_contents() == expected
        assert problems == []


def test_text_that_looks_like_html_stays_text(server) -> None:
    """The server's stream replaced by a scripted one: markup in an answer renders as characters."""
    hostile = '<script>window.hacked = 1</script><img src=x onerror="window.hacked = 2"> [a link](http://example.com)'
    chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": hostile[i:i + 20]}}]}
              for i in range(0, len(hostile), 20)]
    chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    body = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
    with open_page(server.base_url + "/") as (page, problems):
        page.route("**/v1/chat/completions", lambda route: route.fulfill(status=200, body=body,
                                                                          content_type="text/event-stream"))
        page.goto(server.base_url + "/")
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        page.fill("#input", "<b>bold?</b>")
        page.press("#input", "Enter")
        page.wait_for_function("document.querySelector('.assistant .stats').textContent.includes('finish')")
        assert last_answer(page).locator(".body").text_content() == hostile
        assert page.locator(".user .body").text_content() == "<b>bold?</b>"
        assert page.locator("#log script, #log img, #log a, #log b").count() == 0
        assert page.evaluate("window.hacked") is None
        assert problems == []


def test_the_model_picker_sends_the_chosen_model(server) -> None:
    """Two models listed (the served one and an adapter, as a multi-adapter server lists them): the
    chosen one is the request's `model`, and a refusal is shown as the API's error, as text."""
    served = httpx.get(server.base_url + "/v1/models").json()
    served["data"] = served["data"][:1]  # the base only (this server's own adapter left out)
    listed = {"object": "list", "data": [*served["data"], {"id": "sql-adapter", "object": "model",
                                                           "parent": served["data"][0]["id"]}]}
    sent = []
    with open_page(server.base_url + "/") as (page, problems):
        page.route("**/v1/models", lambda route: route.fulfill(status=200, json=listed))

        def record(route):
            sent.append(json.loads(route.request.post_data)["model"])
            route.continue_()

        page.route("**/v1/chat/completions", record)
        page.goto(server.base_url + "/")
        page.wait_for_function("document.querySelector('#model').options.length === 2")
        assert page.locator("#model option").nth(1).text_content() == f"sql-adapter (adapter of {served['data'][0]['id']})"
        page.select_option("#model", "sql-adapter")
        page.fill("#input", "hi")
        page.press("#input", "Enter")
        page.wait_for_selector(".msg.error")
        assert sent == ["sql-adapter"]
        assert "404: the model 'sql-adapter' does not exist" in page.locator(".msg.error .body").text_content()
        # The 404 response is logged by the browser as a console error; that one is expected.
        assert [p for p in problems if "404" not in p] == []
