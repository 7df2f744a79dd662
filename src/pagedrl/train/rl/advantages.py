"""Advantages: from rewards to the per-sequence (GRPO) or per-token (PPO) signal the loss weighs.

GRPO needs no value model: the G completions of one prompt form a group and each completion's
advantage is its reward relative to its group; RLOO's is relative to the mean of its G - 1 siblings,
the leave-one-out baseline (its KL to the reference taken out of the reward first). PPO learns a value function and uses generalized
advantage estimation. Both are pure functions of tensors, like `losses`.

Rewards may be NaN: a reward function that returns None for a completion means "not applicable"
(a math verifier on a code prompt), and TRL keeps it as NaN so that nan-aware sums skip it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

SCALE_REWARDS: tuple[str, ...] = ("group", "batch", "none")
# Sums a float64 tensor element-wise over the ranks of a data-parallel run (the identity in one
# process): what makes a batch statistic that of the whole batch rather than of one rank's share.
SumAcross = Callable[[Tensor], Tensor]


def combine_rewards(rewards_per_func: Tensor, weights: Sequence[float] | Tensor | None = None) -> Tensor:
    """Weighted sum over reward functions, [N, F] -> [N], as TRL's GRPO does it (`nansum`):
    a function that returned NaN (None) for a completion is left out of that completion's sum.
    A completion every function skipped is unscorable and stays NaN, so the group baseline
    ignores it and its advantage becomes 0 (TRL 1.16's `unscorable_mask`)."""
    if rewards_per_func.dim() != 2:
        raise ValueError(f"rewards_per_func: expected [N, F], got shape {tuple(rewards_per_func.shape)}")
    num_funcs = rewards_per_func.shape[1]
    if weights is None:
        w = torch.ones(num_funcs, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
    else:
        w = torch.as_tensor(weights, dtype=rewards_per_func.dtype, device=rewards_per_func.device)
        if w.shape != (num_funcs,):
            raise ValueError(f"weights: expected {num_funcs} weights (one per reward function), got {tuple(w.shape)}")
    combined = (rewards_per_func * w).nansum(dim=1)
    return combined.masked_fill(torch.isnan(rewards_per_func).all(dim=1), float("nan"))


def _grouped(rewards: Tensor, num_generations: int | None) -> Tensor:
    if rewards.dim() == 2:
        if num_generations is not None and rewards.shape[1] != num_generations:
            raise ValueError(f"num_generations: {num_generations} does not match rewards' group size {rewards.shape[1]}")
        return rewards
    if rewards.dim() != 1:
        raise ValueError(f"rewards: expected [num_groups * G] or [num_groups, G], got shape {tuple(rewards.shape)}")
    if num_generations is None or num_generations < 1:
        raise ValueError(f"num_generations: flat rewards need a positive group size, got {num_generations!r}")
    if rewards.numel() % num_generations:
        raise ValueError(f"num_generations: {rewards.numel()} rewards do not split into groups of {num_generations}")
    return rewards.view(-1, num_generations)


def nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """Unbiased (Bessel-corrected) standard deviation ignoring NaN, TRL's `nanstd`: NaN when fewer
    than two values are present (RLOO's `frac_reward_zero_std` then does not count the group, as TRL's
    does not; GRPO's metric reads it as 0, see `GRPO.rollout_metrics`)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True).to(x.dtype)
    sq = torch.nansum((x - mean) ** 2, dim=dim, keepdim=True)
    var = torch.where(count > 1, sq / (count - 1), torch.full_like(sq, float("nan")))
    return var.sqrt().reshape(()) if dim is None else var.sqrt().squeeze(dim)


def zero_std_groups(rewards: Tensor, num_generations: int | None = None) -> Tensor:
    """[num_groups] bool: groups whose scored completions all got the same reward. They carry no
    GRPO signal; TRL logs their share as `frac_reward_zero_std`, DAPO's dynamic sampling drops them."""
    grouped = _grouped(rewards, num_generations)
    scored = ~torch.isnan(grouped)
    inf = torch.tensor(float("inf"), dtype=grouped.dtype, device=grouped.device)
    hi = torch.where(scored, grouped, -inf).amax(dim=1)
    lo = torch.where(scored, grouped, inf).amin(dim=1)
    return ~(hi > lo)


@torch.no_grad()
def group_advantages(
    rewards: Tensor,
    num_generations: int | None = None,
    scale_rewards: str = "group",
    eps: float = 1e-4,
) -> Tensor:
    """GRPO advantages with TRL 1.16's conventions (`multi_objective_aggregation="sum_then_normalize"`):

        A = (r - nanmean(group)) / (std + eps)

    with `std` the unbiased nan-aware std of the group (`"group"`, GRPO), of the whole batch
    (`"batch"`, PPO-Lite), or no division at all (`"none"`, Dr. GRPO, which finds the group std
    biases towards easy and hard questions). `rewards` is [num_groups * G] (groups contiguous, as
    the rollout emits them; `num_generations` = G) or [num_groups, G]; the result has its shape.

    NaN rewards (unscorable completions) are left out of means and stds and get advantage 0. A
    group whose scored rewards all agree gets exactly 0 — TRL's formula gives 0 up to the
    rounding of its mean, which `/ eps` can blow up to ~1e-4 in float32; here it is exact.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards: {scale_rewards!r} is not one of {', '.join(SCALE_REWARDS)}")
    if not eps > 0:
        raise ValueError(f"eps: must be positive, got {eps}")
    grouped = _grouped(rewards, num_generations)
    centred = grouped - torch.nanmean(grouped, dim=1, keepdim=True)
    if scale_rewards == "group":
        std = nanstd(grouped, dim=1).unsqueeze(1) if grouped.shape[1] > 1 else torch.zeros_like(grouped[:, :1])
        centred = centred / (std + eps)
    elif scale_rewards == "batch":
        std = nanstd(grouped) if grouped.numel() > 1 else torch.zeros((), dtype=grouped.dtype)
        centred = centred / (std + eps)
    centred = centred.masked_fill(zero_std_groups(grouped).unsqueeze(1), 0.0)
    return torch.nan_to_num(centred, nan=0.0).reshape(rewards.shape)


@torch.no_grad()
def rloo_advantages(rewards: Tensor, num_generations: int, kl: Tensor | None = None, beta: float = 0.0,
                    clip_range: Sequence[float] | None = None, normalize: bool = False) -> tuple[Tensor, Tensor]:
    """RLOO's advantages as TRL 1.16's RLOOTrainer computes them from the whole batch's rewards ([P·G], groups
    contiguous): each reward clamped to `clip_range` (min, max), less `beta` times the completion's KL to the
    reference (`kl` [P·G], the per-token log-ratio summed over the completion), then less the mean of its
    siblings' (the leave-one-out baseline, an unbiased one: a completion's own reward is not in it), and with
    `normalize` (A - mean) / (std + 1e-4) over the batch.

    NaN rewards (unscorable completions) are left out of the siblings' means, the mean and the std, and get
    advantage 0, as does a completion with no scored sibling. Returns (advantages, the penalised rewards)."""
    if num_generations < 2:
        raise ValueError(f"num_generations: the leave-one-out baseline needs >= 2 completions, got {num_generations}")
    penalised = rewards.clone()
    if clip_range is not None:
        penalised = penalised.clamp(min=clip_range[0], max=clip_range[1])
    if kl is not None and beta != 0.0:
        if kl.shape != rewards.shape:
            raise ValueError(f"kl: shape {tuple(kl.shape)} differs from rewards' {tuple(rewards.shape)}")
        penalised = penalised - beta * kl.to(rewards.dtype)
    grouped = _grouped(penalised, num_generations)
    scored = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    baseline = (torch.nansum(grouped, dim=1, keepdim=True) - grouped) / (scored - 1)
    advantages = (grouped - baseline).reshape(rewards.shape)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0), penalised


@torch.no_grad()
def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016) over [B, T] completion tokens:

        δ_t = r_t + γ·V_{t+1} - V_t;   A_t = δ_t + γλ·A_{t+1};   returns = A + V

    as TRL's PPOTrainer runs it, with positions outside `mask` treated as past the end of the
    episode (value 0, reward 0, no bootstrap through them). Both outputs are 0 outside the mask.
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards: expected [B, T], got shape {tuple(rewards.shape)}")
    if values.shape != rewards.shape:
        raise ValueError(f"values: shape {tuple(values.shape)} differs from rewards' {tuple(rewards.shape)}")
    if mask.shape != rewards.shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} differs from rewards' {tuple(rewards.shape)}")
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"gamma/lam: must lie in [0, 1], got gamma={gamma}, lam={lam}")
    keep = (mask != 0).to(rewards.dtype)
    rewards = torch.nan_to_num(rewards) * keep
    values = torch.nan_to_num(values) * keep
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * keep[:, t]
        next_value, next_advantage = values[:, t], advantages[:, t]
    return advantages, (advantages + values) * keep


@torch.no_grad()
def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, sum_across: SumAcross | None = None) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the masked entries, with the unbiased variance, as TRL's
    `masked_whiten` normalises PPO advantages. `shift_mean=False` keeps the original mean.
    `sum_across` makes mean and variance those of every rank's entries (sums in float64)."""
    keep = mask if mask.dtype == torch.bool else mask != 0
    total = sum_across or (lambda t: t)
    selected = x[keep].to(torch.float64)
    count, mean_sum = total(torch.stack([keep.sum().to(torch.float64), selected.sum()])).tolist()
    if count < 2:
        raise ValueError(f"mask: whitening needs at least 2 masked values, got {count:.0f}")
    mean = mean_sum / count
    var = float(total(((selected - mean) ** 2).sum().reshape(1))[0]) / (count - 1)
    whitened = (x - mean) * torch.rsqrt(torch.tensor(var + 1e-8, dtype=torch.float64)).to(x.dtype)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


@torch.no_grad()
def ppo_token_rewards(scores: Tensor, kl: Tensor, mask: Tensor, kl_coef: float) -> tuple[Tensor, Tensor]:
    """RLHF's per-token reward: −kl_coef·KL(π‖π_ref) at every completion token, plus the sequence's
    score at its last real token (its EOS when it has one). The last token is found from the mask
    (the completion's length), never from a pad id: SmolLM2's pad id is its EOS id, and reading the
    first pad would put the score one token early, or one late.

    scores [B], kl [B, T], mask [B, T] (each row a prefix of ones) → (rewards, non_score_rewards),
    both [B, T] and 0 outside the mask."""
    if kl.shape != mask.shape or scores.shape != kl.shape[:1]:
        raise ValueError(f"scores [B], kl and mask [B, T]: got {tuple(scores.shape)}, {tuple(kl.shape)}, "
                         f"{tuple(mask.shape)}")
    keep = (mask != 0).to(kl.dtype)
    lengths = (mask != 0).sum(1)
    if bool((lengths == 0).any()):
        raise ValueError("mask: every completion needs at least one token to carry its score")
    non_score = -kl_coef * kl * keep
    rewards = non_score.clone()
    rows = torch.arange(kl.shape[0], device=kl.device)
    rewards[rows, lengths - 1] += scores.to(kl.dtype)
    return rewards, non_score


@torch.no_grad()
def explained_variance(predicted: Tensor, target: Tensor, mask: Tensor, sum_across: SumAcross | None = None) -> float:
    """1 − Var(target − predicted) / Var(target) over the masked entries: how much of the returns'
    spread the critic accounts for (1 perfect, 0 no better than a constant, negative worse).
    `sum_across`: over every rank's entries (from float64 sums of z and z²)."""
    keep = mask != 0
    y, p = target[keep].double(), predicted[keep].double()
    r = y - p
    sums = torch.stack([torch.tensor(float(y.numel()), dtype=torch.float64), y.sum(), (y * y).sum(), r.sum(),
                        (r * r).sum()])
    n, sy, syy, sr, srr = (sum_across(sums) if sum_across is not None else sums).tolist()
    if n == 0:
        return float("nan")
    var_y, var_r = syy / n - (sy / n) ** 2, srr / n - (sr / n) ** 2
    return 1.0 - var_r / var_y if var_y > 0 else float("nan")


class PPOTargets(NamedTuple):
    scores: Tensor  # [B] after the missing-EOS penalty and the clamp
    kl: Tensor  # [B, T] per-token KL estimate, 0 outside the mask
    non_score_rewards: Tensor  # [B, T]
    rewards: Tensor  # [B, T] (whitened if asked)
    advantages: Tensor  # [B, T] whitened over the batch
    returns: Tensor  # [B, T] advantages (before whitening) + values


@torch.no_grad()
def ppo_targets(scores: Tensor, has_eos: Tensor, logps: Tensor, ref_logps: Tensor | None, values: Tensor,
                mask: Tensor, kl_coef: float, kl_estimator: str = "k1", missing_eos_penalty: float | None = None,
                reward_clip_range: float | None = None, whiten_rewards: bool = False, gamma: float = 1.0,
                lam: float = 0.95, log_ratio_clamp: float = 20.0, sum_across: SumAcross | None = None) -> PPOTargets:
    """Everything PPO trains a rollout towards, from the rollout's scores, log-probs and values:

    1. a completion without EOS loses `missing_eos_penalty`; scores are clamped to ±`reward_clip_range`;
    2. per-token KL(π‖π_ref) (k1 or k3, log-ratio clamped), reward −kl_coef·KL per token plus the
       score at the last token (`ppo_token_rewards`); optionally whitened without shifting the mean;
    3. GAE(γ, λ) against the values; returns = advantages + values; advantages whitened over the batch.

    `sum_across` makes "the batch" every rank's completions (see `masked_whiten`).
    """
    from pagedrl.train.losses import kl_estimate

    keep = mask != 0
    scores = scores.clone()
    if missing_eos_penalty is not None:
        scores[~has_eos] -= missing_eos_penalty
    if reward_clip_range is not None:
        scores = scores.clamp(-reward_clip_range, reward_clip_range)
    if ref_logps is None:
        kl = torch.zeros_like(logps)
    else:
        clamped_ref = logps + (ref_logps - logps).clamp(-log_ratio_clamp, log_ratio_clamp)
        kl = kl_estimate(logps, clamped_ref, kl_estimator).masked_fill(~keep, 0.0)
    rewards, non_score = ppo_token_rewards(scores, kl, mask, kl_coef)
    if whiten_rewards:
        rewards = masked_whiten(rewards, keep, shift_mean=False, sum_across=sum_across).masked_fill(~keep, 0.0)
    advantages, returns = gae(rewards, values.masked_fill(~keep, 0.0), mask, gamma, lam)
    advantages = masked_whiten(advantages, keep, sum_across=sum_across).masked_fill(~keep, 0.0)
    return PPOTargets(scores, kl, non_score, rewards, advantages, returns)
