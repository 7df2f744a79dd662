"""Iteration-level scheduling under one token budget.

There is no prefill phase and no decode phase: each step every scheduled sequence's computed-token
count moves toward its token count, so chunked prefills and decodes share one forward pass (vLLM v1).
Running sequences go first, oldest first; waiting ones are admitted while the budget, `max_num_seqs`
and the KV cache allow. `max_num_seqs` counts sequences: a request that will fork into `n` samples
takes `n` seats when admitted, so the forks never push the running set past the limit.

Preemption rule: when the cache cannot hold the next step of a running sequence, the most recently
admitted running sequence is preempted by recompute (its blocks freed, its tokens kept, its computed
count reset to 0, and it goes back to the front of the waiting queue). Taking the newest protects the
oldest requests, which have the most invested and bound latency, and it guarantees progress: the
oldest request always fits on its own, because submission rejects requests that could never fit.
Freed blocks keep their prefix hashes, so a resumed sequence usually re-reads most of its KV from the
cache instead of recomputing it.

Admission: the head of the waiting queue is looked up in the prefix cache (a query), then its hit
blocks and fresh ones are allocated together or not at all. A sequence that does not fit holds no
block while it waits and is not counted in the prefix-cache statistics until it is admitted; a
preempted sequence that comes back is admitted anew, and its hits, which spare a recompute, count.
With LoRA adapters, at most `max_loras` distinct ones run at once (the engine's resident slots): a
waiting sequence whose adapter would be one too many is passed over, keeping its place, and the ones
behind it may go first (vLLM does the same).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from pagedrl.engine.kv_cache_manager import ComputedBlocks, KVCacheManager
from pagedrl.engine.sequence import RUNNING, Sequence, SequenceStatus, wants_prompt_logprobs


@dataclass
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 enable_chunked_prefill: bool = True, max_loras: int | None = None) -> None:
        self.kv_manager = kv_manager
        self.max_loras = max_loras  # adapters running at once (the engine's resident slots)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A fork of a running sequence: it already owns blocks, so it runs at once."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv_manager.free(seq.seq_id)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        allocate = self.kv_manager.allocate_slots
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            while not allocate(seq.seq_id, seq.token_ids, seq.num_computed_tokens, num_new, None, seq.block_hashes,
                               seq.cache_salt):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq.status is not RUNNING:
                break
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1

        seats = sum(s.seats for s in self.running)
        adapters = set() if self.max_loras is None else {s.lora.lora_int_id for s in self.running if s.lora is not None}
        held_back: list[Sequence] = []  # their adapter would be one too many; they keep their place
        while (self.waiting and budget > 0 and seats + self.waiting[0].seats <= self.max_num_seqs
               and not batch.preempted):
            seq = self.waiting[0]
            lora = seq.lora.lora_int_id if seq.lora is not None else None
            if lora is not None and lora not in adapters and len(adapters) >= (self.max_loras or 0):
                held_back.append(self.waiting.popleft())
                continue
            # A query: the hit blocks are taken, and the lookup counted, only if the sequence is
            # admitted, so a sequence that waits for memory holds none and is counted once. A request
            # for prompt log-probs needs every prompt row computed, so it takes no hits.
            if wants_prompt_logprobs(seq):
                computed = ComputedBlocks([], [], 0, 0)
            else:
                computed = self.kv_manager.get_computed_blocks(seq.token_ids, seq.block_hashes, seq.cache_salt)
            remaining = seq.num_tokens - computed.num_tokens
            num_new = min(remaining, budget)
            fits = num_new == remaining or self.enable_chunked_prefill
            if not fits or not self.kv_manager.allocate_slots(seq.seq_id, seq.token_ids, computed.num_tokens,
                                                              num_new, computed, seq.block_hashes, seq.cache_salt):
                break
            seq.num_computed_tokens = computed.num_tokens
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = computed.num_tokens
            self.waiting.popleft()
            seats += seq.seats
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            if lora is not None:
                adapters.add(lora)
        self.waiting.extendleft(reversed(held_back))
        return batch

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.kv_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        # Victims come from the tail of `running`, which this step has not reached yet.
        assert seq not in batch.seqs
