"""`--reasoning-parser` through a real `pagedrl serve` process and the official `openai` client.

The model is random: an unconstrained answer, which never closes a reasoning, is all reasoning under
deepseek_r1's rule, and an answer a grammar writes is all content, streamed as it is written (the
splitting of answers that close their reasoning is checked in test_reasoning_parsers.py). Each answer
is checked whole and streamed: the deltas' `reasoning` and `content` join to the whole message's."""

from __future__ import annotations

import openai
import pytest
from server_process import running_server

from pagedrl.model.chat_template import render_chat_template
from pagedrl.server.inputs import message_dict
from pagedrl.server.protocol import ChatMessage
from pagedrl.server.reasoning_parsers import reasoning_plan
from pagedrl.server.serve import build_parser

CHAT = [{"role": "user", "content": "what is two and two"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}]
ANSWER = "Two and two is four.</think>The answer is 4."
CONSTRAINED = r"Two and two is four\.</think>The answer is 4\."
CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny_train import build_model_dir

    model = build_model_dir(tmp_path_factory.mktemp("reasoning-model") / "model", max_position_embeddings=2048)
    with running_server(model, tmp_path_factory.mktemp("serve-reasoning"), "--kv-cache-tokens", "8192",
                        "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice") as s:
        yield s


def streamed(stream, pieces: list | None = None) -> tuple[str | None, str | None, list, str | None]:
    """Joined reasoning and content of choice 0, its tool calls' (name, arguments) and finish reason;
    each non-empty content delta is appended to `pieces`."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in stream:
        for choice in (c for c in chunk.choices if c.index == 0):
            extra = choice.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            reasoning += extra.get("reasoning") or ""
            content += choice.delta.content or ""
            if choice.delta.content and pieces is not None:
                pieces.append(choice.delta.content)
            calls += [(d.function.name, d.function.arguments) for d in choice.delta.tool_calls or []]
            finish = choice.finish_reason or finish
    return reasoning or None, content or None, calls, finish


def test_an_answer_a_grammar_writes_is_content_streamed_as_it_comes(client, model) -> None:
    """A grammar holds the answer from its first token where `</think>` is no single token (as in this
    tokenizer; where it is one, the grammar starts after it: test_mistral_reasoning.py), so the answer is
    not a reasoning: all of it is content (a </think> the grammar writes included), sent delta by delta
    rather than at the end."""
    base = dict(model=model, messages=CHAT, temperature=0, max_tokens=80)
    args = dict(base, extra_body={"structured_outputs": {"regex": CONSTRAINED}})
    message = client.chat.completions.create(**args).choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == (None, None, ANSWER)
    pieces: list[str] = []
    assert streamed(client.chat.completions.create(**args, stream=True), pieces) == (None, ANSWER, [], "stop")
    assert len(pieces) > 5  # one delta per token or so, not the whole answer at the end
    events = list(client.responses.create(model=model, input=CHAT[0]["content"], temperature=0, max_output_tokens=40,
                                          text={"format": {"type": "json_object"}}, stream=True))
    assert len([e for e in events if e.type == "response.output_text.delta"]) > 1
    assert not [e for e in events if e.type.startswith("response.reasoning")]


def test_tool_calls_are_read_from_the_content(client, model) -> None:
    args = dict(model=model, messages=CHAT, tools=TOOLS, temperature=0, max_tokens=120,
                extra_body={"structured_outputs": {"regex": CALL}})
    choice = client.chat.completions.create(**args).choices[0]
    assert (choice.message.reasoning, choice.message.content, choice.finish_reason) == (None, None, "tool_calls")
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert streamed(client.chat.completions.create(**args, stream=True)) == (
        None, None, [("get_weather", '{"city": "Paris"}')], "tool_calls")


def test_a_beam_searched_answer_is_split_as_a_sampled_one(client, model) -> None:
    """use_beam_search answers go through the reasoning parser too (unconstrained: here all reasoning)."""
    args = dict(model=model, messages=CHAT, max_tokens=8, extra_body={"use_beam_search": True, "n": 2})
    whole = client.chat.completions.create(**args)
    assert all(c.message.content is None and c.message.reasoning for c in whole.choices)
    assert streamed(client.chat.completions.create(**args, stream=True))[:2] == (whole.choices[0].message.reasoning,
                                                                                None)


def test_an_answer_that_never_closes_its_reasoning_is_reasoning_on_both_routes(client, model) -> None:
    """deepseek_r1: no </think> means the answer was cut off while thinking; /v1/responses gives the
    reasoning as a reasoning item, whole and streamed."""
    message = client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=8).choices[0].message
    assert message.content is None and message.reasoning
    assert streamed(client.chat.completions.create(model=model, messages=CHAT, temperature=0, max_tokens=8,
                                                   stream=True))[:2] == (message.reasoning, None)
    r = client.responses.create(model=model, input=CHAT[0]["content"], temperature=0, max_output_tokens=8)
    (item,) = r.output
    assert item.type == "reasoning" and item.id.startswith("rs_") and item.content[0].text == message.reasoning
    events = list(client.responses.create(model=model, input=CHAT[0]["content"], temperature=0, max_output_tokens=8,
                                          stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == message.reasoning
    assert [e.response.output[0].content[0].text for e in events if e.type == "response.incomplete"] == [deltas]
    # the reasoning item sent back with the conversation, as clients do, is an assistant turn with that
    # reasoning, as vLLM gives it to the template: the same prompt as the chat route's message
    item = r.output[0].model_dump(exclude_none=True)
    with_item = client.responses.create(model=model, input=[CHAT[0], item, {"role": "user", "content": "and three?"}],
                                        temperature=0, max_output_tokens=2)
    turn = {"role": "assistant", "content": None, "reasoning": message.reasoning}
    chat = client.chat.completions.create(model=model, messages=[CHAT[0], turn, {"role": "user", "content": "and three?"}],
                                          temperature=0, max_tokens=2)
    assert with_item.usage.input_tokens == chat.usage.prompt_tokens
    assert chat.usage.prompt_tokens > client.chat.completions.create(
        model=model, messages=[CHAT[0], {"role": "user", "content": "and three?"}], temperature=0,
        max_tokens=2).usage.prompt_tokens
    with pytest.raises(openai.BadRequestError, match="encrypted"):
        client.responses.create(model=model, input=[CHAT[0], {**item, "encrypted_content": "x"}], max_output_tokens=2)


def test_qwen3_follows_enable_thinking_and_unknown_parsers_are_refused(capsys) -> None:
    plain = "<|im_start|>assistant\n"
    assert reasoning_plan("qwen3", None, False, plain).thinking
    assert not reasoning_plan("qwen3", {"enable_thinking": False}, False, plain).thinking
    assert reasoning_plan("deepseek_r1", {"enable_thinking": False}, False, plain).thinking  # qwen3's switch only
    assert reasoning_plan("qwen3", None, False, plain + "<think>\n\n</think>\n\n").prompt_ended
    assert reasoning_plan(None, None, False, plain) is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--reasoning-parser", "nope"])
    err = capsys.readouterr().err
    assert "--reasoning-parser: invalid choice: 'nope' (choose from " in err and "deepseek_r1" in err and "qwen3" in err


def test_an_assistant_turns_reasoning_reaches_the_template() -> None:
    """A message's `reasoning` (or its earlier name `reasoning_content`) sent back on an assistant turn is
    given to the template under both names, as vLLM gives it; on other roles it is ignored, as vLLM does."""
    template = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                "</think>{% endif %}{{ m.content }};{% endfor %}")
    for field in ("reasoning", "reasoning_content"):
        turn = message_dict(1, ChatMessage(role="assistant", content="4", **{field: "two and two"}))
        assert turn["reasoning"] == turn["reasoning_content"] == "two and two"
        messages = [message_dict(0, ChatMessage(role="user", content="hi")), turn]
        assert render_chat_template(template, messages) == "user:hi;assistant:<think>two and two</think>4;"
    assert "reasoning" not in message_dict(0, ChatMessage(role="user", content="hi", reasoning="r"))


def test_reasoning_and_the_answer_after_it_are_one_assistant_turn_as_vllm_builds_it() -> None:
    """vLLM's `_construct_message_from_response_item`: a reasoning item joins the assistant turn before it
    (its reasoning appended), and an assistant answer fills the content of the turn its reasoning (or its
    calls) opened, so a conversation sent back as OpenAI lists it is the chat route's conversation."""
    from pagedrl.server.responses_inputs import item_messages
    from pagedrl.server.responses_protocol import ResponsesRequest

    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "r"}]}
    answer = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "A", "annotations": []}]}
    call = {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}
    req = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": "q"}, reasoning, answer, call, {"role": "user", "content": "q2"},
        {**reasoning, "id": "rs_2"}, {**reasoning, "id": "rs_3"}]})
    messages: list = []
    item_messages(req.input, messages, [])
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
    turn = messages[1]
    assert (turn["reasoning"], turn["tool_calls"][0]["id"]) == ("r", "c1")
    assert turn["content"] in ("A", [{"type": "text", "text": "A"}])
    assert messages[3] == {"role": "assistant", "content": None, "reasoning": "rr"}
