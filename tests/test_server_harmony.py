"""gpt-oss's harmony answers through a real `pagedrl serve` process (`--reasoning-parser openai_gptoss
--tool-call-parser openai`) and the official `openai` client, and a conversation sent back through
gpt-oss's template.

The model is a random tiny gpt-oss whose tokenizer holds harmony's special tokens (tests/harmony_model.py);
sampling among those and a few header words (`allowed_token_ids`) makes answers full of markers, read
here as the parser reads the answer's own token ids decoded with the special tokens kept (the splitting
itself is checked against vLLM's cases in test_harmony.py). Each answer is checked whole and streamed:
the deltas' reasoning, content and calls join to the whole message's."""

from __future__ import annotations

import json

import openai
import pytest
from harmony_model import HARMONY_SPECIALS, HEADER_WORDS, build_harmony_model_dir
from server_process import running_server

from pagedrl.model.tokenizer import Tokenizer
from pagedrl.server.harmony import MARKERS, split_harmony
from pagedrl.server.inputs import chat_prompt_ids
from pagedrl.server.protocol import ChatMessage

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CHAT = [{"role": "user", "content": "what is the weather in Paris"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_harmony_model_dir(tmp_path_factory.mktemp("harmony-model") / "model")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_folder(model_dir)


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    with running_server(model_dir, tmp_path_factory.mktemp("serve-harmony"), "--kv-cache-tokens", "4096",
                        "--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai",
                        "--enable-auto-tool-choice", "--served-model-name", "model") as s:
        yield openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0)


def harmony_args(tokenizer: Tokenizer, seed: int) -> dict:
    """A request whose answer the random model writes in markers and header words only."""
    words = [*HARMONY_SPECIALS[1:5], "<|call|>", *HEADER_WORDS, "a", "b"]
    allowed = [tokenizer.encode(w, add_special_tokens=False)[0] for w in words]
    assert len(set(allowed)) == len(words)  # each one token
    return dict(model="model", messages=CHAT, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=120,
                extra_body={"allowed_token_ids": allowed, "min_tokens": 30, "return_token_ids": True})


def expected(tokenizer: Tokenizer, token_ids: list[int]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """The split of the answer's tokens decoded with the special tokens kept (its end token, <|call|> or
    <|return|>, left out as from every answer's text)."""
    ids = token_ids[:-1] if token_ids and token_ids[-1] in tokenizer.encode("<|return|><|call|>",
                                                                             add_special_tokens=False) else token_ids
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert "<|message|>" in text  # the answer holds harmony's markup: the reading is not vacuous
    return split_harmony(text)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_answers_are_read_whole_and_streamed_alike(client, tokenizer, seed) -> None:
    args = harmony_args(tokenizer, seed)
    whole = client.chat.completions.create(**args)
    choice = whole.choices[0]
    message, extra = choice.message, choice.message.model_extra or {}
    reasoning, content, calls = expected(tokenizer, choice.model_extra["token_ids"])
    got_calls = [(c.function.name, c.function.arguments) for c in message.tool_calls or []]
    assert (extra.get("reasoning"), message.content or None, got_calls) == (reasoning, content or None, calls)
    assert extra.get("reasoning_content") == extra.get("reasoning")
    assert not any(m in (message.content or "") + (extra.get("reasoning") or "") for m in MARKERS)
    # <|call|>, an end token of generation_config.json's alone, ended it (near-uniform sampling among 12 tokens
    # draws it within 90 tokens but for a chance of 11/12 ** 90, 4e-4)
    assert choice.finish_reason == ("tool_calls" if calls else "stop")
    assert choice.model_extra["token_ids"][-1] == tokenizer.encode("<|call|>", add_special_tokens=False)[0]

    r, c, streamed_calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(**args, stream=True):
        for d in chunk.choices:
            delta_extra = d.delta.model_extra or {}
            r += delta_extra.get("reasoning") or ""
            c += d.delta.content or ""
            streamed_calls += [(t.function.name, t.function.arguments) for t in d.delta.tool_calls or []]
            finish = d.finish_reason or finish
    assert (r or None, c or None, streamed_calls, finish) == (reasoning or None, content or None, calls,
                                                               choice.finish_reason)


def test_the_responses_api_reads_the_answer_as_the_chat_route(client) -> None:
    """The same greedy answer on /v1/responses: its reasoning a `reasoning` item before the message, the
    items' texts the chat message's reasoning and content, whole and streamed."""
    chat = client.chat.completions.create(model="model", messages=CHAT, temperature=0, max_tokens=40)
    message = chat.choices[0].message
    reasoning, content = (message.model_extra or {}).get("reasoning"), message.content
    args = dict(model="model", input=CHAT, temperature=0, max_output_tokens=40)
    whole = client.responses.create(**args)
    streamed = [e.response for e in client.responses.create(**args, stream=True)
                if e.type in ("response.completed", "response.incomplete")][0]
    for response in (whole, streamed):
        items = {item.type: item for item in response.output}
        assert [item.type for item in response.output][:1] == (["reasoning"] if reasoning else ["message"])
        assert (items["reasoning"].content[0].text if "reasoning" in items else None) == reasoning
        assert ((items["message"].content[0].text if "message" in items else "") or None) == (content or None)
        assert not any(m in json.dumps(response.model_dump()) for m in MARKERS)


def test_a_conversation_sent_back_reaches_gpt_oss_template_as_harmony_renders_it(tokenizer) -> None:
    """The assistant turn's reasoning goes to the template as `thinking`, its call with its arguments as an
    object, the tool's answer as a `tool` turn: gpt-oss's template renders them as openai/harmony's
    docs/format.md shows a function call and its output; the analysis before a call that a final answer
    follows is dropped, as harmony drops it."""
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [ChatMessage(role="user", content="weather?"),
                ChatMessage(role="assistant", content=None, reasoning="Need the weather.", tool_calls=[call]),
                ChatMessage(role="tool", tool_call_id="c1", content="sunny")]
    prompt = tokenizer.decode(chat_prompt_ids(tokenizer, messages, True), skip_special_tokens=False)
    assert prompt == ("<|start|>user<|message|>weather?<|end|>"
                      "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
                      '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
                      "<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
                      '"sunny"<|end|><|start|>assistant')
    messages += [ChatMessage(role="assistant", content="Sunny.", reasoning_content="It is sunny."),
                 ChatMessage(role="user", content="thanks")]
    prompt = tokenizer.decode(chat_prompt_ids(tokenizer, messages, True), skip_special_tokens=False)
    assert "Need the weather." not in prompt and "It is sunny." not in prompt
    assert "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>" in prompt
