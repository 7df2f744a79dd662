"""The engine's settings, vLLM's names where vLLM has one, checked before anything is built."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedrl.engine.attention import resolve_impl


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_cache_tokens: int | None = None  # budget in tokens; or
    kv_cache_bytes: int | None = None  # budget in bytes; default on CUDA: a share of free memory
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    seed: int = 0
    attention_impl: str = "auto"  # triton on CUDA, fast elsewhere; or "reference": the obviously-right loop
    enforce_eager: bool = False  # decode steps through the modules: no CUDA graphs, no CPU program (vLLM's name)
    autocast_dtype: torch.dtype | None = None  # run the model under torch.autocast in this dtype (a trainer's bf16)
    # Under autocast, keep low-precision copies of the projection weights, made once per weight change
    # (`cast_weights`); off where the module's parameters are swapped between steps (FSDP2's gathers).
    cast_weights: bool = True
    # Many LoRA adapters chosen per request (`multi_lora`): slots on the device, highest rank, CPU copies kept.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # default: max_loras
    # A request's numbers do not depend on what else runs in its steps (`model/batch_invariant.py`; CPU).
    batch_invariant: bool = False

    def validate(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        resolve_impl(self.attention_impl, "cpu")
        if self.autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast_dtype must be None, torch.bfloat16 or torch.float16, got {self.autocast_dtype!r}")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least one block "
                             f"of block_size={self.block_size} tokens")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < 1):
            raise ValueError(f"max_cpu_loras must be a positive integer, got {self.max_cpu_loras!r}")
