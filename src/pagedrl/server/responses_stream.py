"""A Responses answer as OpenAI streams it: named server-sent events, each with its `sequence_number`,
in the order the `openai` client's stream helpers accumulate them:

    response.created, response.in_progress,
    per item: response.output_item.added,
      reasoning: response.content_part.added, response.reasoning_text.delta ..., response.reasoning_text.done,
                 response.content_part.done;
      a message: response.content_part.added, response.output_text.delta ..., response.output_text.done,
                 response.content_part.done;
      a function call: response.function_call_arguments.delta ..., response.function_call_arguments.done;
    response.output_item.done,
    and last response.completed (or response.incomplete when max_output_tokens cut it, response.failed
    when the engine could not finish it), carrying the whole response.

The reasoning, text and calls are read from DELTA outputs with the chat stream's readers, so a streamed
answer is made of the same text and calls as the whole one, in the order written: text a model writes
after a call opens a second message item here, where the whole answer joins its text in one.

With log-probs asked for, each `response.output_text.delta` carries those of the tokens that came since
the last one (a token whose text is held back, inside a character or a possible stop string, goes with
the next text; what is left at the end, such as the end-of-text token, with a last empty delta), and
`response.output_text.done`, the part and the final response carry the item's whole list.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedrl.engine.outputs import CompletionOutput
from pagedrl.engine.request_stream import RequestAborted, RequestFailed, RequestGroup
from pagedrl.server.reasoning_parsers import ReasoningPlan
from pagedrl.server.response_bodies import ChatTokenLogprob
from pagedrl.server.responses import answer_readers, split_delta
from pagedrl.server.responses_bodies import (
    OutputFunctionCall,
    OutputItem,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponseObject,
    finished,
    usage_of,
)
from pagedrl.server.tool_parsers import ParsedCall
from pagedrl.server.tools import ToolPlan

FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}


def dump(model: Any) -> dict[str, Any]:
    return model.model_dump(mode="json")


class EventWriter:
    """One event's bytes, numbered in the order written; with a `sink`, each event also goes there on
    its own (a background stream's log, which a reader resumes after a sequence number)."""

    def __init__(self, sink: Callable[[bytes], None] | None = None) -> None:
        self.sequence_number = 0
        self.sink = sink

    def __call__(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        event = f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n".encode()
        if self.sink is not None:
            self.sink(event)
        return event


class StreamedItems:
    """The output items as the answer arrives: text goes to an open message item, each call opens a
    function_call item; whatever was open is closed (its `done` events) when another kind starts."""

    def __init__(self, emit: EventWriter) -> None:
        self.emit = emit
        self.items: list[OutputItem] = []
        self.open: OutputItem | None = None

    def _add(self, item: OutputItem) -> list[bytes]:
        self.items.append(item)
        self.open = item
        return [self.emit("response.output_item.added", output_index=len(self.items) - 1, item=dump(item))]

    def text(self, delta: str, logprobs: list[ChatTokenLogprob] | None = None) -> list[bytes]:
        events: list[bytes] = []
        if not isinstance(self.open, OutputMessage):
            events += self.close()
            events += self._add(OutputMessage(status="in_progress"))
            self.open.content.append(OutputText(text=""))
            events.append(self.emit("response.content_part.added", item_id=self.open.id,
                                    output_index=len(self.items) - 1, content_index=0, part=dump(OutputText(text=""))))
        if delta or logprobs:
            part = self.open.content[0]
            part.text += delta
            part.logprobs += logprobs or []
            events.append(self.emit("response.output_text.delta", item_id=self.open.id,
                                    output_index=len(self.items) - 1, content_index=0, delta=delta,
                                    logprobs=[dump(lp) for lp in logprobs or []]))
        return events

    def reasoning(self, delta: str) -> list[bytes]:
        """Reasoning goes to an open reasoning item (vLLM's `reasoning_text` events)."""
        events: list[bytes] = []
        if not isinstance(self.open, OutputReasoning):
            events += self.close()
            events += self._add(OutputReasoning(status="in_progress"))
            self.open.content.append(ReasoningText(text=""))
            events.append(self.emit("response.content_part.added", item_id=self.open.id, output_index=len(self.items) - 1,
                                    content_index=0, part=dump(ReasoningText(text=""))))
        self.open.content[0].text += delta
        events.append(self.emit("response.reasoning_text.delta", item_id=self.open.id, output_index=len(self.items) - 1,
                                content_index=0, delta=delta))
        return events

    def call(self, call: ParsedCall) -> list[bytes]:
        events = self.close()
        events += self._add(OutputFunctionCall(status="in_progress", call_id=call.id, name=call.name, arguments=""))
        return events + self.arguments(call.arguments)

    def arguments(self, delta: str) -> list[bytes]:
        if not delta or not isinstance(self.open, OutputFunctionCall):
            return []
        self.open.arguments += delta
        return [self.emit("response.function_call_arguments.delta", item_id=self.open.id,
                          output_index=len(self.items) - 1, delta=delta)]

    def close(self, incomplete: bool = False) -> list[bytes]:
        item, index = self.open, len(self.items) - 1
        self.open = None
        if item is None:
            return []
        events = []
        item.status = "incomplete" if incomplete else "completed"
        if isinstance(item, OutputMessage):
            part = item.content[0]
            events.append(self.emit("response.output_text.done", item_id=item.id, output_index=index,
                                    content_index=0, text=part.text, logprobs=[dump(lp) for lp in part.logprobs]))
            events.append(self.emit("response.content_part.done", item_id=item.id, output_index=index,
                                    content_index=0, part=dump(part)))
        elif isinstance(item, OutputReasoning):
            part = item.content[0]
            events.append(self.emit("response.reasoning_text.done", item_id=item.id, output_index=index,
                                    content_index=0, text=part.text))
            events.append(self.emit("response.content_part.done", item_id=item.id, output_index=index,
                                    content_index=0, part=dump(part)))
        else:
            events.append(self.emit("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                    name=item.name, arguments=item.arguments))
        return [*events, self.emit("response.output_item.done", output_index=index, item=dump(item))]

    def finish(self, incomplete: bool, logprobs: list[ChatTokenLogprob]) -> list[bytes]:
        """Close the last item, the `logprobs` not yet sent going to its text; an answer with nothing in it
        is one empty message, as the whole one."""
        last_text = not self.items or isinstance(self.open, OutputMessage)
        events = self.text("", logprobs) if last_text and (logprobs or not self.items) else []
        return events + self.close(incomplete)


async def response_stream(group: RequestGroup, base: ResponseObject, plan: ToolPlan | None,
                          on_done: Callable[[ResponseObject], None],
                          logprobs_of: Callable[[CompletionOutput], list[ChatTokenLogprob]] | None = None,
                          thinking: ReasoningPlan | None = None,
                          emit: EventWriter | None = None) -> AsyncIterator[bytes]:
    """The events of one answer; `on_done` gets the final response (to store it) before the last event.
    With `logprobs_of` (a delta's log-probs), the text events carry them (a reasoning's tokens' go with the
    answer's first text, as the whole answer's text part holds every token's). `emit` numbers and writes
    them (a background stream's writes each to its log)."""
    emit = emit or EventWriter()
    items = StreamedItems(emit)
    thinker, reader = answer_readers(plan, thinking)
    show_reasoning = thinking is None or thinking.include
    finish_reason, error, cached = None, None, 0
    pending: list[ChatTokenLogprob] = []  # log-probs of tokens whose text is not out yet
    yield emit("response.created", response=dump(base)) + emit("response.in_progress", response=dump(base))
    try:
        async for updates in group:
            events: list[bytes] = []
            for _, out in updates:
                cached = max(cached, out.num_cached_tokens)
                for c in out.outputs:
                    done = c.finish_reason is not None
                    if logprobs_of is not None:
                        pending += logprobs_of(c)
                    reasoning, text = split_delta(thinker, c.text, done)
                    if reasoning and show_reasoning:
                        events += items.reasoning(reasoning)
                    content, calls, arguments = (text, [], "") if reader is None else reader.feed(text, done)
                    if content:
                        events += items.text(content, pending)
                        pending = []
                    for call in calls:
                        events += items.call(call)
                    events += items.arguments(arguments)
                    if done:
                        finish_reason = c.finish_reason if reader is None else reader.finish_reason(c.finish_reason)
                        error = c.error
            if events:
                yield b"".join(events)
    except (RequestAborted, RequestFailed) as e:
        finish_reason, error = ("error" if isinstance(e, RequestFailed) else "abort"), str(e)
    finally:
        group.abort()
    events = items.finish(finish_reason == "length", pending)
    stream = group.streams[0]
    usage = usage_of(len(stream.prompt_token_ids), stream.num_generation_tokens, cached)
    final = finished(base, items.items, finish_reason, usage, error)
    on_done(final)
    yield b"".join(events) + emit(FINAL_EVENTS[final.status], response=dump(final))
