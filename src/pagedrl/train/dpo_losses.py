"""DPO's losses as pure functions of sequence log-probs: every `loss_type` of TRL 1.16's DPOTrainer, alone or
as TRL's weighted list of several (MPO's `[sigmoid, bco_pair, sft]`), and the checks of the settings each uses.

A DPO loss sees four numbers per pair, the policy's and the reference's summed log-probs of the chosen and the
rejected answer (and for some losses the answers' token counts), so the trainer hands the loss a micro-batch of
pairs and sums the per-pair losses over the step. Two of TRL's terms are not per pair: `sft` is the mean NLL
over the micro-batch's chosen tokens and `aot`/`aot_unpaired` sort the micro-batch's log-ratios; as in TRL,
they see one micro-batch, so with gradient accumulation they depend on how the step is cut into micro-batches.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal, NamedTuple, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust", "exo_pair", "nca_pair", "bco_pair", "sppo_hard", "aot",
                      "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]
DPO_LOSS_TYPES: tuple[str, ...] = get_args(DPOLossType)
DISCOPOP_TAU = 0.05  # TRL's default, the DiscoPOP paper's
FDivergence = Literal["reverse_kl", "forward_kl", "js_divergence", "alpha_divergence"]
F_DIVERGENCES: tuple[str, ...] = get_args(FDivergence)
F_ALPHA_COEF = 0.5  # TRL's default α of alpha_divergence
# f-DPO's reparameterisation leaves a β·log Z(x) term that cancels only in the chosen-rejected score difference:
# the losses built on it take another f-divergence, the others (TRL refuses them too) only reverse_kl's.
F_DIVERGENCE_LOSSES = ("sigmoid", "sigmoid_norm", "hinge", "ipo", "exo_pair", "robust", "discopop", "sft")
# The losses that read `label_smoothing`, and the values each takes: (low, high, low included, high included).
# sigmoid's is conservative DPO's ε (TRL 1.16's sigmoid ignores it); aot's any ε, as TRL's (above 0.5 it
# favours the rejected answers' margins). exo_pair takes log ε and log(1 - ε): TRL
# refuses 0 and its loss is NaN or infinite outside (0, 1). robust takes any ε but 0.5 (TRL warns outside
# [0, 0.5): `trl_warnings`), where its 1/(1 - 2ε) is infinite (`ROBUST_POLE`).
SMOOTHING_RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "sigmoid": (0.0, 0.5, True, True), "robust": (-math.inf, math.inf, False, False),
    "aot": (-math.inf, math.inf, False, False), "aot_unpaired": (-math.inf, math.inf, False, False),
    "exo_pair": (0.0, 1.0, False, False),
}
SMOOTHING_WHY = {"exo_pair": " (EXO takes log ε and log(1 - ε): TRL 1.16 refuses 0, and its loss is NaN or "
                             "infinite at 1 and beyond or below 0)"}
ROBUST_POLE = 0.5  # robust divides by 1 - 2ε


# The losses TRL 1.16's WPO weighting fails on: it refuses aot's; sft's (an expanded scalar) and hinge's (relu's
# output, saved for its backward) it multiplies in place, an error in the forward and in the backward.
UNWEIGHABLE = ("aot", "aot_unpaired", "sft", "hinge")


class DPOOutput(NamedTuple):
    losses: Tensor  # [num_pairs], unreduced: the trainer averages (or sums / global pairs)
    chosen_rewards: Tensor  # beta * (policy - reference) log-prob of the chosen answer, detached
    rejected_rewards: Tensor


def loss_types_of(loss_type: str | Sequence[str]) -> tuple[str, ...]:
    """TRL's `loss_type`, one name or a list of them, as a tuple."""
    return (loss_type,) if isinstance(loss_type, str) else tuple(loss_type)


def dpo_settings_problem(loss_type: str | Sequence[str], loss_weights: Sequence[float] | None,
                         label_smoothing: float, discopop_tau: float, f_divergence_type: str = "reverse_kl",
                         f_alpha_divergence_coef: float = F_ALPHA_COEF,
                         use_weighting: bool = False) -> tuple[str, str] | None:
    """The first unusable DPO setting as (key, why), or None; shared by DPOConfig and `dpo_loss`.

    A setting no chosen loss reads is refused rather than ignored (a `discopop_tau` beside a sigmoid loss
    trains as if it were not there)."""
    types = loss_types_of(loss_type)
    unknown = [t for t in types if t not in DPO_LOSS_TYPES]
    if not types or unknown:
        return "loss_type", (f"unknown DPO loss {unknown[0]!r}" if unknown else "empty") + \
            f"; expected one or a list of {', '.join(DPO_LOSS_TYPES)}"
    if loss_weights is not None and len(loss_weights) != len(types):
        return "loss_weights", f"{len(loss_weights)} weights for {len(types)} loss types; give one per loss_type"
    if loss_weights is not None and not all(math.isfinite(w) for w in loss_weights):  # negative ones as TRL
        return "loss_weights", f"must be finite numbers (the loss would be NaN or infinite), got {list(loss_weights)}"
    ls = label_smoothing
    if not math.isfinite(ls):
        return "label_smoothing", f"must be finite, got {ls}"
    readers = [t for t in dict.fromkeys(types) if t in SMOOTHING_RANGES]
    for t in readers:
        low, high, low_in, high_in = SMOOTHING_RANGES[t]
        if not ((low <= ls if low_in else low < ls) and (ls <= high if high_in else ls < high)):
            span = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
            return "label_smoothing", f"the {t} loss needs label_smoothing in {span}, got {ls}{SMOOTHING_WHY.get(t, '')}"
    if "robust" in readers and ls == ROBUST_POLE:
        return "label_smoothing", f"the robust loss divides by 1 - 2·label_smoothing, so {ls} makes it infinite " \
            "or NaN (TRL 1.16's too); its flip probability should lie in [0, 0.5)"
    if ls != 0.0 and not readers:
        return "label_smoothing", f"the {'+'.join(types)} loss does not use it; got {ls}, expected 0"
    if ls != 0.0 and "sigmoid" in readers and len(readers) > 1:  # TRL would smooth only the other's
        other = next(t for t in readers if t != "sigmoid")
        return "label_smoothing", f"sigmoid would take it as conservative DPO's ε (TRL 1.16's sigmoid ignores it) " \
            f"beside {other}'s; got {ls}: set it to 0 or leave sigmoid out of the list"
    if not discopop_tau > 0:
        return "discopop_tau", f"must be > 0, got {discopop_tau}"
    if discopop_tau != DISCOPOP_TAU and "discopop" not in types:
        return "discopop_tau", f"only the discopop loss uses it; got {discopop_tau}, expected {DISCOPOP_TAU} or " \
            "loss_type discopop"
    unweighable = [t for t in dict.fromkeys(types) if t in UNWEIGHABLE]
    if use_weighting and unweighable:
        return "use_weighting", f"WPO's per-pair weights do not apply to {', '.join(unweighable)}: TRL 1.16's " \
            "DPOTrainer cannot weigh it (aot sorts the pairs, sft is one number over the micro-batch, and its " \
            "in-place product breaks hinge's gradient); leave it out of loss_type"
    return _f_divergence_problem(types, f_divergence_type, f_alpha_divergence_coef)


def trl_differences(loss_type: str | Sequence[str], label_smoothing: float) -> list[str]:
    """Start-up lines for the settings TRL 1.16 takes whose loss differs here: sigmoid with `label_smoothing`
    is conservative DPO, where TRL's sigmoid ignores the key, so a TRL recipe that sets both would train
    plain sigmoid there; the user learns it before the first step rather than from a loss curve."""
    if "sigmoid" in loss_types_of(loss_type) and label_smoothing:
        return [f"sigmoid with label_smoothing {label_smoothing:g} trains conservative DPO (cDPO); TRL 1.16's "
                "sigmoid ignores label_smoothing, so a TRL run of this config trains plain sigmoid (set it to 0 "
                "for TRL's loss)"]
    return []


def trl_warnings(loss_type: str | Sequence[str], label_smoothing: float) -> list[str]:
    """Start-up lines for the settings TRL 1.16 takes with a warning, and trains as pagedrl does: robust's
    `label_smoothing` outside [0, 0.5), where it is no longer a flip probability (above 0.5 the loss's sign
    turns: it favours the rejected answer), said before the first step rather than found in a loss curve."""
    if "robust" in loss_types_of(loss_type) and not 0.0 <= label_smoothing < 0.5:
        return [f"label_smoothing should lie in [0, 0.5) for the robust loss, its flip probability; got "
                f"{label_smoothing:g}, trained as given (TRL 1.16 warns the same)"]
    return []


def _f_divergence_problem(types: Sequence[str], f_divergence: str, alpha: float) -> tuple[str, str] | None:
    if f_divergence not in F_DIVERGENCES:
        return "f_divergence_type", f"unknown {f_divergence!r}; expected one of {', '.join(F_DIVERGENCES)}"
    others = [t for t in dict.fromkeys(types) if t not in F_DIVERGENCE_LOSSES]
    if f_divergence != "reverse_kl" and others:
        return "f_divergence_type", f"{f_divergence} needs losses built on the chosen-rejected score difference " \
            f"({', '.join(F_DIVERGENCE_LOSSES)}); {', '.join(others)} takes only reverse_kl"
    if not math.isfinite(alpha):
        return "f_alpha_divergence_coef", f"must be a finite number, got {alpha}"
    if alpha != F_ALPHA_COEF and f_divergence != "alpha_divergence":
        return "f_alpha_divergence_coef", f"only f_divergence_type alpha_divergence uses it; got {alpha}, " \
            f"expected {F_ALPHA_COEF}"
    return None


def check_dpo_settings(loss_type: str | Sequence[str], loss_weights: Sequence[float] | None = None,
                       label_smoothing: float = 0.0, discopop_tau: float = DISCOPOP_TAU,
                       f_divergence_type: str = "reverse_kl", f_alpha_divergence_coef: float = F_ALPHA_COEF,
                       use_weighting: bool = False) -> None:
    """`dpo_settings_problem` as a ValueError naming the key."""
    problem = dpo_settings_problem(loss_type, loss_weights, label_smoothing, discopop_tau, f_divergence_type,
                                   f_alpha_divergence_coef, use_weighting)
    if problem is not None:
        raise ValueError(f"{problem[0]}: {problem[1]}")


def _per_token_mean(logratios: Tensor, lengths: Tensor | None, loss_type: str) -> Tensor:
    if lengths is None:
        raise ValueError(f"chosen_lengths: the {loss_type} loss needs chosen_lengths and rejected_lengths "
                         "(token counts)")
    return logratios / lengths.to(logratios.dtype).clamp(min=1.0)


def _smoothed_sigmoid(z: Tensor, eps: float) -> Tensor:
    """-(1-ε)·logσ(z) - ε·logσ(-z): cDPO's form (ε = 0 leaves DPO's sigmoid)."""
    losses = -(1.0 - eps) * F.logsigmoid(z)
    return losses - eps * F.logsigmoid(-z) if eps else losses


def f_scores(logratios: Tensor, f_divergence: str, alpha: float = F_ALPHA_COEF) -> Tensor:
    """f'(π/π_ref) of each answer's log-ratio log(π/π_ref), the score f-DPO (Wang et al. 2023) puts where DPO
    has the log-ratio, as TRL 1.16 computes it: reverse_kl log t, forward_kl 1 - 1/t, js_divergence
    log 2 + logσ(log t) = log(2t/(t+1)), alpha_divergence (t^(α-1) - 1)/(α-1) (log t within 1e-6 of α = 1,
    its limit), its exponent clamped at 80 (11 in float16) so that exp stays finite, computed in at least
    float32."""
    if f_divergence == "forward_kl":
        return 1 - torch.exp(-logratios)
    if f_divergence == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    if f_divergence != "alpha_divergence" or abs(alpha - 1.0) < 1e-6:
        return logratios
    t = (alpha - 1.0) * logratios
    wide = t.float() if t.dtype in (torch.float16, torch.bfloat16) else t
    clamp = 11.0 if t.dtype == torch.float16 else 80.0
    return (torch.exp(wide.clamp(max=clamp)) - 1.0).to(t.dtype) * (1.0 / (alpha - 1.0))


def pair_losses(loss_type: str, policy_chosen: Tensor, policy_rejected: Tensor, ref_chosen: Tensor,
                ref_rejected: Tensor, beta: float, eps: float, discopop_tau: float,
                chosen_lengths: Tensor | None, rejected_lengths: Tensor | None, f_divergence: str = "reverse_kl",
                f_alpha: float = F_ALPHA_COEF, sft_chosen: Tensor | None = None,
                sft_tokens: Tensor | None = None) -> Tensor:
    """One loss type's [num_pairs] losses, as TRL 1.16's `DPOTrainer._compute_loss` computes its
    `per_sequence_loss`; see `dpo_loss` for the formulas."""
    chosen_lr, rejected_lr = policy_chosen - ref_chosen, policy_rejected - ref_rejected
    chosen_s, rejected_s = f_scores(chosen_lr, f_divergence, f_alpha), f_scores(rejected_lr, f_divergence, f_alpha)
    delta = chosen_s - rejected_s
    if loss_type == "sigmoid":
        return _smoothed_sigmoid(beta * delta, eps)
    if loss_type == "hinge":
        return torch.relu(1.0 - beta * delta)
    if loss_type in ("ipo", "sigmoid_norm"):
        avg = _per_token_mean(chosen_s, chosen_lengths, loss_type) - \
            _per_token_mean(rejected_s, rejected_lengths, loss_type)
        return (avg - 1.0 / (2.0 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * avg)
    if loss_type == "robust":
        clean, flipped = -(1.0 - eps) * F.logsigmoid(beta * delta), -eps * F.logsigmoid(-beta * delta)
        return (clean - flipped) / (1.0 - 2.0 * eps)
    if loss_type == "exo_pair":
        z = beta * delta
        return torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-eps)) + \
            torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(eps))
    r_c, r_r = beta * chosen_lr, beta * rejected_lr
    if loss_type == "nca_pair":
        return -F.logsigmoid(r_c) - 0.5 * F.logsigmoid(-r_c) - 0.5 * F.logsigmoid(-r_r)
    if loss_type == "bco_pair":
        return -F.logsigmoid(r_c) - F.logsigmoid(-r_r)
    if loss_type == "apo_zero":
        return 1.0 - torch.sigmoid(r_c) + torch.sigmoid(r_r)
    if loss_type == "apo_down":
        return torch.sigmoid(r_c) + 1.0 - torch.sigmoid(beta * (chosen_lr - rejected_lr))
    if loss_type == "sppo_hard":
        return (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
    if loss_type == "aot":
        sorted_delta = (policy_chosen - policy_rejected).sort(dim=0).values - \
            (ref_chosen - ref_rejected).sort(dim=0).values
        return _smoothed_sigmoid(beta * sorted_delta, eps)
    if loss_type == "aot_unpaired":
        return _smoothed_sigmoid(beta * (chosen_lr.sort(dim=0).values - rejected_lr.sort(dim=0).values), eps)
    if loss_type == "discopop":
        z = beta * delta
        gate = torch.sigmoid(z / discopop_tau)
        return -F.logsigmoid(z) * (1.0 - gate) + torch.exp(-z) * gate
    # sft: the chosen answers' mean NLL per token, one number for the micro-batch, on every pair
    tokens = chosen_lengths if sft_tokens is None else sft_tokens
    if tokens is None:
        raise ValueError("chosen_lengths: the sft loss needs chosen_lengths (token counts)")
    plain = policy_chosen if sft_chosen is None else sft_chosen
    nll = -plain.sum() / tokens.to(plain.dtype).sum().clamp(min=1.0)
    return nll.expand(policy_chosen.shape)


def dpo_loss(
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_lengths: Tensor | None = None,
    rejected_lengths: Tensor | None = None,
    loss_weights: Sequence[float] | None = None,
    discopop_tau: float = DISCOPOP_TAU,
    f_divergence_type: str = "reverse_kl",
    f_alpha_divergence_coef: float = F_ALPHA_COEF,
    sft_chosen_logps: Tensor | None = None,
    sft_chosen_tokens: Tensor | None = None,
    pair_weights: Tensor | None = None,
) -> DPOOutput:
    """Per-pair DPO losses from sequence log-probs (summed over completion tokens), following
    `DPOTrainer._compute_loss` in TRL 1.16, with Δ = (π_c - ref_c) - (π_r - ref_r),
    r_c, r_r = β times each answer's log-ratio and ε = `label_smoothing`. Another `f_divergence_type` than
    reverse_kl (f-DPO) puts each answer's score `f_scores` in place of its log-ratio in Δ (and in ipo's and
    sigmoid_norm's per-token Δ̄), for the losses of `F_DIVERGENCE_LOSSES` only, as TRL; the rewards stay β
    times the log-ratios.

    - `sigmoid` (Rafailov et al. 2023): -logσ(βΔ). With ε > 0 it is conservative DPO (cDPO, Mitchell
      2023): -(1-ε)·logσ(βΔ) - ε·logσ(-βΔ), the form TRL's sigmoid loss had before 1.0; TRL 1.16 ignores ε
      here, so ε = 0 matches it exactly.
    - `ipo` (Azar et al. 2023, Eq. 17): (Δ̄ - 1/(2β))², where Δ̄ divides each side's log-ratio by its
      completion length, as TRL does (the IPO authors' normalisation); `sigmoid_norm`: -logσ(βΔ̄). Both need
      `chosen_lengths` and `rejected_lengths` (completion token counts; clamped to at least 1).
    - `hinge` (SLiC, Zhao et al. 2023): relu(1 - βΔ).
    - `robust` (Chowdhury et al. 2024), ε = flip probability, meant in [0, 0.5) (any ε but 0.5 is taken,
      as TRL takes it with a warning): ((1-ε)·(-logσ(βΔ)) - ε·(-logσ(-βΔ))) / (1 - 2ε).
    - `exo_pair` (EXO, Ji et al. 2024, Eq. 16), ε in (0, 1): KL from [σ(βΔ), σ(-βΔ)] to [1-ε, ε],
      σ(βΔ)·(logσ(βΔ) - log(1-ε)) + σ(-βΔ)·(logσ(-βΔ) - log ε).
    - `nca_pair` (Chen et al. 2024) -logσ(r_c) - ½logσ(-r_c) - ½logσ(-r_r); `bco_pair` -logσ(r_c) - logσ(-r_r);
      `sppo_hard` (Wu et al. 2024) (r_c/β - 1/(2β))² + (r_r/β + 1/(2β))²; `apo_zero` (D'Oosterlinck et al.
      2024) 1 - σ(r_c) + σ(r_r); `apo_down` σ(r_c) + 1 - σ(βΔ).
    - `aot` (AOT, Melnyk et al. 2024): cDPO's form on the sorted policy margins (π_c - π_r) less the sorted
      reference margins, the i-th smallest against the i-th smallest; `aot_unpaired` on the sorted chosen
      log-ratios less the sorted rejected ones. The sort is over the micro-batch's pairs, as TRL's.
    - `discopop` (Lu et al. 2024, Eq. 5), τ = `discopop_tau`: -logσ(βΔ)·(1 - σ(βΔ/τ)) + exp(-βΔ)·σ(βΔ/τ).
    - `sft`: the policy's mean NLL over the micro-batch's chosen tokens (Σ -π_c / Σ `chosen_lengths`), the
      same on every pair, as TRL expands it; from `sft_chosen_logps` and `sft_chosen_tokens` when given (the
      plain sums, where LD-DPO's `ld_alpha` weighs the others, and the scored tokens: an empty prompt leaves
      an answer's first token unscored, in TRL's mean too).

    `loss_type` may be a list, TRL's combination of several losses: each pair's loss is Σ_k w_k·loss_k with
    w = `loss_weights` (default 1 each), so the mean over pairs is TRL's Σ_k w_k·mean(loss_k). Rewards are β
    times each answer's log-ratio (TRL's `rewards/chosen`, `rewards/rejected`). `pair_weights` [num_pairs]
    (WPO's, detached: `algorithms.dpo.wpo_weights`) multiply each pair's every loss term, as TRL's
    `use_weighting`; not with the losses of `UNWEIGHABLE`.
    """
    if not beta > 0:
        raise ValueError(f"beta: must be positive, got {beta}")
    check_dpo_settings(loss_type, loss_weights, label_smoothing, discopop_tau, f_divergence_type,
                       f_alpha_divergence_coef, pair_weights is not None)
    shape = policy_chosen_logps.shape
    for name, t in (("policy_rejected_logps", policy_rejected_logps), ("ref_chosen_logps", ref_chosen_logps),
                    ("ref_rejected_logps", ref_rejected_logps)):
        if t.shape != shape:
            raise ValueError(f"{name}: shape {tuple(t.shape)} differs from policy_chosen_logps' {tuple(shape)}")
    types = loss_types_of(loss_type)
    weights = [1.0] * len(types) if loss_weights is None else list(loss_weights)
    losses: Tensor | None = None
    for t, w in zip(types, weights, strict=True):
        term = pair_losses(t, policy_chosen_logps, policy_rejected_logps, ref_chosen_logps, ref_rejected_logps,
                           beta, label_smoothing, discopop_tau, chosen_lengths, rejected_lengths, f_divergence_type,
                           f_alpha_divergence_coef, sft_chosen_logps, sft_chosen_tokens)
        term = term if pair_weights is None else term * pair_weights
        term = term if w == 1.0 else term * w
        losses = term if losses is None else losses + term
    assert losses is not None
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps).detach()
    return DPOOutput(losses, chosen_rewards, beta * (policy_rejected_logps - ref_rejected_logps).detach())
