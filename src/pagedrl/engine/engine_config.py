"""The engine's settings, vLLM's names where vLLM has one, checked before anything is built.

Each field carries its default and its help text once (`setting`): `EngineArgs`
(`engine/engine_args.py`) adds what loading a model takes, and from there come `LLM`'s keyword
arguments, `pagedrl serve`'s flags and their `--help`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pagedrl.engine.attention import IMPLEMENTATIONS, resolve_impl
from pagedrl.engine.kv_cache import DEFAULT_CPU_BYTES, DEFAULT_CPU_TOKENS

# vLLM's `--kv-cache-dtype` spellings built here (its fp8 variants are not).
KV_CACHE_DTYPES = ("auto", "bfloat16")


class EngineSettingError(ValueError):
    """An engine setting that cannot work with the model loaded (named by its field: `pagedrl serve`
    spells it as the flag)."""


def setting(default: Any, help: str, group: str, *, cli: bool = True, choices: tuple[str, ...] | None = None,
            metavar: str | None = None) -> Any:
    """A dataclass field with its help text and where it shows in `--help` (`group`); `cli=False` for
    what only Python callers can pass (a dtype object, a trainer's choices)."""
    return field(default=default, metadata={"help": help, "group": group, "cli": cli, "choices": choices,
                                            "metavar": metavar})


@dataclass
class EngineConfig:
    block_size: int = setting(16, "tokens per KV-cache block: prefixes are shared in whole blocks", "cache")
    kv_cache_tokens: int | None = setting(
        None, "KV-cache size in tokens (default: kv_cache_bytes if given; else on CUDA gpu_memory_utilization of "
              f"the free memory, on a CPU {DEFAULT_CPU_BYTES >> 30} GiB and at most {DEFAULT_CPU_TOKENS} tokens)",
        "cache")
    kv_cache_bytes: int | None = setting(None, "KV-cache size in bytes, when kv_cache_tokens is not given", "cache")
    kv_cache_dtype: str = setting(
        "auto", "the dtype keys and values are cached in: auto, the dtype the model computes in; bfloat16, half "
                "a float32 model's cache bytes (twice the tokens in the same budget, half the bytes a decode step "
                "reads), each key and value rounded to bf16 as it is stored and attended in float32 on a CPU",
        "cache", choices=KV_CACHE_DTYPES)
    gpu_memory_utilization: float = setting(
        0.9, "on CUDA without a size given, the share of the GPU's memory the engine may fill", "cache")
    enable_prefix_caching: bool = setting(
        True, "reuse the KV blocks of a prompt prefix seen before (content-hashed blocks)", "cache")
    disable_hybrid_kv_cache_manager: bool = setting(
        False, "keep one block table for every layer where sliding-window layers sit beside full ones (Gemma, "
               "gpt-oss), rather than tables a group of layers that free what left the window", "cache")
    max_num_seqs: int = setting(256, "sequences per engine step at most", "scheduler")
    max_num_batched_tokens: int = setting(2048, "tokens per engine step at most", "scheduler")
    enable_chunked_prefill: bool = setting(
        True, "split a long prompt over several steps, beside the running sequences' decode tokens", "scheduler")
    max_model_len: int | None = setting(
        None, "the longest sequence (prompt + completion) served (default and at most: the model's context)",
        "model")
    seed: int = setting(0, "seed of the random stream of requests that carry no seed of their own", "model")
    attention_impl: str = setting(
        "auto", "paged attention: auto (triton on CUDA, fast elsewhere), fast, triton, or reference (the "
                "obviously-right loop)", "execution", choices=("auto", *IMPLEMENTATIONS))
    enforce_eager: bool = setting(
        False, "run decode steps through the model's modules: no CUDA graphs on CUDA, no straight program of "
               "the kernels on a CPU", "execution")
    autocast_dtype: torch.dtype | None = setting(
        None, "run the model under torch.autocast in this dtype (torch.bfloat16 or torch.float16; a trainer's "
              "bf16 rollouts)", "execution", cli=False)
    cast_weights: bool = setting(
        True, "under autocast, keep low-precision copies of the projection weights, made once per weight "
              "change (off where the parameters are swapped between steps: FSDP2's gathers)", "execution",
        cli=False)
    batch_invariant: bool = setting(
        False, "on a CPU, a request's log-probs and seeded samples do not depend on the requests it shares "
               "steps with (slower; model/batch_invariant.py)", "execution")
    enable_lora: bool = setting(
        False, "serve LoRA adapters chosen per request beside the base model, many in the same step", "lora")
    max_loras: int = setting(1, "adapters resident at once (and in one step)", "lora")
    max_lora_rank: int = setting(16, "the highest adapter rank served", "lora")
    max_cpu_loras: int | None = setting(
        None, "adapters kept in memory off the slots (default: max_loras); others are read again", "lora")
    max_logprobs: int = setting(
        20, "the most alternatives a request may ask for (logprobs, prompt_logprobs), as vLLM's; -1: no limit",
        "execution")

    def cache_dtype(self, compute_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype for a model computing in `compute_dtype` (its own, or autocast's)."""
        return compute_dtype if self.kv_cache_dtype == "auto" else torch.bfloat16

    def context_length(self, model_len: int) -> int:
        """The longest sequence served: `max_model_len`, or the model's context (`model_len`). As vLLM,
        a `max_model_len` past the model's context is refused, not quietly lowered, and so is a step
        budget that could never hold a whole prompt of that length when prompts are not chunked (such
        a prompt would wait for ever, and every request behind it)."""
        if self.max_model_len is not None and self.max_model_len > model_len:
            raise EngineSettingError(f"max_model_len ({self.max_model_len}) is longer than the model's context "
                                     f"({model_len}: its max_position_embeddings, or the sliding window it is capped "
                                     "at); leave it unset or lower it")
        length = self.max_model_len or model_len
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < length:
            raise EngineSettingError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                                     f"max_model_len ({length}) with enable_chunked_prefill off: a prompt longer than "
                                     "one step's budget could never be scheduled; raise max_num_batched_tokens, lower "
                                     "max_model_len, or leave chunked prefill on")
        return length

    def validate(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank",
                     *(("max_model_len",) if self.max_model_len is not None else ())):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be a non-negative integer or -1 (no limit), got {self.max_logprobs!r}")
        resolve_impl(self.attention_impl, "cpu")
        if self.autocast_dtype not in (None, torch.bfloat16, torch.float16):
            raise ValueError(f"autocast_dtype must be None, torch.bfloat16 or torch.float16, got {self.autocast_dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                             f"{self.kv_cache_dtype!r}" + (" (fp8 caches are not built)"
                                                           if str(self.kv_cache_dtype).startswith("fp8") else ""))
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise ValueError(f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least one block "
                             f"of block_size={self.block_size} tokens")
        if self.max_cpu_loras is not None and (not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < 1):
            raise ValueError(f"max_cpu_loras must be a positive integer, got {self.max_cpu_loras!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:  # as vLLM
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}): "
                             "what the slots hold is kept on the host too")
