"""Background responses (`background: true`), as vLLM and OpenAI run them.

`POST /v1/responses` answers at once with the response `queued` (no output, no usage), and the answer
is made by a task of its own, not by the HTTP request: a client that goes away stops nothing, and the
server goes on serving while it runs. `GET /v1/responses/{id}` tells how it stands, `queued` until its
first token is out (waiting for the scheduler, or its prompt being computed), then `in_progress`, and
once it ends the whole response a foreground request would have got (`completed`, `incomplete` or
`failed`), kept in the store. `POST /v1/responses/{id}/cancel` stops it: the task is cancelled and its
engine request aborted, so its KV blocks are freed at the engine's next step; the response is then
`cancelled`, with the output it had (none), as vLLM keeps it.

With `stream` too, each event is kept in the run's log as it is written: the creating request reads
that log (closing it stops the reading, not the answer), and `GET /v1/responses/{id}?stream=true`
reads it again from the event after `starting_after` (a sequence number), while the answer runs and,
as long as the store keeps the response, after it.

Only a server that keeps responses runs them (vLLM's rule: the answer has nowhere else to be fetched
from), and only for a request with `store` (OpenAI's and vLLM's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pagedrl.engine.request_stream import RequestAborted, RequestFailed, RequestGroup
from pagedrl.server.errors import bad_request
from pagedrl.server.responses_bodies import ResponseObject, finished, usage_of

logger = logging.getLogger("pagedrl.server")

# what the runner does with the response it ended with: store it (with a stream's events) and log it
Keep = Callable[[ResponseObject, Sequence[bytes] | None], None]


class EventLog:
    """A background stream's events, each whole, in sequence-number order; readers wait for more
    until the log is closed."""

    def __init__(self) -> None:
        self.events: list[bytes] = []
        self.closed = False
        self._changed = asyncio.Event()

    def append(self, event: bytes) -> None:
        self.events.append(event)
        self._changed.set()

    def close(self) -> None:
        self.closed = True
        self._changed.set()

    async def read(self, start: int = 0) -> AsyncIterator[bytes]:
        """The events from index `start` (the sequence number after `starting_after`), as they come."""
        at = start
        while True:
            if at < len(self.events):
                chunk, at = b"".join(self.events[at:]), len(self.events)
                yield chunk
                continue
            if self.closed:
                return
            self._changed.clear()  # no await since the last look: no event can slip between
            await self._changed.wait()


async def replay(events: Sequence[bytes], start: int) -> AsyncIterator[bytes]:
    """A finished background stream's events from index `start`."""
    if start < len(events):
        yield b"".join(events[start:])


def failed(base: ResponseObject, group: RequestGroup, e: Exception) -> ResponseObject:
    """The response of an answer the engine could not finish (it failed, or the server shut down)."""
    stream = group.streams[0]
    usage = usage_of(len(stream.prompt_token_ids), stream.num_generation_tokens, 0)
    return finished(base, [], "error" if isinstance(e, RequestFailed) else "abort", usage, str(e))


@dataclass(eq=False)
class BackgroundRun:
    """One background response while it runs."""

    base: ResponseObject  # the request's settings, as the create request answered them
    group: RequestGroup
    keep: Keep
    log: EventLog | None = None  # with stream
    task: asyncio.Task | None = field(default=None, repr=False)

    def snapshot(self) -> ResponseObject:
        """The response as it stands: `queued` until its first token is out, then `in_progress`."""
        started = self.group.streams[0].first_token_time is not None
        return self.base.model_copy(update={"status": "in_progress" if started else "queued"})


class BackgroundRuns:
    """The background responses running now, by id. Each holds an engine request, so the engine's own
    admission bound bounds them; a finished one leaves for the store."""

    def __init__(self) -> None:
        self.runs: dict[str, BackgroundRun] = {}

    def get(self, response_id: str) -> BackgroundRun | None:
        return self.runs.get(response_id)

    def start(self, base: ResponseObject, group: RequestGroup, answer: Callable[[], Awaitable[ResponseObject]],
              keep: Keep, log: EventLog | None = None) -> BackgroundRun:
        """Run `answer` (the whole response, or a stream's final one) in a task; `keep` gets what it ended
        with. `base` is answered now, `queued`."""
        run = BackgroundRun(base.model_copy(update={"status": "queued", "background": True}), group, keep, log)
        self.runs[base.id] = run
        run.task = asyncio.create_task(self._run(run, answer), name=f"background response {base.id}")
        return run

    async def _run(self, run: BackgroundRun, answer: Callable[[], Awaitable[ResponseObject]]) -> None:
        try:
            try:
                response = await answer()
            except (RequestAborted, RequestFailed) as e:
                response = failed(run.base, run.group, e)
            except Exception as e:  # noqa: BLE001 - a bug must still end the response, not leave it queued
                logger.exception("background response %s failed", run.base.id)
                response = failed(run.base, run.group, e)
            if self.runs.get(run.base.id) is run:  # not cancelled meanwhile: storing and leaving go together
                run.keep(response, run.log.events if run.log is not None else None)
                del self.runs[run.base.id]
        finally:
            run.group.abort()
            if run.log is not None:
                run.log.close()

    async def cancel(self, response_id: str) -> ResponseObject | None:
        """Stop a running response (None if none runs with that id): its engine request is aborted, its
        task ended, and it is kept `cancelled`."""
        run = self.runs.get(response_id)
        if run is None:
            return None
        run.group.abort()
        if run.log is not None:
            run.log.close()
        # Kept `cancelled` before the run leaves and before the wait for its task: a GET, DELETE or a
        # request reusing the id meanwhile finds the cancelled response, never a gap
        response = run.base.model_copy(update={"status": "cancelled"})
        run.keep(response, run.log.events if run.log is not None else None)
        del self.runs[response_id]
        if run.task is not None:
            run.task.cancel()
            await asyncio.wait([run.task])
        return response

    def cancel_now(self, response_id: str) -> bool:
        """Stop a running response and keep nothing of it (it is being deleted)."""
        run = self.runs.pop(response_id, None)
        if run is None:
            return False
        run.group.abort()
        if run.log is not None:
            run.log.close()
        if run.task is not None:
            run.task.cancel()
        return True


def stream_query(query: dict[str, str]) -> tuple[bool, int]:
    """`GET /v1/responses/{id}`'s `stream` and `starting_after` (the events after that sequence number)."""
    stream = query.get("stream", "false").lower()
    if stream not in ("true", "false", "1", "0"):
        raise bad_request(f"stream must be true or false, got {query['stream']!r}", param="stream")
    after = query.get("starting_after")
    if after is None:
        return stream in ("true", "1"), 0
    if not after.isdigit():
        raise bad_request(f"starting_after must be a sequence number (an integer >= 0), got {after!r}",
                          param="starting_after")
    return stream in ("true", "1"), int(after) + 1
