"""`--reasoning-parser` through a real `pagedrl serve` process and the official `openai` client.

The model is random: a regex constraint makes it write think tags where a test needs them (a grammar
holds the whole answer here, so the tags are the grammar's), and an unconstrained answer, which never
closes a reasoning, is all reasoning under deepseek_r1's rule. Each answer is checked whole and
streamed: the deltas' `reasoning` and `content` join to the whole message's, and no delta carries a
piece of a tag."""

from __future__ import annotations

import pytest
from server_process import running_server

from pagedrl.server.reasoning_parsers import reasoning_plan
from pagedrl.server.serve import build_parser

CHAT = [{"role": "user", "content": "what is two and two"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False}}}]
THOUGHT, ANSWER = "Two and two is four.", "The answer is 4."
SPLIT = r"Two and two is four\.</think>The answer is 4\."
CALL = r'<think>I will look\.</think><tool_call>\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}</tool_call>'


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from tiny_train import build_model_dir

    model = build_model_dir(tmp_path_factory.mktemp("reasoning-model") / "model", max_position_embeddings=2048)
    with running_server(model, tmp_path_factory.mktemp("serve-reasoning"), "--kv-cache-tokens", "8192",
                        "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice") as s:
        yield s


def streamed(stream) -> tuple[str | None, str | None, list, str | None]:
    """Joined reasoning and content of choice 0, its tool calls' (name, arguments) and finish reason."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in stream:
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            assert extra.get("reasoning") == extra.get("reasoning_content")
            for piece in (extra.get("reasoning") or "", choice.delta.content or ""):
                assert "<" not in piece and "think>" not in piece  # no part of a tag leaks
            reasoning += extra.get("reasoning") or ""
            content += choice.delta.content or ""
            calls += [(d.function.name, d.function.arguments) for d in choice.delta.tool_calls or []]
            finish = choice.finish_reason or finish
    return reasoning or None, content or None, calls, finish


def test_reasoning_and_content_whole_and_streamed(client, model) -> None:
    base = dict(model=model, messages=CHAT, temperature=0, max_tokens=80)
    args = dict(base, extra_body={"structured_outputs": {"regex": SPLIT}})
    whole = client.chat.completions.create(**args)
    message = whole.choices[0].message
    assert (message.reasoning, message.reasoning_content, message.content) == (THOUGHT, THOUGHT, ANSWER)
    assert streamed(client.chat.completions.create(**args, stream=True)) == (THOUGHT, ANSWER, [], "stop")
    # the token counts are the answer's, reasoning included
    ids = client.chat.completions.create(**base, extra_body={"structured_outputs": {"regex": SPLIT},
                                                             "return_token_ids": True}).choices[0].model_extra
    assert whole.usage.completion_tokens == len(ids["token_ids"]) > 0
    hidden = client.chat.completions.create(**base, extra_body={"structured_outputs": {"regex": SPLIT},
                                                                  "include_reasoning": False}).choices[0].message
    assert (hidden.reasoning, hidden.content) == (None, ANSWER)


def test_tool_calls_are_read_from_the_content_after_the_reasoning(client, model) -> None:
    args = dict(model=model, messages=CHAT, tools=TOOLS, temperature=0, max_tokens=120,
                extra_body={"structured_outputs": {"regex": CALL}})
    choice = client.chat.completions.create(**args).choices[0]
    assert (choice.message.reasoning, choice.message.content, choice.finish_reason) == ("I will look.", None,
                                                                                         "tool_calls")
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert streamed(client.chat.completions.create(**args, stream=True)) == (
        "I will look.", None, [("get_weather", '{"city": "Paris"}')], "tool_calls")


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
    # the reasoning item sent back with the conversation, as clients do, is accepted and left out of the prompt
    again = [{"role": "user", "content": CHAT[0]["content"]}, {"role": "user", "content": "and three?"}]
    with_item = client.responses.create(model=model, input=[again[0], r.output[0].model_dump(exclude_none=True),
                                                            again[1]], temperature=0, max_output_tokens=2)
    assert with_item.usage.input_tokens == client.responses.create(
        model=model, input=again, temperature=0, max_output_tokens=2).usage.input_tokens


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
