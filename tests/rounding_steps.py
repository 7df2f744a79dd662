"""The rounding error of each step of a decoder's forward, as `decoder_bound.py` carries it through a
model: how a run rounds (`Precision`), the signed perturbation each probe's result takes (`Rounding`),
and the steps themselves (products, norms, rotations, additions, the SwiGLU feed-forward) in float64,
each adding its own worst-case error per element with a random sign (the module docstring of
`decoder_bound.py` says why that bounds a float32 or bf16 forward)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from float_bounds import BF16, EXP_ERROR, U


@dataclass(frozen=True)
class Precision:
    """How a run rounds. Sums accumulate in float32 (torch's CPU kernels, oneDNN and the project's
    kernels all do); results are stored at unit roundoff `store` (those of products, attention and
    the MLP's gate: bf16 under autocast or in a bf16 module) or `keep` (norms, rotations and the
    residual stream: float32 under autocast); a product's inputs kept wider than it computes in are
    rounded (`cast`) once. `autocast`: float32 masters under bf16 autocast, whose linear layers compute
    with bf16 copies of the weights (each implementation rounds them alike, so the exact forward takes
    the copies too)."""

    store: float = U
    keep: float = U
    cast: float = 0.0
    autocast: bool = False


FLOAT32 = Precision()
BFLOAT16 = Precision(store=BF16, keep=BF16)  # a bf16 module
AUTOCAST = Precision(store=BF16, keep=U, cast=BF16, autocast=True)


class Rounding:
    """Adds, to each probe's result of a step, its worst-case error times a random sign (probe 0 exact)."""

    def __init__(self, precision: Precision, seed: int = 0) -> None:
        self.precision = precision
        self.store, self.keep, self.cast = precision.store, precision.keep, precision.cast
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, value: torch.Tensor, bound: torch.Tensor | float) -> torch.Tensor:
        """value + sign * bound, a sign per element."""
        signs = torch.randint(0, 2, value.shape, generator=self.generator, dtype=torch.float64).mul_(2).sub_(1)
        signs[0] = 0
        return value + signs * bound


def summed(n: int | torch.Tensor) -> float | torch.Tensor:
    """The standard deviation of a float32 sum of n terms' error, per unit of the terms' magnitudes:
    sqrt(n) U (Higham and Mary's model, see the module's docstring)."""
    return (n.double().clamp(min=1).sqrt() if isinstance(n, torch.Tensor) else math.sqrt(max(n, 1))) * U


def weight(t: torch.Tensor, rounding: Rounding, cast: bool = True) -> torch.Tensor:
    return (t.detach().bfloat16() if rounding.precision.autocast and cast else t.detach()).double()


def add(a: torch.Tensor, b: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    value = a + b
    return rounding(value, rounding.keep * value.abs())


def cast(x: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """A kept value rounded once for the products that read it (autocast; a no-op otherwise)."""
    return rounding(x, rounding.cast * x.abs()) if rounding.cast else x


def linear(x: torch.Tensor, layer: torch.nn.Module, rounding: Rounding) -> torch.Tensor:
    """x W^T + b (+ s (x A^T) B^T for a LoRA layer) on an input in the product's dtype: a float32 sum
    of K products and the bias is off by summed(K + 1) of its terms' magnitudes, the output's store by
    a unit of it."""
    w = weight(layer.weight, rounding)
    bias = getattr(layer, "bias", None)
    value, magnitude = x @ w.T, x.abs() @ w.abs().T
    if bias is not None:
        value, magnitude = value + weight(bias, rounding), magnitude + weight(bias, rounding).abs()
    store = rounding.store
    value = rounding(value, summed(w.shape[1] + 1) * magnitude + store * value.abs())
    if hasattr(layer, "lora_A") and not layer.disabled:
        a = linear(x, layer.lora_A, rounding)
        up = weight(layer.lora_B.weight, rounding) * layer.scaling
        magnitude = a.abs() @ up.abs().T + value.abs()
        value = value + a @ up.T
        value = rounding(value, summed(up.shape[1] + 2) * magnitude + store * value.abs())
    return value


def rms_norm(x: torch.Tensor, norm: torch.nn.Module, rounding: Rounding, stored: bool = False) -> torch.Tensor:
    """g * x / sqrt(mean(x^2) + eps), in float32. The scale is one number per row, so is its error:
    squares, a sum of D, a mean and the epsilon (summed(D + 2), relative), half of it after the square
    root, which is within a library function's error. Then the scaling (U), its rounding to the
    input's dtype (a stored one's: `stored`, else a kept one's) and the product with g (kept)."""
    g = weight(norm.weight, rounding, cast=False)
    r = (x.pow(2).mean(-1, keepdim=True) + norm.eps).rsqrt()
    r = rounding(r, r * (summed(x.shape[-1] + 2) / 2 + EXP_ERROR))
    value = g * x * r
    return rounding(value, value.abs() * (U + (rounding.store if stored else rounding.keep) + rounding.keep))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """RoPE on x [P, B, T, heads, D] with the (perturbed) cos and sin [P, B, T, D/2]: each element a
    sum of two products, kept (a unit of the products' magnitudes, a unit of the result)."""
    if 2 * cos.shape[-1] < x.shape[-1]:  # a partial rotation: the first features turn, the rest pass
        turned = 2 * cos.shape[-1]
        return torch.cat((rotate(x[..., :turned], cos, sin, rounding), x[..., turned:]), -1)
    half = x.shape[-1] // 2
    c, s = cos[..., None, :], sin[..., None, :]
    a, b = x[..., :half], x[..., half:]
    value = torch.cat((a * c - b * s, b * c + a * s), -1)
    magnitude = torch.cat((a.abs() * c.abs() + b.abs() * s.abs(), b.abs() * c.abs() + a.abs() * s.abs()), -1)
    return rounding(value, rounding.keep * (magnitude + value.abs()))


def silu_mul(gate: torch.Tensor, up: torch.Tensor, rounding: Rounding) -> torch.Tensor:
    """silu(g) * u: silu's value g / (1 + exp(-g)) is within an exp's error and three roundings, its
    store a unit; the product's store a unit."""
    silu = torch.nn.functional.silu(gate)
    silu = rounding(silu, silu.abs() * (EXP_ERROR + 3 * U + rounding.store))
    value = silu * up
    return rounding(value, value.abs() * rounding.store)


def swiglu(h: torch.Tensor, gate: Any, up: Any, down: Any, rounding: Rounding) -> torch.Tensor:
    """down(silu(gate(h)) * up(h)): the dense feed-forward, and each expert's."""
    return linear(silu_mul(linear(h, gate, rounding), linear(h, up, rounding), rounding), down, rounding)
