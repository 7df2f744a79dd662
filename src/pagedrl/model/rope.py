"""Rotary position embeddings, with the `linear`, `llama3`, `longrope` and `yarn` frequency scalings, over all
of a head or its first `rotary_dim` features (a partial rotation, Phi-4-mini's)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from pagedrl.model import routed


@dataclass(frozen=True)
class LongRope:
    """LongRoPE (Phi-3's `rope_type` "longrope"): two frequency sets, `short_factor` and `long_factor`
    dividing the plain frequencies pair by pair, and cos/sin scaled by `attention_factor`.

    Which set a token takes: transformers picks one for a whole forward by its longest position (long
    once it passes `original_max_position_embeddings`), so in its `generate` the tokens after that
    point are rotated with the long set and the cached ones stay as they were. pagedrl decides per
    position, the same way: position p takes the long set iff p >= original_max_position_embeddings.
    That is transformers' `generate` exactly for a prompt within the original length (whatever the
    output's length) and its forward exactly for any sequence within it; a sequence longer than that
    in one forward (a long prompt, a trainer's long row) transformers rotates whole with the long set,
    pagedrl its first positions with the short one. The rule depends on the position alone, so the
    engine's chunks, its batches and the trainer's packed rows give one token the same rotation."""

    original_max_position_embeddings: int
    attention_factor: float


def longrope_of(scaling: dict[str, Any] | None, max_position_embeddings: int) -> LongRope | None:
    """The LongRoPE parameters of a rope scaling (None for other kinds), the attention factor as
    transformers derives it when the config names none: sqrt(1 + ln(s) / ln(original)) for the
    context's stretch s = `factor`, else max_position_embeddings / original."""
    if not scaling or scaling["rope_type"] != "longrope":
        return None
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor")
    factor = max_position_embeddings / original if factor is None else float(factor)
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRope(original, float(attention))


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies per rotary pair, in float64 first so every path agrees to the last bit
    (`head_dim`: the rotated features). LongRoPE's are [2, head_dim / 2]: the short set, the long set."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).double() / head_dim))
    if not scaling:
        return inv_freq.float()
    kind = scaling["rope_type"]
    if kind == "longrope":
        factors = torch.tensor([scaling["short_factor"], scaling["long_factor"]], dtype=torch.float64)
        return (inv_freq / factors).float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
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


def yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's frequencies as transformers' `_compute_yarn_parameters` forms them, in float32: the fast pairs
    (more than `beta_fast` turns over the original context) kept, the slow ones (under `beta_slow`)
    divided by `factor`, a linear ramp between (its ends rounded outward unless `truncate` is false, as gpt-oss
    sets it)."""
    factor, original = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 - torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN multiplies cos and sin by (1 for the other scalings; LongRoPE's is `LongRope`'s):
    the config's `attention_factor`, else mscale(factor, mscale) / mscale(factor, mscale_all_dim), as
    transformers derives it."""
    if not scaling or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = float(scaling["factor"]), scaling.get("mscale"), scaling.get("mscale_all_dim")
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype,
                 longrope: LongRope | None = None,
                 attention_factor: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape positions.shape + [rotary dim]: the angles in float32 as transformers forms
    them, their exact cos and sin rounded once to `dtype` (LongRoPE: each position's frequency set,
    `LongRope`, and the product with the attention factor before the rounding; YaRN's `attention_factor` likewise).

    Why not torch's cos on a CPU: it hands float32 and float64 alike to a vector math library whose
    worker threads round differently from the calling thread, and how many threads share a call
    depends on its size and on the library's run-time choice. A position's table then had other
    bits in an engine's decode rows than in a trainer's packed batch in about one process out of
    five (a bf16 rollout's log-probs 3e-2 off the trainer's), and other bits from one process to
    the next. On a CPU the values come from a table of Python's float64 math, made once per
    process and frequency set; elsewhere from float64 on the device."""
    if longrope is not None:
        long = (positions >= longrope.original_max_position_embeddings).unsqueeze(-1)
        (short_cos, short_sin), (long_cos, long_sin) = (_cos_sin(positions, f) for f in inv_freq)
        cos = torch.where(long, long_cos, short_cos) * longrope.attention_factor
        sin = torch.where(long, long_sin, short_sin) * longrope.attention_factor
        cos, sin = cos.to(dtype), sin.to(dtype)
    elif attention_factor != 1.0:  # YaRN's
        cos, sin = ((t * attention_factor).to(dtype) for t in _cos_sin(positions, inv_freq))
    else:
        cos, sin = (t.to(dtype) for t in _cos_sin(positions, inv_freq))
    return torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)


def _cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 cos and sin of the float32 angles positions x inv_freq [..., pairs] (see `rope_cos_sin`)."""
    if positions.device.type != "cpu":
        angles = (positions.to(torch.float32).unsqueeze(-1) * inv_freq.to(positions.device)).double()
        return angles.cos(), angles.sin()
    length = int(positions.max()) + 1 if positions.numel() else 1
    cos_table, sin_table = _cpu_table(tuple(inv_freq.tolist()), max(256, 1 << (length - 1).bit_length()))
    return cos_table[positions], sin_table[positions]


@functools.lru_cache(maxsize=16)
def _cpu_table(inv_freq: tuple[float, ...], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[length, len(inv_freq)] float64 cos and sin of the float32 angles position x frequency (a
    length a power of two, so a run grows it a few times at most)."""
    angles = (torch.arange(length, dtype=torch.float32).unsqueeze(-1) * torch.tensor(inv_freq, dtype=torch.float32))
    values = angles.reshape(-1).tolist()
    cos = torch.tensor([math.cos(a) for a in values], dtype=torch.float64).view(length, -1)
    sin = torch.tensor([math.sin(a) for a in values], dtype=torch.float64).view(length, -1)
    return cos, sin


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys rotated by their positions (through a route when one takes them); where cos/sin
    are narrower than a head (a partial rotation), its first features turn and the rest pass as they are."""
    rotary = cos.shape[-1]
    if rotary < q.shape[-1]:
        q_turned, k_turned = rotate(q[..., :rotary], k[..., :rotary], cos, sin)
        return torch.cat((q_turned, q[..., rotary:]), -1), torch.cat((k_turned, k[..., rotary:]), -1)
    routes = routed.current()
    if routes is not None:
        out = routes.rope(q, k, cos, sin)
        if out is not None:
            return out
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [..., T, heads, head_dim]; cos/sin: [..., T, head_dim] (the half-rotation layout of HF)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
