"""The rollout's importance-sampling correction: the engine/trainer log-prob gap, corrected as TRL 1.16's
GRPOTrainer corrects vLLM's (`vllm_importance_sampling_mode`, here `tis_mode`).

The engine samples with paged attention, the trainer recomputes the log-probs densely; the two differ by
rounding (more in bf16), which makes the rollout slightly off-policy. Each completion token's loss is
multiplied by a weight built from ρ = π_trainer / π_engine of the rollout (before any update), detached:

- `token_truncate`: per token, ρ clamped to [C_min, C_max] (Yao et al. 2025's truncated IS);
- `token_mask`: per token, ρ, or 0 where ρ lies outside [C_min, C_max] (the token drops out);
- `sequence_truncate`: one weight per completion, exp of the sum of its tokens' log ρ, clamped;
- `sequence_mask`: that completion weight, or 0 outside [C_min, C_max] (the whole completion drops out).

A missing bound (None) is no bound. Padding's difference counts as 0 (ρ = 1), a NaN difference too, as
TRL's `nan_to_num` makes it; a sequence weight is the product over the whole completion, not a mean, so a
long completion's weight moves further from 1 than a short one's.
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from torch import Tensor

TisMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
TIS_MODES: tuple[str, ...] = get_args(TisMode)


def is_sequence_mode(mode: str) -> bool:
    """Whether `mode` weighs whole completions ([B, 1] weights) rather than tokens ([B, T])."""
    return mode in ("sequence_truncate", "sequence_mask")


def tis_weight(old_logp_trainer: Tensor, sampling_logp_engine: Tensor, cap: float | None,
               mode: str = "token_truncate", mask: Tensor | None = None, floor: float | None = None) -> Tensor:
    """The rollout's importance weights under `mode` (module docstring), detached: [B, T] for the token
    modes, [B, 1] for the sequence modes, with TRL's arithmetic step for step. `cap` is C_max (TRL's
    `vllm_importance_sampling_clip_max`), `floor` C_min (`vllm_importance_sampling_clip_min`); a
    truncating mode needs at least one of them. `mask` ([B, T], bool or 0/1) marks the completion tokens
    (None: every position), which a sequence mode needs to sum over."""
    if sampling_logp_engine.shape != old_logp_trainer.shape:
        raise ValueError(
            f"sampling_logp_engine: shape {tuple(sampling_logp_engine.shape)} differs from "
            f"old_logp_trainer's {tuple(old_logp_trainer.shape)}"
        )
    if mode not in TIS_MODES:
        raise ValueError(f"mode: unknown importance sampling mode {mode!r}; expected one of {', '.join(TIS_MODES)}")
    if cap is not None and not cap > 0:
        raise ValueError(f"cap: must be positive, got {cap}")
    if mode.endswith("_truncate") and cap is None and floor is None:
        raise ValueError(f"cap: {mode} needs a bound, cap or floor")
    with torch.no_grad():
        diff = old_logp_trainer - sampling_logp_engine
        if mask is not None:
            if mask.shape != diff.shape:
                raise ValueError(f"mask: shape {tuple(mask.shape)} differs from the log-probs' {tuple(diff.shape)}")
            diff = diff * mask.to(diff.dtype)
        diff = torch.nan_to_num(diff, nan=0.0)  # TRL's: a token without an engine log-prob weighs 1
        if is_sequence_mode(mode):
            diff = diff.sum(dim=-1, keepdim=True)
        ratio = torch.exp(diff)
        if mode.endswith("_truncate"):
            return torch.clamp(ratio, min=floor, max=cap)
        low = floor if floor is not None else -math.inf
        high = cap if cap is not None else math.inf
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def tis_ratio_values(weight: Tensor, mask: Tensor, mode: str) -> Tensor:
    """The weights TRL's `sampling/importance_sampling_ratio/*` metrics read, flat: every completion's
    under a sequence mode (one each, an empty completion's 1 included), the completion tokens' otherwise
    (a masked-out token's 0 included). By the mode, not the weights' shape: with one-token completions
    the two are alike."""
    return weight.flatten() if is_sequence_mode(mode) else weight[mask.bool()]
