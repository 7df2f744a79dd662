"""pagedrl's DPO and GRPO losses against TRL 1.16's own loss code on the same tensors.

TRL computes these losses inside trainer methods (`DPOTrainer._compute_loss`,
`GRPOTrainer._compute_loss`), not in free functions. We call those methods unbound on a minimal
stand-in for the trainer whose model returns the log-probs we choose, so what runs is TRL's code,
line for line, and what it computes must equal the composition of pagedrl's pure pieces.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from float_bounds import U
from trl.trainer.dpo_trainer import DPOTrainer
from trl.trainer.grpo_trainer import GRPOTrainer

from pagedrl.train.algorithms.grpo import clip_extremes
from pagedrl.train.distributed import DistInfo
from pagedrl.train.dpo_losses import dpo_loss
from pagedrl.train.losses import aggregate, clipped_surrogate, kl_estimate, vespo_weights
from pagedrl.train.metrics import MetricTotals

# --------------------------------------------------------------------------------------------- DPO


class _Accelerator:
    device = torch.device("cpu")
    num_processes = 1

    @staticmethod
    def gather(t: torch.Tensor) -> torch.Tensor:
        return t

    gather_for_metrics = gather

    @staticmethod
    def reduce(t: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return t


def _metrics() -> defaultdict:
    return defaultdict(lambda: defaultdict(list))


def _dpo_batch(num_pairs: int = 5, seq_len: int = 9, seed: int = 0):
    """A [chosen; rejected] batch: prompt tokens first, then a completion of random length."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * num_pairs
    completion_mask = torch.zeros(rows, seq_len, dtype=torch.long)
    for r in range(rows):
        start = int(torch.randint(1, 4, (1,), generator=g))
        end = int(torch.randint(start + 1, seq_len + 1, (1,), generator=g))
        completion_mask[r, start:end] = 1
    shift_mask = completion_mask[:, 1:].float()
    # per-token log-probs of the shifted labels; 0 where the label is masked, as TRL's fused head
    token_logps = -torch.rand(rows, seq_len - 1, generator=g, dtype=torch.float64) * 3 * shift_mask
    ref_logps = (-torch.rand(rows, seq_len - 1, generator=g, dtype=torch.float64) * 3 * shift_mask).sum(1)
    return completion_mask, token_logps, ref_logps


def _trl_dpo(loss_type: str | list[str], beta: float, label_smoothing: float, completion_mask, token_logps, ref_logps,
             loss_weights: list[float] | None = None, discopop_tau: float = 0.05, dtype=torch.float64, **options):
    """TRL's loss, its gradient in the per-token log-probs and its metrics. TRL builds EXO's ε as a tensor of
    the default dtype: `dtype` here, as everything else in these comparisons. `options`: the trainer's
    other attributes (`f_divergence_type`, `ld_alpha`, ...), and `log_sum_sq_probs` (WPO's) of its outputs."""
    loss_types = [loss_type] if isinstance(loss_type, str) else loss_type
    rows, seq_len = completion_mask.shape
    token_logps = token_logps.clone().requires_grad_(True)
    outputs = SimpleNamespace(
        log_probs=token_logps,
        entropy=torch.zeros(rows, seq_len - 1),
        mean_logits=torch.zeros(rows, seq_len - 1),
        is_top1=torch.zeros(rows, seq_len - 1, dtype=torch.bool),
        log_sum_sq_probs=options.pop("log_sum_sq_probs", None),
    )
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=loss_types,
        loss_weights=loss_weights or [1.0] * len(loss_types), beta=beta, label_smoothing=label_smoothing,
        use_weighting=False, _metrics=_metrics(), _total_train_tokens=0, _tp_size=1,
        args=SimpleNamespace(discopop_tau=discopop_tau),
    )
    vars(trainer).update(options)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    inputs = {
        "input_ids": torch.zeros(rows, seq_len, dtype=torch.long),
        "attention_mask": torch.ones(rows, seq_len, dtype=torch.long),
        "completion_mask": completion_mask,
        "ref_chosen_logps": ref_chosen,
        "ref_rejected_logps": ref_rejected,
    }
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        loss = DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, return_outputs=False)
    finally:
        torch.set_default_dtype(default)
    (grad,) = torch.autograd.grad(loss, token_logps)
    return loss.detach(), grad, trainer._metrics["train"]


def _ours_dpo(completion_mask, token_logps, ref_logps, **settings):
    """pagedrl's DPO loss on the same batch as the trainer composes it: the answers' summed log-probs and
    token counts into `dpo_loss`, the mean over pairs; the loss, its gradient in the per-token log-probs and
    the output (rewards). An answer's sum covers its own tokens only, as `answer_logps`'s does."""
    ours_logps = token_logps.clone().requires_grad_(True)
    policy_chosen, policy_rejected = (ours_logps * completion_mask[:, 1:]).sum(1).chunk(2)
    ref_chosen, ref_rejected = ref_logps.chunk(2)
    lengths_chosen, lengths_rejected = completion_mask.sum(1).chunk(2)
    out = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, chosen_lengths=lengths_chosen,
                   rejected_lengths=lengths_rejected, **settings)
    loss = out.losses.mean()
    (grad,) = torch.autograd.grad(loss, ours_logps)
    return loss.detach(), grad, out


def assert_dpo_equals_trl(settings: dict, seed: int) -> None:
    """pagedrl's loss and gradient equal TRL's DPOTrainer's in float64 (a few dozen operations on values of
    order 1: ~1e-15 apart, 1e-12 asked; relative where discopop's exp(-βΔ) grows large), and so do the
    reward metrics."""
    completion_mask, token_logps, ref_logps = _dpo_batch(seed=seed)
    trl_loss, trl_grad, metrics = _trl_dpo(settings["loss_type"], settings["beta"],
                                           settings.get("label_smoothing", 0.0), completion_mask, token_logps,
                                           ref_logps, settings.get("loss_weights"), settings.get("discopop_tau", 0.05))
    loss, grad, out = _ours_dpo(completion_mask, token_logps, ref_logps, **settings)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-12, atol=1e-12)
    # TRL's per-token log-probs outside the answers are 0 and summed all the same: their gradient means nothing
    torch.testing.assert_close(grad, trl_grad * completion_mask[:, 1:], rtol=1e-12, atol=1e-12)
    assert metrics["rewards/chosen"][0] == pytest.approx(out.chosen_rewards.mean().item(), rel=1e-12)
    assert metrics["rewards/rejected"][0] == pytest.approx(out.rejected_rewards.mean().item(), rel=1e-12)
    assert metrics["rewards/margins"][0] == pytest.approx(
        (out.chosen_rewards - out.rejected_rewards).mean().item(), rel=1e-12, abs=1e-12
    )
    # TRL averages the 0/1 flags in float32: an exact count over an exact count, one rounding (U)
    accuracy = (out.chosen_rewards > out.rejected_rewards).double().mean().item()
    assert metrics["rewards/accuracies"][0] == pytest.approx(accuracy, rel=U)


@pytest.mark.parametrize(
    ("loss_type", "label_smoothing"),
    [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.0), ("robust", 0.2), ("nca_pair", 0.0),
     ("bco_pair", 0.0), ("sppo_hard", 0.0), ("apo_zero", 0.0), ("apo_down", 0.0)],
)
@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_dpo_loss_equals_trl_dpo_trainer(loss_type: str, label_smoothing: float, beta: float) -> None:
    assert_dpo_equals_trl(dict(loss_type=loss_type, beta=beta, label_smoothing=label_smoothing), seed=int(beta * 10))


# -------------------------------------------------------------------------------------------- GRPO


def _grpo_batch(rows: int = 6, seq_len: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, seq_len, dtype=torch.long)
    for r in range(rows):
        mask[r, : int(torch.randint(1, seq_len + 1, (1,), generator=g))] = 1
    logp = -torch.rand(rows, seq_len, generator=g, dtype=torch.float64) * 2
    old = logp + torch.randn(rows, seq_len, generator=g, dtype=torch.float64) * 0.3  # many ratios outside 1 ± eps
    ref = logp + torch.randn(rows, seq_len, generator=g, dtype=torch.float64) * 0.2
    sampling = old + torch.randn(rows, seq_len, generator=g, dtype=torch.float64) * 0.5
    advantages = torch.randn(rows, generator=g, dtype=torch.float64)
    return mask, logp, old, ref, sampling, advantages


SAPO = (1.0, 1.05)  # TRL's default temperatures, where the advantage is positive and elsewhere
VESPO = ((2.0, 3.0), (3.0, 2.0))  # TRL's default (k_pos, k_neg), (lambda_pos, lambda_neg)


def _trl_grpo(loss_type, beta, eps_low, eps_high, delta, max_completion_length, mask, logp, old, ref, is_ratio, adv,
              vespo=VESPO, level="token"):
    rows, seq_len = mask.shape
    logp = logp.clone().requires_grad_(True)
    trainer = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **kw: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level=level,
        beta=beta, loss_type=loss_type, epsilon_low=eps_low, epsilon_high=eps_high,
        use_vllm=True, vllm_importance_sampling_correction=True, model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, accelerator=_Accelerator(), _entropy_bonus_enabled=False,
        aux_loss_enabled=False, _metrics=_metrics(), max_completion_length=max_completion_length,
        get_gamma_weights=GRPOTrainer.get_gamma_weights,  # TRL's own, a static method
        args=SimpleNamespace(use_bias_correction_kl=True, delta=delta, steps_per_generation=1,
                             sapo_temperature_pos=SAPO[0], sapo_temperature_neg=SAPO[1],
                             vespo_k_pos=vespo[0][0], vespo_k_neg=vespo[0][1], vespo_lambda_pos=vespo[1][0],
                             vespo_lambda_neg=vespo[1][1]),
    )
    inputs = {
        "prompt_ids": torch.zeros(rows, 2, dtype=torch.long),
        "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
        "completion_ids": torch.zeros(rows, seq_len, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "importance_sampling_ratio": is_ratio,
        "num_items_in_batch": mask.sum().to(torch.float64),
    }
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, trainer._metrics["train"]


def _ours_grpo(loss_type, beta, mask, logp, old, ref, tis, adv, max_completion_length=None, vespo=None, **surrogate):
    """pagedrl's GRPO loss from its pieces, as the trainer composes them: the surrogate, times the rollout's
    importance weight (for vespo, inside its sequence weight instead), plus the bias-corrected KL; the loss
    and its gradient in logp."""
    ours = logp.clone().requires_grad_(True)
    if vespo is not None:
        surrogate["vespo"] = vespo_weights(ours, old, adv, mask, tis, *vespo)
        tis = 1.0
    out = clipped_surrogate(ours, old, adv, mask, **surrogate)
    per_token = out.loss * tis
    if beta:
        per_token = per_token + beta * kl_estimate(ours, ref, "k3") * out.ratio  # TRL's bias-corrected KL
    loss = aggregate(per_token, mask, loss_type, max_completion_length=max_completion_length)
    (grad,) = torch.autograd.grad(loss, ours)
    return loss.detach(), grad, out


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"])
@pytest.mark.parametrize(("beta", "eps_high", "delta"), [(0.0, 0.2, None), (0.04, 0.28, 1.6)])
def test_grpo_loss_composed_from_pieces_equals_trl_grpo_trainer(loss_type, beta, eps_high, delta) -> None:
    eps_low, max_len = 0.2, 10
    mask, logp, old, ref, sampling, adv = _grpo_batch(seed=3)
    tis = torch.exp(old - sampling)  # TRL receives the ratio ready-made; we build it the same way
    trl_loss, trl_grad, metrics = _trl_grpo(loss_type, beta, eps_low, eps_high, delta, max_len, mask, logp, old,
                                            ref, tis, adv)

    loss, grad, out = _ours_grpo(loss_type, beta, mask, logp, old, ref, tis, adv, max_len, epsilon_low=eps_low,
                                 epsilon_high=eps_high, delta=delta)

    # float64 on both sides, a few dozen operations on values of order 1: ~1e-15 apart
    torch.testing.assert_close(loss.detach(), trl_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad * mask, trl_grad * mask, rtol=1e-12, atol=1e-12)
    n = mask.sum().item()
    # TRL averages the 0/1 flags in float32: an exact count over an exact count, one rounding (U)
    assert metrics["clip_ratio/low_mean"][0] == pytest.approx(out.is_low_clipped.sum().item() / n, rel=U)
    assert metrics["clip_ratio/high_mean"][0] == pytest.approx(out.is_high_clipped.sum().item() / n, rel=U)
    assert metrics["clip_ratio/region_mean"][0] == pytest.approx(out.is_region_clipped.sum().item() / n, rel=U)
    assert 0 < out.is_region_clipped.sum() < n  # the batch exercises both clipped and unclipped tokens


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_grpo_clip_extremes_are_trls_micro_batch_means(level) -> None:
    """`clip_ratio/low_min` and `/high_max`: TRL appends each micro-batch's min (max) over its completions'
    clipped shares (a completion with no token skipped) and logs their mean, not the step's min (max)."""
    totals, logged, step_max = MetricTotals(), defaultdict(list), 0.0
    for seed in (3, 5):
        mask, logp, old, ref, sampling, adv = _grpo_batch(seed=seed)
        mask[1] = 0  # no token: NaN, skipped
        _, _, metrics = _trl_grpo("grpo", 0.0, 0.05, 0.05, None, 10, mask, logp, old, ref, torch.exp(old - sampling),
                                  adv, level=level)
        out = clipped_surrogate(logp, old, adv, mask, epsilon_low=0.05, epsilon_high=0.05, level=level)
        for name, metric in clip_extremes(out.is_low_clipped, out.is_high_clipped, mask).items():
            totals.add(name, metric)
            logged[name] += metrics[name]
        step_max = max(step_max, float(out.is_high_clipped.double().max()))
    values = totals.all_reduce(DistInfo()).values()
    for name in ("clip_ratio/low_min", "clip_ratio/high_max"):
        assert values[name] == pytest.approx(statistics.fmean(logged[name]), rel=U), name
    if level == "token":  # (at sequence level the flags are 0 or 1; RLOO's test has micro-batches that differ)
        assert 0 < values["clip_ratio/high_max"] != step_max  # the mean of two micro-batches' maxima


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_cispo_loss_equals_trl_grpo_trainer(beta) -> None:
    """CISPO: the importance weight min(r, ε_high), detached, times the advantage and the log-prob, divided
    as dapo; with TRL's recommended ε_high of 5 and one of 1.2, where the batch's ratios cross it."""
    mask, logp, old, ref, sampling, adv = _grpo_batch(seed=4)
    tis = torch.exp(old - sampling)
    for eps_high in (5.0, 1.2):
        trl_loss, trl_grad, metrics = _trl_grpo("cispo", beta, 0.2, eps_high, None, 10, mask, logp, old, ref, tis,
                                                adv)
        loss, grad, out = _ours_grpo("cispo", beta, mask, logp, old, ref, tis, adv, epsilon_high=eps_high,
                                     cispo=True)
        torch.testing.assert_close(loss, trl_loss, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad * mask, trl_grad * mask, rtol=1e-12, atol=1e-12)
        assert metrics["cispo_clip_ratio"][-1] == pytest.approx(out.is_high_clipped.sum().item() / mask.sum().item(),
                                                                rel=U)
    assert 0 < out.is_high_clipped.sum() < mask.sum()  # at 1.2 some weights are capped, some not


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_sapo_loss_equals_trl_grpo_trainer(beta) -> None:
    """SAPO: the soft gate σ(τ(r - 1)) · 4/τ in place of the clip, τ by the advantage's sign, averaged per
    sequence then over sequences as grpo."""
    mask, logp, old, ref, sampling, adv = _grpo_batch(seed=5)
    tis = torch.exp(old - sampling)
    trl_loss, trl_grad, _ = _trl_grpo("sapo", beta, 0.2, 0.2, None, 10, mask, logp, old, ref, tis, adv)
    loss, grad, _ = _ours_grpo("sapo", beta, mask, logp, old, ref, tis, adv, sapo=SAPO)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad * mask, trl_grad * mask, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("vespo", [VESPO, ((1.5, 0.5), (0.5, 4.0))])
@pytest.mark.parametrize(("beta", "rollout_weights"), [(0.0, True), (0.04, True), (0.04, False)])
def test_vespo_loss_equals_trl_grpo_trainer(vespo, beta, rollout_weights) -> None:
    """VESPO: each completion's weight φ(w) of its sequence importance ratio, the rollout's truncated importance
    weights included (built as TRL builds them: 1 outside the completion, capped at 3) or not, times -A · logp,
    divided as dapo; TRL's `vespo/phi_seq_mean` logged."""
    mask, logp, old, ref, sampling, adv = _grpo_batch(seed=6)
    tis = torch.exp((old - sampling) * mask).clamp(max=3.0) if rollout_weights else None
    trl_loss, trl_grad, metrics = _trl_grpo("vespo", beta, 0.2, 0.2, None, 10, mask, logp, old, ref, tis, adv, vespo)
    loss, grad, _ = _ours_grpo("vespo", beta, mask, logp, old, ref, tis, adv, vespo=vespo)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad * mask, trl_grad * mask, rtol=1e-12, atol=1e-12)
    phi = vespo_weights(logp, old, adv, mask, tis, *vespo)
    # TRL's k and λ are float32 tensors (torch.where of Python numbers), as ours: the same numbers both sides
    assert metrics["vespo/phi_seq_mean"][0] == pytest.approx(phi.mean().item(), rel=1e-12)
    assert phi.min() < 0.5 < 0.9 < phi.max()  # the batch exercises weights far from 1
