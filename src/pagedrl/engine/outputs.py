"""vLLM-shaped results: `RequestOutput` with one `CompletionOutput` per sample.

What an output holds depends on the request's `output_kind` (see output_processor.py); `add` merges
DELTA outputs, for a consumer that wants the whole result in the end. They are slotted: a streaming
engine builds one of each per request per step, and none of them needs an instance dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Logprob contract: per sampled token, the log-prob under the distribution it was drawn from
    # (after temperature and truncation), and the raw log-softmax one.
    processed_logprobs: list[float] = field(default_factory=list)
    raw_logprobs: list[float] = field(default_factory=list)
    # With finish_reason "error": why the engine could not go on (a server answers it with an error).
    error: str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: CompletionOutput) -> None:
        """Append a later DELTA output of the same sample (costs what the delta holds)."""
        self.text += delta.text
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(delta.logprobs)
        self.processed_logprobs.extend(delta.processed_logprobs)
        self.raw_logprobs.extend(delta.raw_logprobs)
        self.cumulative_logprob = delta.cumulative_logprob
        self.finish_reason, self.stop_reason, self.error = delta.finish_reason, delta.stop_reason, delta.error


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)

    def add(self, delta: RequestOutput) -> None:
        """Merge a later DELTA output of the same request into this one (costs what the delta holds)."""
        mine = {c.index: c for c in self.outputs}
        new = False
        for c in delta.outputs:
            if c.index in mine:
                mine[c.index].add(c)
            else:
                self.outputs.append(c)
                mine[c.index] = c
                new = True
        if new:
            self.outputs.sort(key=lambda c: c.index)
        self.finished = delta.finished
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.metrics.update(delta.metrics)
