"""Rotary position embeddings, with the `linear` and `llama3` frequency scalings."""

from __future__ import annotations

import functools
import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies per rotary pair, in float64 first so every path agrees to the last bit."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling["rope_type"]
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are stretched by `factor`; short ones kept; the band between blends smoothly.
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        mid = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(mid, blended, scaled).float()
    raise ValueError(f"unsupported rope_type {kind!r}")


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape positions.shape + [head_dim]: the angles in float32 as transformers forms
    them, their exact cos and sin rounded once to `dtype`.

    Why not torch's cos on a CPU: it hands float32 and float64 alike to a vector math library whose
    worker threads round differently from the calling thread, and how many threads share a call
    depends on its size and on the library's run-time choice. A position's table then had other
    bits in an engine's decode rows than in a trainer's packed batch in about one process out of
    five (a bf16 rollout's log-probs 3e-2 off the trainer's), and other bits from one process to
    the next. On a CPU the values come from a table of Python's float64 math, made once per
    process and frequency set; elsewhere from float64 on the device."""
    if positions.device.type != "cpu":
        angles = (positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)).double()
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    else:
        length = int(positions.max()) + 1 if positions.numel() else 1
        cos_table, sin_table = _cpu_table(tuple(inv_freq.tolist()), max(256, 1 << (length - 1).bit_length()))
        cos, sin = cos_table[positions].to(dtype), sin_table[positions].to(dtype)
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


@functools.lru_cache(maxsize=16)
def _cpu_table(inv_freq: tuple[float, ...], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[length, len(inv_freq)] float64 cos and sin of the float32 angles position x frequency (a
    length a power of two, so a run grows it a few times at most)."""
    angles = (torch.arange(length, dtype=torch.float32).unsqueeze(-1) * torch.tensor(inv_freq, dtype=torch.float32))
    values = angles.reshape(-1).tolist()
    cos = torch.tensor([math.cos(a) for a in values], dtype=torch.float64).view(length, -1)
    sin = torch.tensor([math.sin(a) for a in values], dtype=torch.float64).view(length, -1)
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, heads, head_dim]; cos/sin: [..., T, head_dim] (the half-rotation layout of HF)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
