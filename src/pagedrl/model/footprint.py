"""What a model will take before any of it is loaded: parameters, parameters active per token (a
mixture of experts runs `num_experts_per_tok` of its experts), the bytes its weights will hold, and
the bytes each cached token's keys and values take; and a refusal, with those numbers, when the
weights cannot fit what the device has free.

Why before: a model too large for the machine otherwise dies mid-load at the hands of the kernel's
OOM killer (a CPU) or with an allocator error deep in a copy (a GPU), after minutes of reading, with
no word of what it needed. The counts come from the decoder itself built on the meta device (no
memory, no time), so every family the decoder builds is counted by the same code that will hold it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedrl.model.config import ModelConfig

GiB = 2**30
# Set to 0 to load whatever the device reports free (a machine that frees page cache or swaps on demand).
CHECK_ENV = "PAGEDRL_CHECK_MEMORY"


@dataclass(frozen=True)
class Footprint:
    parameters: int  # each tensor once (a tied head is its embedding)
    active_parameters: int  # what one token's forward multiplies by: all but the experts it is not routed to
    weight_bytes: int  # the parameters in the precision they will be held in
    kv_bytes_per_token: int  # keys and values (latent attention: latents) of every layer for one cached token
    dtype: torch.dtype
    # Latent attention (DeepSeek-V3): what the same token's keys and values would take cached in full,
    # every head's (qk_nope + qk_rope features of key, v_head_dim of value); None for the other families.
    full_kv_bytes_per_token: int | None = None
    # Sliding layers beside full ones (Gemma, gpt-oss): the part of `kv_bytes_per_token` the sliding layers
    # hold for the tokens of their window only (`engine/kv_cache_groups.py`), and the window; None otherwise.
    windowed: tuple[int, int] | None = None

    def describe(self, held_bytes: int | None = None) -> str:
        """One line for a start-up log; `held_bytes`: what the loaded weights really hold (quantized
        blocks are not `dtype`)."""
        active = (f", {self.active_parameters / 1e6:,.1f}M active per token"
                  if self.active_parameters != self.parameters else "")
        weights = (f"{self.weight_bytes / GiB:.2f} GiB of weights in {str(self.dtype).removeprefix('torch.')}"
                   if held_bytes is None else f"{held_bytes / GiB:.2f} GiB of weights held")
        latent = ("" if self.full_kv_bytes_per_token is None else
                  f" (latent attention: {self.kv_bytes_per_token} bytes a token against "
                  f"{self.full_kv_bytes_per_token} for every head's keys and values)")
        if self.windowed is not None:
            latent = (f" ({self.windowed[0] / 1024:.1f} KiB of it, the sliding layers', for the last "
                      f"{self.windowed[1]} tokens only)")
        return (f"{self.parameters / 1e6:,.1f}M parameters{active}, {weights}, "
                f"{self.kv_bytes_per_token / 1024:.1f} KiB of KV cache per token{latent}")


def footprint(cfg: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> Footprint:
    """The footprint of the causal LM `cfg` describes, its weights and KV cache held in `dtype`
    (`kv_dtype` if the cache differs)."""
    from pagedrl.model.decoder import CausalLM  # the decoder imports the config module, not this one

    with torch.device("meta"):
        model = CausalLM(cfg)
    unique = {id(p): p for p in model.parameters()}
    parameters = sum(p.numel() for p in unique.values())
    idle = 0  # expert parameters a token does not use
    for module in model.modules():
        experts = getattr(module, "experts", None)
        top_k = getattr(module, "top_k", None)
        if experts is not None and top_k is not None:
            per_expert = sum(p.numel() for p in experts.parameters()) // cfg.num_experts
            idle += (cfg.num_experts - top_k) * per_expert
    element = torch.empty(0, dtype=dtype).element_size()
    kv_element = torch.empty(0, dtype=kv_dtype or dtype).element_size()
    heads, head_dim, values = cfg.kv_cache_layout
    kv = (2 if values else 1) * cfg.num_hidden_layers * heads * head_dim * kv_element
    full = None
    if cfg.deepseek is not None:
        per_head = cfg.deepseek.qk_head_dim + cfg.deepseek.v_head_dim
        full = cfg.num_hidden_layers * cfg.num_attention_heads * per_head * kv_element
    windows = cfg.layer_windows
    windowed = None
    if len(set(windows)) > 1:  # (the groups of `engine/kv_cache_groups.py`)
        sliding = [w for w in windows if w is not None]
        windowed = (kv // cfg.num_hidden_layers * len(sliding), max(sliding))
    return Footprint(parameters, parameters - idle, parameters * element, kv, dtype, full, windowed)


def available_bytes(device: torch.device) -> tuple[int, str] | None:
    """Memory free for new tensors on `device` and where the figure comes from; None where unknown."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free, f"free on {device} (torch.cuda.mem_get_info)"
    if device.type == "cpu":
        meminfo = Path("/proc/meminfo")
        if not meminfo.is_file():
            return None
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    return None


class DoesNotFit(MemoryError):
    """A model whose weights cannot fit the memory the device has free; the message has the numbers."""


def check_fits(fp: Footprint, device: torch.device, source: str) -> None:
    """Refuse, before loading, a model whose weights need more than `device` has free (the KV cache
    comes on top of that; its budget is checked when it is allocated)."""
    if os.environ.get(CHECK_ENV, "").strip() == "0":
        return
    free = available_bytes(device)
    if free is None or fp.weight_bytes <= free[0]:
        return
    dtype = str(fp.dtype).removeprefix("torch.")
    smaller = "" if fp.dtype.itemsize <= 2 else " --dtype bfloat16 (or a trainer's bf16: true),"
    raise DoesNotFit(
        f"{source}: the model needs {fp.weight_bytes / GiB:.2f} GiB for its weights alone "
        f"({fp.parameters / 1e6:,.1f}M parameters in {dtype}) but {device} has {free[0] / GiB:.2f} GiB free "
        f"({free[1]}); load it in less:{smaller} a GGUF of it kept quantized (--quantization gguf), a gpt-oss checkpoint with "
        f"its MXFP4 experts kept (--quantization mxfp4), or a "
        f"smaller model ({CHECK_ENV}=0 loads it anyway)")
