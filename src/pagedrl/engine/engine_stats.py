"""What the engine has counted, in one snapshot: the numbers the server exports to Prometheus under
vLLM's names, the ones trainers and the demo check (prefix-cache hits, preemptions, the weight
version), and which LoRA adapters are in use and resident.

Callers read the engine through this snapshot rather than through its cache manager, scheduler or
adapter slots, so those can change without breaking them. It is built from plain ints and copied
lists, so the server's event loop may take one while the engine thread steps (no locks).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from pagedrl.engine.llm_engine import LLMEngine
    from pagedrl.engine.sequence import Sequence


@dataclass(frozen=True)
class LoRAResidency:
    """The adapters of an engine built with `enable_lora` (vLLM's `lora_requests_info` gauge reads
    the first three)."""

    max_loras: int  # adapters resident at once, and in one step
    running: tuple[str, ...]  # names of the adapters the running sequences use, sorted
    waiting: tuple[str, ...]  # names of the adapters waiting sequences ask for, sorted
    resident: tuple[str, ...]  # names of the adapters in the device slots now, by slot
    nbytes: int  # device memory the slots hold


@dataclass(frozen=True)
class EngineStats:
    """Gauges (requests, blocks, usage) as they are now; counters since the engine was built."""

    num_requests_running: int
    num_requests_waiting: int
    num_blocks_total: int
    num_blocks_used: int  # held by live sequences
    num_blocks_cached: int  # free, but keeping a prefix's hash until evicted
    kv_cache_usage_perc: float  # used over total: 1 means 100 percent
    prefix_cache_queries: int  # tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which found
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    num_forked_blocks: int  # prompt blocks shared by n > 1 samples instead of recomputed
    weight_version: int
    weight_bytes: int  # what the model's weights hold in memory (GGUF blocks where kept quantized)
    lora: LoRAResidency | None = None  # None: built without enable_lora

    def counters(self) -> dict[str, float]:
        """The numbers by name (what `LLM.stats()` returns): every field but `lora`."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "lora"}


def _adapter_names(seqs: list[Sequence]) -> tuple[str, ...]:
    return tuple(sorted({seq.lora.lora_name for seq in seqs if seq.lora is not None}))


def engine_stats(engine: LLMEngine, with_lora: bool = True) -> EngineStats:
    """The engine's numbers now; `with_lora` False leaves out the adapters' names (a counter read
    around every rollout needs none of them)."""
    kv, scheduler, slots = engine.kv_manager, engine.scheduler, engine.lora
    lora = None
    if slots is not None and with_lora:
        resident = tuple(slots.known[i].lora_name for i in list(slots.resident) if i is not None and i in slots.known)
        lora = LoRAResidency(slots.max_loras, _adapter_names(list(scheduler.running)),
                             _adapter_names(list(scheduler.waiting)), resident, slots.nbytes)
    return EngineStats(
        num_requests_running=len(scheduler.running), num_requests_waiting=len(scheduler.waiting),
        num_blocks_total=kv.num_blocks_total, num_blocks_used=kv.num_blocks_used,
        num_blocks_cached=kv.num_blocks_cached, kv_cache_usage_perc=kv.usage,
        prefix_cache_queries=kv.prefix_cache_queries, prefix_cache_hits=kv.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions, prompt_tokens=engine.prompt_tokens,
        generation_tokens=engine.generation_tokens, num_forked_blocks=engine.num_forked_blocks,
        weight_version=kv.weight_version, weight_bytes=engine.weight_bytes, lora=lora)


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's parameters and buffers, each tensor once (a tied head counted with its embedding)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())
