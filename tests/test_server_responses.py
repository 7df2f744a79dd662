"""OpenAI's Responses API (`/v1/responses`) of a real `pagedrl serve --enable-responses-store` process,
through the official `openai` client. The reference for every answer is the chat route on the same
server: the same messages must be the same prompt and the same greedy tokens on either route, so each
test compares the two (the random model's text means nothing on its own)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from server_process import running_server

GREEDY = {"temperature": 0, "max_output_tokens": 6}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather now", "parameters": WEATHER}
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny_train import build_model_dir

    # the tools' listing alone is ~600 of this tokenizer's tokens: a context longer than the usual 256, and
    # long enough for an answer that runs for seconds (the one a test cancels)
    model = build_model_dir(tmp_path_factory.mktemp("responses-model") / "model", max_position_embeddings=8192)
    with running_server(model, tmp_path_factory.mktemp("serve-responses"), "--kv-cache-tokens", "16384",
                        "--enable-responses-store") as s:
        yield s


def chat(client, model, messages, max_tokens=6, **kwargs):
    return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=max_tokens,
                                          **kwargs)


def same_answer(response, completion) -> None:
    """The Responses answer is the chat answer: text, token counts and how it ended."""
    choice = completion.choices[0]
    assert response.output_text == choice.message.content
    assert (response.usage.input_tokens, response.usage.output_tokens) == (completion.usage.prompt_tokens,
                                                                          completion.usage.completion_tokens)
    assert response.usage.total_tokens == completion.usage.total_tokens
    assert response.status == {"length": "incomplete", "stop": "completed"}[choice.finish_reason]


def test_plain_text_is_the_chat_routes_answer(client, model) -> None:
    r = client.responses.create(model=model, input="the cat sat", **GREEDY)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model and r.created_at > 0
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    same_answer(r, chat(client, model, [{"role": "user", "content": "the cat sat"}]))


def test_instructions_are_a_system_message_first(client, model) -> None:
    r = client.responses.create(model=model, instructions="answer in one word", input="the cat sat", **GREEDY)
    messages = [{"role": "system", "content": "answer in one word"}, {"role": "user", "content": "the cat sat"}]
    same_answer(r, chat(client, model, messages))
    assert r.instructions == "answer in one word"


def test_a_multi_turn_input_list_is_the_chat_messages(client, model) -> None:
    items = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "input_text", "text": "hello"}, {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "five"}]},
             {"role": "user", "content": "what is two plus three"}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello\nthere"},
                {"role": "assistant", "content": "five"}, {"role": "user", "content": "what is two plus three"}]
    same_answer(client.responses.create(model=model, input=items, **GREEDY), chat(client, model, messages))


def test_max_output_tokens_cuts_the_answer_incomplete(client, model) -> None:
    r = client.responses.create(model=model, input="the cat sat", temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete" and r.max_output_tokens == 3


def test_streamed_events_come_in_order_and_make_the_whole_answer(client, model) -> None:
    args = dict(model=model, input="a dog ran in the park", temperature=0, max_output_tokens=12)
    whole = client.responses.create(**args)
    events = list(client.responses.create(**args, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.incomplete" if whole.status == "incomplete" else "response.completed"]
    assert deltas >= 1 and events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text == events[-1].response.output_text
    assert events[-1].response.id == events[0].response.id and events[-1].response.status == whole.status
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens
    assert events[2].item.id == events[-2].item.id == events[-1].response.output[0].id


def test_output_text_logprobs_are_the_chat_routes(client, model) -> None:
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: the text part's tokens are the chat
    route's for the same messages, whole and streamed (each delta's own), and their bytes make the text."""
    args = dict(model=model, input="the cat sat", temperature=0, max_output_tokens=6, top_logprobs=2,
                include=["message.output_text.logprobs"])
    r = client.responses.create(**args)
    c = chat(client, model, [{"role": "user", "content": "the cat sat"}], logprobs=True, top_logprobs=2)

    def flat(lps) -> list:
        return [(lp.token, pytest.approx(lp.logprob, abs=1e-3), [(t.token, pytest.approx(t.logprob, abs=1e-3))
                                                                 for t in lp.top_logprobs]) for lp in lps]

    want = flat(c.choices[0].logprobs.content)
    (part,) = r.output[0].content
    assert flat(part.logprobs) == want and len(want) == r.usage.output_tokens and r.top_logprobs == 2
    assert all(len(lp.top_logprobs) == 2 for lp in part.logprobs)
    assert b"".join(bytes(lp.bytes) for lp in part.logprobs).decode() == part.text == c.choices[0].message.content
    events = list(client.responses.create(**args, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert flat([lp for e in deltas for lp in e.logprobs]) == want
    assert all(len(e.logprobs) >= 1 for e in deltas) and "".join(e.delta for e in deltas) == part.text
    assert flat(events[-1].response.output[0].content[0].logprobs) == want
    plain = client.responses.create(model=model, input="the cat sat", top_logprobs=2, max_output_tokens=2)
    assert plain.output[0].content[0].logprobs == []  # top_logprobs alone asks for none, as in vLLM


SCHEMA = {"enum": ["cat", "dog", 7]}  # JSON without room for whitespace: a random model pads an object's


def test_json_schema_format_is_the_chat_routes_structured_output(client, model) -> None:
    fmt = {"type": "json_schema", "name": "pet", "schema": SCHEMA, "strict": True}
    r = client.responses.create(model=model, input="describe a pet", text={"format": fmt}, temperature=0,
                                max_output_tokens=20)
    assert r.status == "completed" and json.loads(r.output_text) in SCHEMA["enum"]
    assert r.text.format.type == "json_schema"
    c = chat(client, model, [{"role": "user", "content": "describe a pet"}], max_tokens=20, response_format={
        "type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}})
    same_answer(r, c)
    with client.responses.stream(model=model, input="describe a pet", text={"format": fmt}, temperature=0,
                                 max_output_tokens=20) as stream:
        assert stream.get_final_response().output_text == r.output_text  # the client's helper, to the end


def test_a_function_call_round_trip(client, model) -> None:
    """A named tool's call comes back as a function_call item; sent back with its output, the next
    prompt is the chat route's with the assistant's tool_calls and the tool's message."""
    ask = [{"role": "user", "content": "the weather in a city"}]
    r = client.responses.create(model=model, input=ask, tools=[TOOL], max_output_tokens=40, temperature=0,
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome") and r.status == "completed"
    items = [*ask, call.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    after = client.responses.create(model=model, input=items, tools=[TOOL], tool_choice="none", **GREEDY)
    history = [*ask, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}]
    same_answer(after, chat(client, model, history, tools=[CHAT_TOOL], tool_choice="none"))
    streamed = list(client.responses.create(model=model, input=ask, tools=[TOOL], max_output_tokens=40, temperature=0,
                                            tool_choice={"type": "function", "name": "get_weather"}, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [(e.name, e.arguments) for e in done] == [(call.name, call.arguments)]


def test_a_call_cut_by_the_token_limit_is_an_incomplete_item(client, model) -> None:
    """Arguments cut by max_output_tokens are not whole JSON: the item says so, as the response does,
    streamed or not, so a client does not run the call."""
    ask = {"model": model, "input": "the weather", "tools": [TOOL], "max_output_tokens": 3, "temperature": 0,
           "tool_choice": {"type": "function", "name": "get_weather"}}
    r = client.responses.create(**ask)
    (call,) = r.output
    assert (r.status, call.type, call.status) == ("incomplete", "function_call", "incomplete")
    done = [e.item for e in client.responses.create(**ask, stream=True) if e.type == "response.output_item.done"]
    assert [(i.type, i.status, i.arguments) for i in done] == [("function_call", "incomplete", call.arguments)]


def test_a_response_is_named_by_its_request_id_and_has_openai_s_every_field(server, model) -> None:
    """vLLM's `request_id` names the response as given, else a gateway's X-Request-Id does; every field
    OpenAI's own types require is there (the client builds them without checking)."""
    from openai.types.responses import Response as OpenAIResponse

    url = server.base_url + "/v1/responses"
    body = {"model": model, "input": "the cat", "temperature": 0, "max_output_tokens": 2}
    mine = httpx.post(url, json={**body, "request_id": "resp_mine"}, timeout=30).json()
    assert mine["id"] == "resp_mine"
    assert httpx.post(url, json=body, headers={"X-Request-Id": "trace-7"}, timeout=30).json()["id"] == "resp_trace-7"
    OpenAIResponse.model_validate(mine)


def test_previous_response_id_continues_as_the_explicit_input(server, client, model) -> None:
    """A chained turn is the explicit conversation (the first turn's instructions not carried over);
    the stored response reads back, and once deleted it is unknown to both."""
    first = client.responses.create(model=model, instructions="be brief", input="hello there", **GREEDY)
    chained = client.responses.create(model=model, previous_response_id=first.id, input="the answer is", **GREEDY)
    explicit = client.responses.create(model=model, input=[
        {"role": "user", "content": "hello there"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "the answer is"}], **GREEDY)
    assert chained.output_text == explicit.output_text and chained.usage.input_tokens == explicit.usage.input_tokens
    assert chained.previous_response_id == first.id and first.store
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()
    client.responses.delete(first.id)
    for call in (lambda: client.responses.retrieve(first.id),
                 lambda: client.responses.create(model=model, previous_response_id=first.id, input="x")):
        with pytest.raises(openai.NotFoundError):
            call()
    with pytest.raises(openai.BadRequestError, match="synchronous"):  # nothing runs in the background
        client.responses.cancel(chained.id)
    unstored = client.responses.create(model=model, input="x", store=False, max_output_tokens=1)
    assert not unstored.store and httpx.get(f"{server.base_url}/v1/responses/{unstored.id}").status_code == 404


def error_of(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"input": "x", "seed": 1}, "seed", "unknown field"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input.0", "item type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type", "input_image"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role", "user"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type", "web_search"),
    ({"input": "x", "tools": [TOOL]}, "tool_choice", "--enable-auto-tool-choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}},
     "text.format.schema", "text.format.schema"),
    ({"input": "x", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name", "nope"),
    ({"input": "x", "background": True, "store": False}, "background",
     "background can only be used when `store` is true"),
    ({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21}, "top_logprobs",
     "max_logprobs (20)"),
    ({"input": "x", "include": ["message.logprobs"]}, "include.0", "message.output_text.logprobs"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]}, "input.0.call_id",
     "No tool call found for function call output with call_id call_1"),
])
def test_what_is_not_served_is_a_400_naming_the_field(server, body, param, words) -> None:
    err = error_of(httpx.post(server.base_url + "/v1/responses", json=body, timeout=30), 400)
    assert err["param"] == param and words in err["message"] and err["type"] == "invalid_request_error", err


def test_an_unknown_previous_response_is_a_404(server) -> None:
    err = error_of(httpx.post(server.base_url + "/v1/responses", json={"input": "x", "previous_response_id": "resp_1"}),
                   404)
    assert err["param"] == "previous_response_id" and err["code"] == "previous_response_not_found"
    assert "resp_1" in err["message"]


def test_responses_count_in_the_metrics_and_the_openapi_document(server, client, model) -> None:
    before = server.wait_idle()
    client.responses.create(model=model, input="five", temperature=0, max_output_tokens=2)
    after = server.wait_idle()
    key = 'pagedrl:request_success_total{finished_reason="length"}'
    assert after[key] == before[key] + 1
    doc = httpx.get(server.base_url + "/openapi.json").json()
    op = doc["paths"]["/v1/responses"]["post"]
    assert op["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponsesRequest")
    assert "text/event-stream" in op["responses"]["200"]["content"]
    assert set(doc["components"]["schemas"]["ResponsesRequest"]["required"]) == {"input"}
    assert "background" in doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    assert "conversation" not in doc["components"]["schemas"]["ResponsesRequest"]["properties"]
    get = doc["paths"]["/v1/responses/{response_id}"]["get"]
    assert [p["name"] for p in get["parameters"]] == ["response_id", "stream", "starting_after"]


def ended(client, response_id: str, timeout: float = 60.0):
    """A background response once it has ended, retrieved until then."""
    deadline = time.monotonic() + timeout
    while (r := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline, r
        time.sleep(0.02)
    return r


def test_a_background_response_answers_at_once_and_ends_as_the_foreground_one(client, model) -> None:
    args = dict(model=model, input="the cat sat", temperature=0, max_output_tokens=6)
    queued = client.responses.create(**args, background=True)
    assert queued.status in ("queued", "in_progress") and queued.output == [] and queued.usage is None
    done, foreground = ended(client, queued.id), client.responses.create(**args)
    assert done.id == queued.id and done.background and queued.background and not foreground.background
    assert (done.status, done.output_text, done.usage.output_tokens) == (
        foreground.status, foreground.output_text, foreground.usage.output_tokens)
    with pytest.raises(openai.BadRequestError, match=rf"already ended \(status {done.status}\)") as e:
        client.responses.cancel(done.id)
    assert e.value.body["param"] == "response_id"
    for call in (client.responses.cancel, client.responses.retrieve):
        with pytest.raises(openai.NotFoundError, match="resp_nope"):
            call("resp_nope")


def test_cancel_stops_a_background_response_and_frees_its_engine_request(server, client, model) -> None:
    """A long answer is cancelled while it runs (the server answering others meanwhile): it is
    `cancelled`, its engine request aborted and its KV blocks freed, not run to its end."""
    abort, length = (f'pagedrl:request_success_total{{finished_reason="{r}"}}' for r in ("abort", "length"))
    before = server.wait_idle()
    long = client.responses.create(model=model, input="the cat sat", temperature=0, max_output_tokens=8000,
                                   background=True)  # seconds of work uncancelled
    deadline = time.monotonic() + 60
    while client.responses.retrieve(long.id).status == "queued":  # until its first token is out
        assert time.monotonic() < deadline
        time.sleep(0.01)
    quick = client.responses.create(model=model, input="a dog", temperature=0, max_output_tokens=2)
    assert quick.status == "incomplete" and client.responses.retrieve(long.id).status == "in_progress"
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled" and cancelled.id == long.id
    assert client.responses.retrieve(long.id).status == "cancelled"
    after = server.wait_idle()
    assert (after[abort], after[length]) == (before[abort] + 1, before[length] + 1)
    assert after["pagedrl:num_blocks_used"] == 0
    with pytest.raises(openai.BadRequestError, match=r"already ended \(status cancelled\)"):
        client.responses.cancel(long.id)


def test_a_background_stream_runs_on_without_its_client_and_streams_again(server, client, model) -> None:
    """The client reads one event and goes away; the answer still ends whole, and its events stream
    again from after a sequence number."""
    args = dict(model=model, input="a dog ran in the park", temperature=0, max_output_tokens=12)
    with client.responses.create(**args, background=True, stream=True) as stream:
        first = next(iter(stream))
    assert first.type == "response.created" and first.response.background
    done, foreground = ended(client, first.response.id), client.responses.create(**args)
    assert (done.status, done.output_text) == (foreground.status, foreground.output_text)
    events = list(client.responses.retrieve(done.id, stream=True, starting_after=1))
    assert [e.sequence_number for e in events] == list(range(2, 2 + len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == foreground.output_text
    assert events[-1].type == f"response.{done.status}" and events[-1].response.output_text == done.output_text
    url = f"{server.base_url}/v1/responses/{done.id}"
    assert error_of(httpx.get(url, params={"stream": "true", "starting_after": "x"}), 400)["param"] == "starting_after"
    url = f"{server.base_url}/v1/responses/{foreground.id}"
    assert error_of(httpx.get(url, params={"stream": "true"}), 400)["param"] == "stream"
