"""The engine behind a server: `LLMEngine.step()` in a background thread, results into asyncio.

The engine is single-threaded by design (scheduler, block tables and sampler state are plain Python),
so exactly one thread changes it: the engine thread. The event loop only reads it (tokenizing and
checking a prompt against the context and cache sizes, and `stats()`); it sends commands (add,
abort, stop) through a queue that the engine thread applies between steps, and the engine thread
hands each step's outputs back with `loop.call_soon_threadsafe`. A forward pass
therefore never blocks the event loop, and an abort frees the request's blocks before the next step.

Each request's outputs go to its `RequestStream` (`engine/request_stream.py`), which keeps one pending
output, merging DELTA outputs; servers ask for DELTA, so no step rebuilds what was already sent.

Admission is bounded in sequences, not requests (a request with `n` samples counts `n`): at most
`max_num_seqs + max_waiting_requests` sequences are in flight; beyond that `submit` raises
`EngineOverloaded`, which the server turns into 503, instead of queueing work that would only time
out. `n` above `max_num_seqs` can never run and is a ValueError (HTTP 400).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pagedrl.engine.engine_stats import EngineStats
from pagedrl.engine.llm_engine import LLMEngine
from pagedrl.engine.lora_request import LoRARequest
from pagedrl.engine.outputs import RequestOutput
from pagedrl.engine.request_checks import check_num_seqs, salt_key
from pagedrl.engine.request_stream import RequestAborted, RequestFailed, RequestGroup, RequestStream
from pagedrl.engine.sampling_params import RequestOutputKind, SamplingParams
from pagedrl.engine.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]
# Prompts longer than this (characters) are tokenized in a worker thread, not on the event loop.
LONG_PROMPT_CHARS = 16384
# When a step schedules nothing although requests are live, the engine thread waits this long for a
# command before it tries again, instead of spinning on an empty schedule.
IDLE_STEP_WAIT_S = 0.005


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the caller should retry later (HTTP 503)."""


class EngineDead(RequestAborted):
    """The engine thread stopped (shut down or crashed); no request can be served."""


class AsyncEngine:
    """`LLMEngine` driven by a background thread, fed and drained from an asyncio event loop."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int = 1024) -> None:
        if not isinstance(max_waiting_requests, int) or max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be a non-negative int, got {max_waiting_requests!r}")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.capacity = engine.config.max_num_seqs + max_waiting_requests  # in sequences
        self.streams: dict[str, RequestStream] = {}
        self.num_seqs_in_flight = 0
        self.listeners: list[Callable[[RequestStream], None]] = []
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._dead: BaseException | None = None

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is already running")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="pagedrl-engine", daemon=True)
        self._thread.start()

    def abort_all(self, reason: str) -> None:
        """End every request in flight with `RequestAborted(reason)` and accept no new ones: what a server
        does when its shutdown grace period is over, so each response can still end in an orderly way."""
        if self._dead is None:
            self._dead = EngineDead(reason)
        for s in list(self.streams.values()):
            self._end_stream(s, "abort", RequestAborted(reason))

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is still in flight, stop the engine thread and wait for it."""
        for s in list(self.streams.values()):
            self._end_stream(s, "abort", RequestAborted("the server is shutting down"))
        self._commands.put(("stop", None))
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        if self._dead is None:
            self._dead = EngineDead("the engine has been shut down")

    @property
    def is_healthy(self) -> bool:
        return self._dead is None and self._thread is not None and self._thread.is_alive()

    @property
    def num_in_flight(self) -> int:
        return len(self.streams)

    def stats(self) -> dict[str, float]:
        return self.engine.stats()

    def metrics_snapshot(self) -> EngineStats:
        """The engine's numbers and its adapters' residency (what `/metrics` exports), read from the
        event loop while the engine thread steps."""
        return self.engine.metrics_snapshot()

    @property
    def lora_enabled(self) -> bool:
        return self.engine.lora_enabled

    def read_lora(self, request: LoRARequest) -> object:
        """Read and check an adapter before it is served (ValueError naming what does not fit); safe
        off the engine thread."""
        return self.engine.read_lora(request)

    def check_structured_output(self, spec: StructuredOutputsParams) -> None:
        """ValueError naming the field when `spec` does not compile; cached, so a repeat costs nothing.
        Safe off the engine thread (a first compile builds the tokenizer's tables: run it in a worker)."""
        self.engine.grammar_compiler().check(spec)

    # Fixed when the engine is built, so safe to read from the event loop.
    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def eos_token_ids(self) -> list[int]:
        """The ids that end a sample (the model's and the tokenizer's), which end a beam too."""
        return self.engine.eos_token_ids

    @property
    def max_logprobs(self) -> int:
        """The most alternatives a request may ask for (-1: no limit)."""
        return self.engine.config.max_logprobs

    @property
    def block_size(self) -> int:
        return self.engine.block_size

    # ------------------------------------------------------------------ requests (event loop side)
    async def submit(self, prompts: Sequence[Prompt], params: SamplingParams, request_id: str | None = None,
                     lora_request: LoRARequest | None = None, cache_salt: str | None = None) -> RequestGroup:
        """Validate and queue one request per prompt, all or none (each with the adapter of
        `lora_request`, if given, and the prefix-cache salt `cache_salt`, vLLM's).

        Raises ValueError for a bad prompt or one that cannot fit (including more sequences than the
        server ever holds), EngineOverloaded when the waiting queue is full and EngineDead when the
        engine has stopped.
        """
        if not self.is_healthy:
            raise self._dead or EngineDead("the engine is not running")
        if not prompts:
            raise ValueError("prompt is empty (no prompts given)")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        check_num_seqs(params, self.engine.config.max_num_seqs)  # before any loop over n
        salt_key(cache_salt)  # refused here, not in the engine thread
        wanted = len(prompts) * params.n
        if wanted > self.capacity:  # could never be admitted: not a reason to retry (a client would, forever)
            config = self.engine.config
            raise ValueError(f"n: {len(prompts)} prompt(s) x n={params.n} is {wanted} sequences; this server holds "
                             f"at most {self.capacity} at once (max_num_seqs {config.max_num_seqs} + "
                             f"max_waiting_requests {self.max_waiting_requests}); send fewer prompts or a smaller n")
        self._check_room(wanted)
        # a grammar compiles off the event loop too (the first one also builds the tokenizer's tables)
        long = (sum(len(p) for p in prompts if isinstance(p, str)) > LONG_PROMPT_CHARS
                or params.structured_outputs is not None)
        ids = await asyncio.to_thread(self._validate, prompts, params) if long else self._validate(prompts, params)
        self._check_room(wanted)  # again: others may have come in meanwhile
        base = request_id or uuid.uuid4().hex
        notify = asyncio.Event()
        delta = params.output_kind is RequestOutputKind.DELTA
        streams = [RequestStream(f"{base}-{i}", prompt_ids, notify, num_seqs=params.n, delta=delta)
                   for i, prompt_ids in enumerate(ids)]
        for s in streams:
            if s.request_id in self.streams:
                raise ValueError(f"request_id {s.request_id!r} is already in use")
        for s in streams:
            self.streams[s.request_id] = s
            self.num_seqs_in_flight += s.num_seqs
            self._commands.put(("add", (s.request_id, s.prompt_token_ids, params, lora_request, cache_salt)))
        return RequestGroup(self, streams, notify)

    def _check_room(self, wanted: int) -> None:
        if self.num_seqs_in_flight + wanted > self.capacity:
            raise EngineOverloaded(f"the server is overloaded: {self.num_seqs_in_flight} sequences in flight, "
                                   f"{wanted} more asked, at most {self.capacity} are accepted; retry later")

    def _validate(self, prompts: Sequence[Prompt], params: SamplingParams) -> list[list[int]]:
        """Tokenize and check every prompt without touching engine state (safe off the engine thread)."""
        out = []
        for p in prompts:
            ids = self.engine.encode(p, params)
            self.engine.check_fits(len(ids), params)
            out.append(ids)
        self.engine.check_structured_outputs(params)
        self.engine.token_choices.check(params)
        return out

    def abort(self, request_id: str) -> None:
        """Stop a request: the engine frees its blocks before its next step."""
        stream = self.streams.get(request_id)
        if stream is not None:
            self._end_stream(stream, "abort", None)

    def _forget(self, stream: RequestStream) -> None:
        if self.streams.pop(stream.request_id, None) is not None:
            self.num_seqs_in_flight -= stream.num_seqs

    def _end_stream(self, stream: RequestStream, reason: str, error: BaseException | None) -> None:
        self._forget(stream)
        stream.end(reason, time.monotonic(), error)
        self._commands.put(("abort", stream.request_id))
        self._notify_listeners(stream)

    def _notify_listeners(self, stream: RequestStream) -> None:
        for listener in self.listeners:
            try:
                listener(stream)
            except Exception:  # a broken metric must not break serving
                logger.exception("request listener failed")

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        """On the event loop: hand one step's outputs to their streams."""
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:  # aborted while the step ran
                continue
            error = next((c.error or "the engine failed" for c in out.outputs if c.finish_reason == "error"), None)
            if error is not None:  # the whole call fails, as in vLLM: its other samples are aborted
                self._end_stream(stream, "error", RequestFailed(f"request {out.request_id}: {error}"))
                continue
            stream.put(out, now)
            if out.finished:
                self._forget(stream)
                self._notify_listeners(stream)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            stream = self.streams.get(rid)
            if stream is not None:
                self._end_stream(stream, "abort", error)

    def _mark_dead(self, error: BaseException) -> None:
        self._dead = EngineDead(f"the engine stopped after an error: {error!r}")
        self._fail(list(self.streams), self._dead)

    # ------------------------------------------------------------------ the engine thread
    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _take_commands(self, block: bool, timeout: float | None = None) -> list[tuple[str, Any]]:
        commands = []
        if block:
            try:
                commands.append(self._commands.get(timeout=timeout))
            except queue.Empty:
                return commands
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _run(self) -> None:
        engine = self.engine
        idle_step = False  # the last step scheduled nothing: wait a little for a command, do not spin
        try:
            while True:
                busy = engine.has_unfinished_requests()
                for kind, arg in self._take_commands(block=not busy or idle_step,
                                                     timeout=IDLE_STEP_WAIT_S if busy else None):
                    if kind == "stop":
                        for rid in list(engine.requests):
                            engine.abort_request(rid)
                        return
                    if kind == "abort":
                        engine.abort_request(arg)
                    else:
                        self._add(*arg)
                idle_step = False
                if not engine.has_unfinished_requests():
                    continue
                try:
                    outputs = engine.step()
                except Exception as e:
                    self._recover(e)
                    continue
                idle_step = not outputs
                if outputs:
                    self._post(self._dispatch, outputs, time.monotonic())
        except BaseException as e:  # the thread itself failed: nothing will step again
            logger.exception("the engine thread stopped")
            self._post(self._mark_dead, e)

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
             lora_request: LoRARequest | None, cache_salt: str | None = None) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id, lora_request=lora_request,
                                    cache_salt=cache_salt)
        except ValueError as e:  # validated already; only a race with a changed engine gets here
            self._post(self._fail, [request_id], RequestAborted(f"the engine refused the request: {e}"))

    def _recover(self, error: Exception) -> None:
        """A step failed: fail every live request (so none waits forever) and carry on empty."""
        logger.exception("engine step failed; aborting %d requests", len(self.engine.requests))
        live = list(self.engine.requests)
        for rid in live:
            self.engine.abort_request(rid)
        self._post(self._fail, live, RequestAborted(f"the engine failed while running this request: {error!r}"))
