"""One engine request as the event loop sees it (`RequestStream`), and the requests of one API call
iterated together (`RequestGroup`): what the server's handlers read, while `AsyncEngine` feeds them
from the engine thread.

A stream keeps one pending output, not a queue: a CUMULATIVE output replaces the pending one (it
carries everything so far), a DELTA output is merged into it (the cost of what it adds), so a
consumer that falls behind loses nothing and slow clients cannot make memory grow beyond what they
have not read yet.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedrl.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from pagedrl.engine.async_engine import AsyncEngine


class RequestAborted(RuntimeError):
    """The request ended without finishing: the server aborted it (shutdown or an engine error)."""


class RequestFailed(RuntimeError):
    """The engine ended the request with finish_reason "error" (its logits went NaN or infinite): not a
    reason to retry, as an abort is, and never a 200 with what was sampled from garbage (HTTP 500)."""


@dataclass(eq=False)
class RequestStream:
    """One engine request as seen from the event loop: the latest output and per-request timings."""

    request_id: str
    prompt_token_ids: list[int]
    notify: asyncio.Event
    arrival: float = field(default_factory=time.monotonic)
    pending: RequestOutput | None = None
    last: RequestOutput | None = None
    done: bool = False
    error: BaseException | None = None
    finish_reason: str | None = None  # of the first sample; "abort" if not finished, "error" if it failed
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)
    num_generation_tokens: int = 0
    num_seqs: int = 1  # the request's samples: what it counts against the admission bound
    delta: bool = False  # outputs are DELTA: merge them, do not replace

    def put(self, out: RequestOutput, now: float) -> None:
        num = sum(len(c.token_ids) for c in out.outputs)
        if self.delta:
            num += self.num_generation_tokens
        if num > self.num_generation_tokens:
            if self.first_token_time is None:
                self.first_token_time = now
            else:
                self.inter_token_latencies.append(now - self.last_token_time)
            self.last_token_time = now
            self.num_generation_tokens = num
        if self.delta and self.pending is not None:
            self.pending.add(out)
        else:
            self.pending = out
        self.last = out
        if out.finished:
            self.end(out.outputs[0].finish_reason, now)
        self.notify.set()

    def end(self, finish_reason: str | None, now: float, error: BaseException | None = None) -> None:
        self.done = True
        self.finish_reason = finish_reason
        self.finish_time = now
        self.error = error
        self.notify.set()

    @property
    def finished(self) -> bool:
        """Ended with a final output (not aborted, not failed)."""
        return self.last is not None and self.last.finished


class RequestGroup:
    """The engine requests of one API call (one per prompt), iterated together.

    `async for updates in group` yields lists of `(prompt_index, latest RequestOutput)`; iteration
    ends when every request has finished, and raises `RequestAborted` if one ended otherwise.
    """

    def __init__(self, engine: AsyncEngine, streams: list[RequestStream], notify: asyncio.Event) -> None:
        self.engine = engine
        self.streams = streams
        self.notify = notify

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> list[tuple[int, RequestOutput]]:
        while True:
            ready = []
            for i, s in enumerate(self.streams):
                if s.pending is not None:
                    ready.append((i, s.pending))
                    s.pending = None
            if ready:
                return ready
            for s in self.streams:
                if s.done and not s.finished:
                    raise s.error or RequestAborted(f"request {s.request_id} was aborted")
            if all(s.done for s in self.streams):
                raise StopAsyncIteration
            self.notify.clear()
            await self.notify.wait()

    async def final_outputs(self) -> list[RequestOutput]:
        """Wait for every request to finish and return the final outputs, in prompt order (DELTA outputs
        merged into whole ones)."""
        whole: dict[int, RequestOutput] = {}
        async for updates in self:
            for i, out in updates:
                if i in whole and self.streams[i].delta:
                    whole[i].add(out)
                else:
                    whole[i] = out
        return [whole.get(i, s.last) for i, s in enumerate(self.streams)]

    def abort(self) -> None:
        """Abort every request of the group that has not ended (idempotent)."""
        for s in self.streams:
            if not s.done:
                self.engine.abort(s.request_id)
