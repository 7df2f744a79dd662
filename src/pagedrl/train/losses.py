"""Training losses as pure functions of tensors: no trainer state, no model, no optimizer.

Every trainer (SFT, reward model, DPO, GRPO) runs the same loop; what differs is the batch it
builds and which of these functions turns that batch into a scalar. Keeping them pure makes each one
checkable against a float64 hand computation and against TRL's own code. DPO's losses, a family of their
own over four log-probs per pair, are in `train/dpo_losses.py`.

Shapes: per-token tensors are [B, T] (one row per sequence, T completion positions; a packed batch
is scattered back to rows first) with a boolean or 0/1 `mask` marking the positions that count.
Positions outside the mask may hold anything, including NaN or inf (padding); they are filled,
never multiplied, so they cannot leak into a sum.

Micro-batching: a loss that divides by a count (tokens, sequences, pairs) takes that count as
`normaliser`. Pass the count of the whole optimizer step (all micro-batches, all ranks) and the
micro-batch losses add up to the full-batch loss, so the accumulated gradient does not depend on
how the batch was split. Under DDP, which averages gradients over ranks, pass the global count
divided by the world size (TRL does the same with `num_items_in_batch`).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

# ---------------------------------------------------------------------------------------------
# Aggregation: one explicit choice of how per-token losses become one number
# ---------------------------------------------------------------------------------------------

AggregationMode = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"]
AGGREGATION_MODES: tuple[str, ...] = get_args(AggregationMode)
# TRL GRPOConfig.loss_type -> aggregation. "bnpo" and "dapo" are the same sum over tokens; TRL's
# bnpo divides by the micro-batch's tokens, dapo by the accumulated batch's. Here the caller picks
# the count, and with the global count both are dapo.
LOSS_TYPE_AGGREGATION: dict[str, str] = {
    "grpo": "seq_mean_token_mean",
    "bnpo": "token_mean",
    "dapo": "token_mean",
    "cispo": "token_mean",  # TRL's cispo divides as dapo does
    "sapo": "seq_mean_token_mean",  # as grpo
    "vespo": "token_mean",  # as dapo
    "luspo": "seq_mean_token_sum",  # LUSPO: each sequence's loss scaled by its length
    "dr_grpo": "seq_mean_token_sum_norm",
}


def resolve_aggregation(mode: str) -> str:
    """The aggregation mode behind a mode name or a TRL GRPO `loss_type` alias."""
    if mode in AGGREGATION_MODES:
        return mode
    if mode in LOSS_TYPE_AGGREGATION:
        return LOSS_TYPE_AGGREGATION[mode]
    choices = ", ".join(AGGREGATION_MODES + tuple(LOSS_TYPE_AGGREGATION))
    raise ValueError(f"mode: unknown aggregation {mode!r}; expected one of {choices}")


def _bool_mask(mask: Tensor, like: Tensor, name: str = "mask") -> Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"{name}: shape {tuple(mask.shape)} does not match the values' {tuple(like.shape)}")
    return mask if mask.dtype == torch.bool else mask != 0


def _denominator(count: float | int | Tensor, like: Tensor, name: str) -> Tensor | float:
    """A count to divide by. A tensor count (typically all-reduced) is clamped to 1 so that an empty
    batch gives 0, not NaN, as TRL does; a Python number must be positive."""
    if isinstance(count, Tensor):
        return count.to(device=like.device, dtype=like.dtype).clamp(min=1.0)
    if isinstance(count, bool) or not count > 0:
        raise ValueError(f"{name}: must be a positive count, got {count!r}")
    return float(count)


def aggregate(
    per_token_loss: Tensor,
    mask: Tensor,
    mode: str,
    normaliser: float | int | Tensor | None = None,
    max_completion_length: int | None = None,
) -> Tensor:
    """Reduce a [B, T] per-token loss over the positions in `mask` to a scalar.

    Modes, and the `normaliser` that keeps each split-invariant:

    - `token_mean` (TRL `bnpo`/`dapo`): sum over all tokens / number of tokens. Every token weighs
      the same, so long sequences are not diluted. `normaliser` = tokens in the whole step;
      default: this batch's tokens (TRL's bnpo, which does depend on the split).
    - `seq_mean_token_mean` (TRL `grpo`): mean over each sequence's tokens, then mean over
      sequences. Splitting by rows never cuts a sequence, so only the outer mean needs a global
      count: `normaliser` = sequences in the whole step; default: this batch's rows.
    - `seq_mean_token_sum` (TRL `luspo`): sum over each sequence's tokens, then mean over sequences: a
      sequence weighs by its length. `normaliser` = sequences in the whole step; default: this batch's rows.
    - `seq_mean_token_sum_norm` (TRL `dr_grpo`, Dr. GRPO): sum over all tokens / (sequences ×
      `max_completion_length`), a constant that carries no length bias. `normaliser` = sequences
      in the whole step; default: this batch's rows. `max_completion_length` is required.
    """
    if per_token_loss.dim() != 2:
        raise ValueError(f"per_token_loss: expected [B, T], got shape {tuple(per_token_loss.shape)}")
    resolved = resolve_aggregation(mode)
    keep = _bool_mask(mask, per_token_loss)
    if per_token_loss.dtype in (torch.float16, torch.bfloat16):
        per_token_loss = per_token_loss.float()  # bf16 has 8 mantissa bits: sums and counts round
    masked = per_token_loss.masked_fill(~keep, 0.0)
    num_rows = per_token_loss.shape[0]
    if resolved == "token_mean":
        count = keep.sum() if normaliser is None else normaliser
        return masked.sum() / _denominator(count, masked, "normaliser")
    if resolved == "seq_mean_token_mean":
        lengths = keep.sum(dim=-1).clamp(min=1).to(masked.dtype)
        count = num_rows if normaliser is None else normaliser
        return (masked.sum(dim=-1) / lengths).sum() / _denominator(count, masked, "normaliser")
    if resolved == "seq_mean_token_sum":
        count = num_rows if normaliser is None else normaliser
        return masked.sum() / _denominator(count, masked, "normaliser")
    if max_completion_length is None or max_completion_length < 1:
        raise ValueError(
            f"max_completion_length: {resolved} needs a positive max_completion_length, got {max_completion_length!r}"
        )
    count = num_rows if normaliser is None else normaliser
    return masked.sum() / (_denominator(count, masked, "normaliser") * max_completion_length)


# ---------------------------------------------------------------------------------------------
# Supervised fine-tuning
# ---------------------------------------------------------------------------------------------


def sft_loss(token_logps: Tensor, mask: Tensor, num_items_in_batch: float | int | Tensor | None = None) -> Tensor:
    """Token-level cross-entropy: -sum(log p(label)) over the completion mask / number of tokens.

    `num_items_in_batch` is the number of label tokens in the whole optimizer step, as in
    transformers' `ForCausalLMLoss`; with it the micro-batch losses sum to the step's mean and the
    gradient does not depend on the split. Default: this batch's token count.
    """
    return aggregate(-token_logps, mask, "token_mean", normaliser=num_items_in_batch)


SFTLossType = Literal["nll", "dft"]


def dft_loss(token_logps: Tensor, mask: Tensor, num_items_in_batch: float | int | Tensor | None = None) -> Tensor:
    """Dynamic Fine-Tuning (Wu et al. 2025, TRL's SFT `loss_type: dft`): each token's -log p(label)
    weighted by p(label), the weight held constant (no gradient through it). Cross-entropy's gradient is
    an on-policy gradient with an importance weight 1/p; the factor p cancels it, so tokens the model finds
    improbable no longer dominate the update. Normalised as `sft_loss`."""
    return aggregate(-token_logps * token_logps.detach().exp(), mask, "token_mean", normaliser=num_items_in_batch)


# ---------------------------------------------------------------------------------------------
# Reward model (Bradley-Terry)
# ---------------------------------------------------------------------------------------------


def reward_model_loss(
    r_chosen: Tensor,
    r_rejected: Tensor,
    margin: Tensor | float | None = None,
    center_rewards_coefficient: float | None = None,
    normaliser: float | int | Tensor | None = None,
) -> Tensor:
    """Bradley-Terry pairwise loss as TRL's RewardTrainer.compute_loss computes it:

        mean(-logsigmoid(r+ - r- - margin)) + coef * mean((r+ + r-)^2)

    The centering term (Eisenstein et al. 2023) pins the reward scale, which the pairwise term
    leaves free. `normaliser` replaces both means' divisor by the number of pairs in the whole step.
    """
    if r_chosen.shape != r_rejected.shape:
        raise ValueError(f"r_rejected: shape {tuple(r_rejected.shape)} differs from r_chosen's {tuple(r_chosen.shape)}")
    diff = r_chosen - r_rejected
    if margin is not None:
        if isinstance(margin, Tensor) and margin.numel() != 1 and margin.shape != diff.shape:
            raise ValueError(f"margin: shape {tuple(margin.shape)} does not match the rewards' {tuple(diff.shape)}")
        diff = diff - margin
    count = diff.numel() if normaliser is None else normaliser
    denom = _denominator(count, diff, "normaliser")
    loss = -F.logsigmoid(diff).sum() / denom
    if center_rewards_coefficient is not None:
        loss = loss + center_rewards_coefficient * ((r_chosen + r_rejected) ** 2).sum() / denom
    return loss


# ---------------------------------------------------------------------------------------------
# Policy gradient (GRPO)
# ---------------------------------------------------------------------------------------------


class SurrogateOutput(NamedTuple):
    loss: Tensor  # [B, T] per-token loss, 0 outside the mask
    ratio: Tensor  # [B, T] exp(logp - old_logp) ([B, 1] at sequence level), differentiable, before any `delta` cap
    is_low_clipped: Tensor  # [B, T] bool ([B, 1] at sequence level): ratio < 1 - eps_low, A < 0 (and in mask)
    is_high_clipped: Tensor  # [B, T] bool ([B, 1] at sequence level): ratio > 1 + eps_high, A > 0
    is_region_clipped: Tensor  # [B, T] bool ([B, 1] at sequence level): either


def clipped_surrogate(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    cispo: bool = False,
    sapo: tuple[float, float] | None = None,
    vespo: Tensor | None = None,
    level: str = "token",
) -> SurrogateOutput:
    """PPO's clipped surrogate per token, as TRL's GRPO computes it for grpo/bnpo/dr_grpo/dapo/luspo:

        r = exp(logp - old_logp);  loss = -min(min(r, delta) · A, clamp(r, 1-ε_low, 1+ε_high) · A)

    or with `cispo` (MiniMax-M1's, TRL's `cispo`) the importance weight clipped instead, so every token
    keeps its gradient: loss = -sg(min(r, ε_high)) · A · logp, the clipped tokens those capped with A > 0.
    With `sapo` = (τ+, τ-) (SAPO, TRL's `sapo`) a soft gate replaces the clip: loss = -σ(τ(r - 1)) · 4/τ · A,
    τ = τ+ where A > 0 and τ- elsewhere; nothing counts as clipped. With `vespo` = φ, a sequence's weight
    from `vespo_weights` (VESPO, TRL's `vespo`): loss = -φ · A · logp, φ carrying no gradient; nothing clipped.

    `epsilon_high` defaults to `epsilon_low` (DAPO's clip-higher sets it apart); `delta` is
    INTELLECT-2's two-sided cap on the unclipped ratio. The clip indicators are TRL's
    `clip_ratio/low_mean`, `high_mean` and `region_mean` before averaging over the mask; like TRL
    they test the ratio after the `delta` cap. `advantages` is [B] (one per sequence) or [B, T].

    `level` is TRL's `importance_sampling_level`: "token", or "sequence" (GSPO, Zheng et al. 2025), where a
    completion's ratio is exp of its mean token log-ratio over the mask (its length-normalised likelihood
    ratio), one [B, 1] number that every token of the completion shares. Then `ratio` and the clip flags are
    [B, 1] (TRL counts them per sequence), and `loss` is that one value at each token of the mask, so that
    each aggregation treats it as TRL's does a [B, 1] loss; cispo's and vespo's losses stay per token.
    """
    if logp.dim() != 2:
        raise ValueError(f"logp: expected [B, T], got shape {tuple(logp.shape)}")
    if old_logp.shape != logp.shape:
        raise ValueError(f"old_logp: shape {tuple(old_logp.shape)} differs from logp's {tuple(logp.shape)}")
    keep = _bool_mask(mask, logp)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if advantages.shape not in ((logp.shape[0], 1), logp.shape):
        raise ValueError(f"advantages: expected [B] or [B, T] for logp {tuple(logp.shape)}, got {tuple(advantages.shape)}")
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    if epsilon_low < 0 or eps_high < 0:
        raise ValueError(f"epsilon_low/epsilon_high: must be >= 0, got {epsilon_low}, {eps_high}")
    log_ratio = logp - old_logp
    if level == "sequence":  # GSPO: one ratio per completion; TRL's clamp keeps an empty completion's at 1
        log_ratio = log_ratio.masked_fill(~keep, 0.0).sum(-1, keepdim=True)
        log_ratio = log_ratio / keep.sum(-1, keepdim=True).clamp(min=1).to(logp.dtype)
        counted = torch.ones_like(log_ratio, dtype=torch.bool)  # the flags count per sequence, every row
    elif level == "token":
        counted = keep
    else:
        raise ValueError(f"level: unknown importance sampling level {level!r}; expected 'token' or 'sequence'")
    ratio = torch.exp(log_ratio)
    none = torch.zeros_like(counted)
    if vespo is not None:
        return SurrogateOutput(_per_token(-vespo.detach() * advantages * logp, keep), ratio, none, none, none)
    if sapo is not None:
        tau = torch.where(advantages > 0, sapo[0], sapo[1])
        loss = -torch.sigmoid(tau * (ratio - 1.0)) * 4.0 / tau * advantages
        return SurrogateOutput(_per_token(loss, keep), ratio, none, none, none)
    if cispo:
        capped = ((ratio > eps_high) & (advantages > 0) & counted).detach()
        loss = -torch.clamp(ratio, max=eps_high).detach() * advantages * logp
        return SurrogateOutput(_per_token(loss, keep), ratio, none, capped, capped)
    loss, low, high = _ppo_clip(ratio, advantages, epsilon_low, eps_high, delta, counted)
    return SurrogateOutput(_per_token(loss, keep), ratio, low, high, low | high)


def _ppo_clip(ratio: Tensor, advantages: Tensor, epsilon_low: float, epsilon_high: float, delta: float | None,
              counted: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """PPO-clip's -min(min(r, delta)·A, clamp(r, 1-ε_low, 1+ε_high)·A) and its low / high clip flags (where
    `counted`), as TRL's GRPO and RLOO trainers test them: on the ratio after the `delta` cap."""
    clipped = torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    loss = -torch.min(unclipped * advantages, clipped * advantages)
    low = (unclipped < 1.0 - epsilon_low) & (advantages < 0) & counted
    high = (unclipped > 1.0 + epsilon_high) & (advantages > 0) & counted
    return loss, low.detach(), high.detach()


def rloo_surrogate(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, epsilon_low: float = 0.2,
                   epsilon_high: float | None = None) -> SurrogateOutput:
    """TRL 1.16's RLOOTrainer loss per completion: one ratio a completion, exp of its summed token log-ratio
    (the whole completion's likelihood ratio; GSPO's `level="sequence"` takes the mean instead), clipped as
    PPO clips it against the completion's advantage [B]. Returns `loss`, `ratio` and the flags as [B]: the
    caller averages them over completions (an empty completion keeps ratio 1 and its -A, as TRL's does)."""
    if old_logp.shape != logp.shape or logp.dim() != 2:
        raise ValueError(f"logp, old_logp: expected two [B, T], got {tuple(logp.shape)} and {tuple(old_logp.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages: expected [B] for logp {tuple(logp.shape)}, got {tuple(advantages.shape)}")
    keep = _bool_mask(mask, logp)
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    log_ratio = (logp - old_logp).masked_fill(~keep, 0.0).sum(-1)
    ratio = torch.exp(log_ratio)
    loss, low, high = _ppo_clip(ratio, advantages, epsilon_low, eps_high, None, torch.ones_like(keep[:, 0]))
    return SurrogateOutput(loss, ratio, low, high, low | high)


def _per_token(loss: Tensor, keep: Tensor) -> Tensor:
    """A [B, T] or [B, 1] loss as [B, T], 0 outside the mask: a sequence's one value at each of its tokens."""
    return loss.expand(keep.shape).masked_fill(~keep, 0.0)


def vespo_weights(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, is_weight: Tensor | None,
                  k: tuple[float, float] = (2.0, 3.0), lam: tuple[float, float] = (3.0, 2.0)) -> Tensor:
    """VESPO's per-sequence weight φ(w) = e^λ · w^k · e^(-λw) (1 at w = 1), [B, 1], no gradient, as TRL's
    `GRPOTrainer.get_gamma_weights`: w is the sequence's importance ratio Π π/π_old, times the rollout's
    importance weights `is_weight` (π_old/π_engine, as `tis_mode` bounds them) when given, in log space with TRL's clamps
    (each token's log-ratio to ±20, log w to [log 1e-8, 20]). A smooth weight in place of a clip: a sequence
    far off-policy either way fades out. k = (k+, k-) and λ = (λ+, λ-) by the sign of the advantage (A >= 0:
    the first)."""
    keep = _bool_mask(mask, logp)
    with torch.no_grad():
        log_w = (logp - old_logp).clamp(-20.0, 20.0).masked_fill(~keep, 0.0).sum(-1, keepdim=True)
        if is_weight is not None:
            log_is = is_weight.log().clamp(math.log(1e-8), 20.0).masked_fill(~keep, 0.0)
            log_w = log_w + log_is.sum(-1, keepdim=True)
        log_w = log_w.clamp(math.log(1e-8), 20.0)
        adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
        nonneg = adv >= 0
        k_seq = torch.where(nonneg, k[0], k[1])
        lam_seq = torch.where(nonneg, lam[0], lam[1]).clamp(min=1e-4)
        phi = torch.exp(lam_seq + k_seq * log_w - lam_seq * torch.exp(log_w))
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def kl_estimate(logp: Tensor, ref_logp: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimate of KL(π || π_ref) from tokens sampled from π (Schulman, "Approximating KL
    divergence", 2020), with log r = ref_logp - logp:

    - k1 = -log r: unbiased, high variance, can be negative.
    - k2 = (log r)² / 2: biased, low variance, always >= 0.
    - k3 = (r - 1) - log r = exp(ref - logp) - (ref - logp) - 1: unbiased, >= 0; TRL's GRPO KL.
    """
    if ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp: shape {tuple(ref_logp.shape)} differs from logp's {tuple(logp.shape)}")
    log_ratio = ref_logp - logp
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"kind: unknown KL estimator {kind!r}; expected 'k1', 'k2' or 'k3'")


def generalized_jsd(student_logits: Tensor, teacher_logits: Tensor, beta: float, temperature: float = 1.0) -> Tensor:
    """Per-row divergence [N] of the student's next-token distribution from the teacher's over the whole
    vocabulary (logits [N, V], both softened by `temperature`), as TRL 1.16's DistillationTrainer defines it:
    beta 0 the forward KL(p_t || p_s), beta 1 the reverse KL(p_s || p_t), between them the generalized JSD
    beta·KL(p_t || m) + (1 − beta)·KL(p_s || m) with m = (1 − beta)·p_s + beta·p_t. The gradient reaches the
    student only (the teacher's logits are detached)."""
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"teacher_logits: shape {tuple(teacher_logits.shape)} differs from the student's "
                         f"{tuple(student_logits.shape)}; teacher and student must share a vocabulary")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta: must lie in [0, 1], got {beta}")
    log_ps = F.log_softmax(student_logits / temperature, dim=-1)
    log_pt = F.log_softmax(teacher_logits.detach() / temperature, dim=-1)
    if beta == 0.0:
        return (log_pt.exp() * (log_pt - log_ps)).sum(-1)
    if beta == 1.0:
        return (log_ps.exp() * (log_ps - log_pt)).sum(-1)
    log_m = torch.logaddexp(log_ps + math.log(1.0 - beta), log_pt + math.log(beta))
    to_teacher = (log_pt.exp() * (log_pt - log_m)).sum(-1)
    to_student = (log_ps.exp() * (log_ps - log_m)).sum(-1)
    return beta * to_teacher + (1.0 - beta) * to_student


# ---------------------------------------------------------------------------------------------
# Value function (PPO's critic)
# ---------------------------------------------------------------------------------------------


class ValueLossOutput(NamedTuple):
    loss: Tensor  # [B, T] per-token 0.5·max(unclipped, clipped), 0 outside the mask
    is_clipped: Tensor  # [B, T] bool: the clipped term is the larger (TRL's `val/clipfrac`)


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
                       cliprange_value: float) -> ValueLossOutput:
    """PPO's clipped value loss per token, as TRL's PPOTrainer computes it:

        V_clip = clamp(V, V_old − ε, V_old + ε);   loss = ½·max((V − R)², (V_clip − R)²)

    The clip keeps one update from moving the critic far from the values the advantages were
    computed with. The caller aggregates (a token mean over the mini-batch, like the policy loss)."""
    if not (values.shape == old_values.shape == returns.shape):
        raise ValueError(f"values, old_values, returns: shapes differ ({tuple(values.shape)}, "
                         f"{tuple(old_values.shape)}, {tuple(returns.shape)})")
    if cliprange_value < 0:
        raise ValueError(f"cliprange_value: must be >= 0, got {cliprange_value}")
    keep = _bool_mask(mask, values)
    clipped = torch.clamp(values, old_values - cliprange_value, old_values + cliprange_value)
    unclipped_loss = (values - returns) ** 2
    clipped_loss = (clipped - returns) ** 2
    loss = 0.5 * torch.maximum(unclipped_loss, clipped_loss)
    return ValueLossOutput(loss.masked_fill(~keep, 0.0), (clipped_loss > unclipped_loss) & keep)
