"""A gpt-oss answer in harmony markup, as the engine gives it in DELTA outputs (its special tokens kept), through
the chat stream, the whole chat answer and the Responses API's stream and whole answer: the reasoning, the
content and the calls of each equal the parser's split of the whole text (vLLM's, test_harmony.py), with the
reasoning a `reasoning` item before the others on /v1/responses and no marker anywhere."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedrl.engine.outputs import CompletionOutput, RequestOutput
from pagedrl.engine.sampling_params import SamplingParams
from pagedrl.server.beam_search import FinishedGroup
from pagedrl.server.harmony import MARKERS, split_harmony
from pagedrl.server.logprobs import TokenText
from pagedrl.server.reasoning_parsers import ReasoningPlan
from pagedrl.server.responses import chat_response, chat_stream
from pagedrl.server.responses_bodies import ResponseObject, whole_response
from pagedrl.server.responses_stream import response_stream
from pagedrl.server.tools import ToolPlan

CALL = ("<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
        "Let me look.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
        '{"city":"Paris"}')
FINAL = ("<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>"
         "It is 4.")
PARAMS = SamplingParams(max_tokens=64)


class DeltaGroup(FinishedGroup):
    """A finished answer given out `size` characters at a time, one token id each, as DELTA outputs."""

    def __init__(self, text: str, size: int) -> None:
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        self.deltas = [RequestOutput("r", None, [1, 2], [CompletionOutput(
            0, piece, [3], None, None, "stop" if i == len(pieces) - 1 else None)], i == len(pieces) - 1)
            for i, piece in enumerate(pieces)]
        whole = RequestOutput("r", None, [1, 2], [CompletionOutput(0, text, [3] * len(pieces), None, None, "stop")],
                              True)
        super().__init__([whole], PARAMS)

    async def _updates(self):
        for delta in self.deltas:
            yield [(0, delta)]


def events(stream) -> list[dict]:
    async def run() -> list[bytes]:
        return [chunk async for chunk in stream]

    out = []
    for chunk in asyncio.run(run()):
        for line in chunk.decode().splitlines():
            if line.startswith("data: {"):
                out.append(json.loads(line[len("data: "):]))
    return out


def plans() -> tuple[ToolPlan, ReasoningPlan]:
    return ToolPlan("auto", parser="openai"), ReasoningPlan("openai_gptoss")


@pytest.mark.parametrize("text", [CALL, FINAL])
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_the_chat_stream_and_the_whole_answer_give_the_split(text, size) -> None:
    reasoning, content, calls = split_harmony(text)
    plan, thinking = plans()
    r, c, got_calls, finish = "", "", [], None
    for chunk in events(chat_stream(DeltaGroup(text, size), "id", "m", PARAMS, False, TokenText(None), plan,
                                    thinking=thinking)):
        for choice in chunk["choices"]:
            delta = choice["delta"]
            r, c = r + (delta.get("reasoning") or ""), c + (delta.get("content") or "")
            got_calls += [(t["function"]["name"], t["function"]["arguments"]) for t in delta.get("tool_calls") or []]
            finish = choice["finish_reason"] or finish
    assert (r, c, got_calls) == (reasoning, content, calls)
    assert finish == ("tool_calls" if calls else "stop")
    assert not any(m in r + c for m in MARKERS)
    group = DeltaGroup(text, size)
    message = chat_response("id", "m", group.outputs[0], PARAMS, TokenText(None), plan, thinking=thinking).choices[0]
    assert (message.message.reasoning, message.message.content, message.finish_reason) == (reasoning, content, finish)
    assert [(t.function.name, t.function.arguments) for t in message.message.tool_calls] == calls


@pytest.mark.parametrize("text", [CALL, FINAL])
def test_the_responses_api_puts_the_reasoning_item_first(text) -> None:
    from pagedrl.server.responses import chat_message

    reasoning, content, calls = split_harmony(text)
    plan, thinking = plans()
    done: list[ResponseObject] = []
    events(response_stream(DeltaGroup(text, 3), ResponseObject(model="m"), plan, done.append, thinking=thinking))
    group = DeltaGroup(text, 3)
    message, finish = chat_message(group.outputs[0].outputs[0], plan, thinking)
    whole = whole_response(ResponseObject(model="m"), group.outputs[0], message, finish)
    for response in (done[0], whole):
        items = [item.model_dump() for item in response.output]
        assert items[0]["type"] == "reasoning" and items[0]["content"][0]["text"] == reasoning
        texts = [part["text"] for item in items if item["type"] == "message" for part in item["content"]]
        assert "".join(texts) == content
        assert [(i["name"], i["arguments"]) for i in items if i["type"] == "function_call"] == calls
        assert not any(m in json.dumps(items) for m in MARKERS)
