"""Dithered float32 masters, so that a bf16 run's steps reach the bf16 weights it computes with.

Under bf16 autocast the optimizer updates float32 master weights, but every forward (the trainer's
and, through its bf16 copies, the engine's rollouts and evaluations) computes with the masters
rounded to the nearest bfloat16. A bf16 step is 2^-8 of a weight: 2.4e-4 at SmolLM2's median weight
of 0.1, while Adam at lr 1e-5 moves a weight about 1e-5 a step. Rounding to nearest is unbiased only
when the masters sit anywhere in their bf16 step with equal chance. A checkpoint stored in bf16 puts
every weight exactly on a bf16 value, and a dequantized GGUF clusters them (20.7% exactly on one for
the default model): such a weight must move half a step, 12 or more Adam steps in one direction,
before the computing copy changes at all. Measured on the default model (`bench/bf16_masters.py`):
after six Adam steps at lr 1e-5 on an arithmetic NLL, a bf16 run's float32 masters went from 2.011
to 1.172 nats and their bf16 copy only to 1.358, 22% of the progress missing.

The fix is one draw at start-up: add to each trainable matrix a fixed uniform offset of less than
half a bf16 step (within the step on each side, so a weight already on a bf16 value rounds to that
same value: a bf16 checkpoint computes with exactly its own numbers). From then on a master's
position within its step is uniform, so its rounded copy moves as the master does on average. In
the same measurement the dithered copy stayed within 0.009 nats of its masters at every step, and
the draw cost 0.002 nats before any step. The masters, checkpoints included, keep the offsets: a
saved model loaded in bf16 computes what was trained. Seeded, so every rank and every rerun draws
the same offsets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

_SEED_OFFSET = 0x5EED_D17E  # keeps this draw apart from the run's other seeded streams


def bf16_neighbours(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(nearest bf16 value, distance up to the next bf16 value, distance down to the previous one),
    as float32. Zero gets zero distances: its neighbours are subnormal and a weight at zero moves
    freely in bf16 anyway."""
    rounded = values.to(torch.bfloat16)
    bits = rounded.view(torch.int16)
    away = (bits + 1).view(torch.bfloat16).float()  # next value away from zero (sign-magnitude)
    toward = (bits - 1).view(torch.bfloat16).float()
    centre = rounded.float()
    positive = centre > 0
    up = torch.where(positive, away, toward) - centre
    down = centre - torch.where(positive, toward, away)
    zero = centre == 0
    return centre, up.masked_fill(zero, 0.0).abs(), down.masked_fill(zero, 0.0).abs()


def dither_offsets(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Offsets uniform over one bf16 step around each value, strictly inside half a step on each
    side of its nearest bf16 value (so a value on a bf16 value still rounds to it)."""
    _, up, down = bf16_neighbours(values)
    s = (torch.rand(values.shape, generator=generator, dtype=torch.float32) - 0.5) * (1 - 2.0**-10)
    return (s * torch.where(s >= 0, up, down)).to(values.dtype)


@torch.no_grad()
def dither_masters(model: nn.Module, seed: int) -> None:
    """Add fixed sub-half-step offsets to `model`'s trainable float32 matrices (norm and bias
    vectors are not cast by autocast; frozen weights, e.g. a LoRA run's base, never move). The
    draw depends on `seed` and each parameter's name only."""
    for name, p in model.named_parameters():
        if not p.requires_grad or p.dim() < 2 or p.dtype != torch.float32:
            continue
        generator = torch.Generator().manual_seed((seed + _SEED_OFFSET + _name_hash(name)) % 2**63)
        p.add_(dither_offsets(p.detach().cpu(), generator).to(p.device))


def dither_for_run(config: Any, device: torch.device, *models: nn.Module | None) -> None:
    """Dither `models`' masters when the run computes in bf16 and `config.bf16_dither` is on; call it
    once the trainable parameters exist (adapters attached) and before any frozen copy is taken."""
    if config.bf16_dither and config.use_bf16(device):
        for model in models:
            if model is not None:
                dither_masters(model, config.seed)


def _name_hash(name: str) -> int:
    """A stable hash of a parameter name (Python's `hash` of a str changes between processes)."""
    h = 1469598103934665603
    for byte in name.encode():
        h = ((h ^ byte) * 1099511628211) % 2**64
    return h
