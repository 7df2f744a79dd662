"""KTO's losses as pure functions of sequence log-probs, as TRL 1.16's KTOTrainer computes them.

KTO (Ethayarajh et al. 2024) learns from unpaired feedback: each completion is labelled desirable or
undesirable on its own, and its log-ratio against a frozen reference is compared with a reference point,
an estimate of KL(π‖π_ref) over the micro-batch (`kl_estimate`), rather than with a paired answer. So the
trainer hands the loss one micro-batch of completions with their labels and the micro-batch's KL estimate;
the per-completion losses are then summed over the step. The KL estimate, like TRL's, sees one micro-batch
(averaged over the ranks), so with gradient accumulation it depends on how the step is cut.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple, get_args

import torch
from torch import Tensor

from pagedrl.train.metrics import Metric

KTOLossType = Literal["kto", "apo_zero_unpaired"]
KTO_LOSS_TYPES: tuple[str, ...] = get_args(KTOLossType)


class KTOOutput(NamedTuple):
    losses: Tensor  # [B] weighted per completion, unreduced: the trainer sums them / completions of the step
    rewards: Tensor  # [B] β·(policy - reference) log-prob of each completion, detached


def uses_kl(loss_type: str) -> bool:
    """Whether the loss reads the KL reference point (all but apo_zero_unpaired, as TRL's `calculate_KL`)."""
    return loss_type != "apo_zero_unpaired"


def kl_estimate(policy_kl_logps: Tensor, ref_kl_logps: Tensor,
                over_ranks: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """KTO's reference point z₀: the mean over the micro-batch's mismatched (prompt, completion) pairs of
    policy - reference log-prob, without gradient, clamped at 0 as a KL divergence is. `over_ranks` maps
    this rank's mean to the mean of every rank's, as TRL gathers them before the clamp."""
    mean = (policy_kl_logps.detach() - ref_kl_logps.detach()).mean()
    if over_ranks is not None:
        mean = over_ranks(mean)
    return mean.clamp(min=0)


def kto_loss(policy_logps: Tensor, ref_logps: Tensor, desirable: Tensor, kl: Tensor | float, beta: float = 0.1,
             loss_type: str = "kto", desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> KTOOutput:
    """Per-completion losses from summed completion log-probs, with r = policy - reference log-prob and
    z₀ = `kl` (`kl_estimate`; unused by apo_zero_unpaired):

    - `kto` (Eq. 7 of the KTO paper): desirable 1 - σ(β(r - z₀)), undesirable 1 - σ(β(z₀ - r));
    - `apo_zero_unpaired` (APO-zero, D'Oosterlinck et al. 2024, unpaired): desirable 1 - σ(βr),
      undesirable σ(βr);

    each times `desirable_weight` or `undesirable_weight`. TRL's step loss is the mean of these over the
    micro-batch (the weights multiply, they do not renormalise). `desirable` [B] is the rows' bool labels."""
    if not beta > 0:
        raise ValueError(f"beta: must be positive, got {beta}")
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"loss_type: unknown KTO loss {loss_type!r}; expected one of {', '.join(KTO_LOSS_TYPES)}")
    if ref_logps.shape != policy_logps.shape or desirable.shape != policy_logps.shape:
        raise ValueError(f"ref_logps, desirable: shapes {tuple(ref_logps.shape)}, {tuple(desirable.shape)} differ "
                         f"from policy_logps' {tuple(policy_logps.shape)}")
    logratios = policy_logps - ref_logps
    if uses_kl(loss_type):
        good, bad = 1 - torch.sigmoid(beta * (logratios - kl)), 1 - torch.sigmoid(beta * (kl - logratios))
    else:
        good, bad = 1 - torch.sigmoid(beta * logratios), torch.sigmoid(beta * logratios)
    desirable = desirable.to(torch.bool)
    losses = torch.where(desirable, desirable_weight * good, undesirable_weight * bad)
    return KTOOutput(losses, beta * logratios.detach())


Sums = dict[str, tuple[Tensor, Tensor]]  # metric name -> (total, count) of one micro-batch


def kto_metrics(out: KTOOutput, policy_logps: Tensor, desirable: Tensor, kl: Tensor | float, more: Sums | None = None,
                pool: Callable[[Tensor], Tensor] | None = None) -> dict[str, Metric]:
    """One micro-batch's metrics under TRL's names: `kl` (z₀), `rewards/chosen` and `logps/chosen` (mean
    over the desirable completions), `rewards/rejected` and `logps/rejected` (the undesirable ones), `more`'s
    totals over their counts (the trainer's logits and entropy per token), and `rewards/margins` (the two
    reward means' difference). As TRL, each is this micro-batch's mean, counting 1 when a logged window's
    micro-batches are averaged (TRL's `log()` averages the means it appended, however many rows each had);
    totals and counts pooled first by `pool` (their sums over the ranks, as TRL gathers them) where given;
    and a metric without a row or token of its side logs nothing (not a 0), the margin only with both."""
    desirable = desirable.to(torch.bool)
    logps = policy_logps.detach()
    sums: Sums = {}
    for side, mask in (("chosen", desirable), ("rejected", ~desirable)):
        count = mask.sum()
        sums[f"rewards/{side}"] = (out.rewards[mask].sum(), count)
        sums[f"logps/{side}"] = (logps[mask].sum(), count)
    sums.update(more or {})
    totals = torch.stack([torch.stack([torch.as_tensor(v, dtype=torch.float64, device=logps.device).detach()
                                       for v in pair]) for pair in sums.values()])  # [metrics, 2]
    if pool is not None:
        totals = pool(totals)
    metrics = {"kl": Metric.mean(torch.as_tensor(kl, dtype=logps.dtype).detach().reshape(()))}
    for name, (total, count) in zip(sums, totals.tolist(), strict=True):
        if count > 0:
            metrics[name] = Metric.mean(total / count)
    if "rewards/chosen" in metrics and "rewards/rejected" in metrics:
        metrics["rewards/margins"] = Metric.mean(metrics["rewards/chosen"].total - metrics["rewards/rejected"].total)
    return metrics


def weight_advice(desirable: int, undesirable: int, desirable_weight: float, undesirable_weight: float) -> str | None:
    """TRL 1.16's start-up warning, where the two sides' row counts differ and neither weight is in the range
    Eq. (8) of the KTO paper suggests (desirable_weight·n_D / (undesirable_weight·n_U) in [1, 4/3]); None
    otherwise."""
    n_d, n_u = max(desirable, 1), max(undesirable, 1)
    if n_d == n_u:
        return None
    d_low, d_high = round(n_u * undesirable_weight / n_d, 2), round(n_u * undesirable_weight / n_d * 1.33, 2)
    u_low, u_high = round(n_d * desirable_weight / n_u / 1.33, 2), round(n_d * desirable_weight / n_u, 2)
    if d_low <= desirable_weight <= d_high or u_low <= undesirable_weight <= u_high:
        return None
    return (f"{desirable} desirable and {undesirable} undesirable rows, and neither weight in the range the KTO "
            f"paper suggests: set EITHER desirable_weight in [{d_low}, {d_high}] or undesirable_weight in "
            f"[{u_low}, {u_high}] (but not both); trained as given (TRL 1.16 warns the same)")
