"""GSPO: TRL 1.16's `importance_sampling_level: sequence` against TRL's own `GRPOTrainer._compute_loss`, for
every loss type TRL takes with it, on the same float64 tensors (the stand-in trainer of
tests/test_losses_trl.py): one ratio per completion, exp of its mean token log-ratio, clipped as TRL clips
it, a [B, 1] loss aggregated as TRL aggregates one, the KL's bias correction by the sequence ratio, the
rollout's importance weights per token, and the clip ratios counted per completion."""

from __future__ import annotations

import pytest
import torch
from float_bounds import U
from test_losses_trl import SAPO, VESPO, _grpo_batch, _ours_grpo, _trl_grpo

from pagedrl.train.losses import clipped_surrogate, kl_estimate

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo"]
SURROGATE = {"cispo": {"cispo": True}, "sapo": {"sapo": SAPO}}


def _sequence_log_ratio(logp, old, mask):
    """A completion's mean token log-ratio, by hand, from the masked tokens only."""
    return torch.tensor([[sum((logp[r, t] - old[r, t]).item() for t in range(mask.shape[1]) if mask[r, t])
                          / max(int(mask[r].sum()), 1)] for r in range(mask.shape[0])], dtype=torch.float64)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize(("beta", "eps_low", "eps_high", "delta", "rollout_weights"),
                         [(0.0, 0.05, 0.08, None, False), (0.04, 0.05, 0.08, 1.06, True), (0.04, 3e-4, 4e-4, None, True)])
def test_sequence_level_loss_equals_trl_grpo_trainer(loss_type, beta, eps_low, eps_high, delta, rollout_weights) -> None:
    """Loss and gradient to 1e-12, and TRL's logged clip ratios (per completion), cispo's and vespo's metrics and
    the KL (TRL logs it times the sequence ratio), with GSPO's epsilons (3e-4 / 4e-4, every completion of this
    batch clipped) and wider ones (some clipped, some not); delta only where PPO-clip has it."""
    mask, logp, old, ref, sampling, adv = _grpo_batch(rows=12, seed=7)
    mask[3] = 0  # an empty completion (all of it masked, as mask_truncated_completions leaves one): ratio 1
    # the rollout's weights built as TRL builds them (1 outside the completion, capped at 3), or all 1
    tis = torch.exp((old - sampling) * mask).clamp(max=3.0) if rollout_weights else torch.ones_like(logp)
    if loss_type in ("cispo", "sapo", "vespo"):
        delta = None  # PPO-clip's cap (refused with these, as in pagedrl's config)
    if loss_type == "cispo":
        eps_high = 1.01  # a cap near 1, where this batch's sequence ratios cross it
    trl_loss, trl_grad, metrics = _trl_grpo(loss_type, beta, eps_low, eps_high, delta, 10, mask, logp, old, ref,
                                            tis, adv, level="sequence")
    surrogate = dict(SURROGATE.get(loss_type, {}), epsilon_low=eps_low, epsilon_high=eps_high, delta=delta,
                     level="sequence")
    loss, grad, out = _ours_grpo(loss_type, beta, mask, logp, old, ref, tis, adv, 10,
                                 vespo=VESPO if loss_type == "vespo" else None, **surrogate)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad * mask, trl_grad * mask, rtol=1e-12, atol=1e-12)
    assert grad.abs().max() > 0
    torch.testing.assert_close(out.ratio, _sequence_log_ratio(logp, old, mask).exp(), rtol=1e-12, atol=0)
    assert out.ratio[3].item() == 1.0
    rows = mask.shape[0]
    if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        assert out.is_region_clipped.shape == (rows, 1)
        for name, flags in (("low", out.is_low_clipped), ("high", out.is_high_clipped),
                            ("region", out.is_region_clipped)):
            assert metrics[f"clip_ratio/{name}_mean"][0] == pytest.approx(flags.sum().item() / rows, rel=U)
        # both kinds of completion (under GSPO's clip too: one whose advantage pulls its ratio back is not clipped)
        assert 0 < out.is_region_clipped.sum() < rows
    if loss_type == "cispo":
        assert metrics["cispo_clip_ratio"][0] == pytest.approx(out.is_high_clipped.sum().item() / rows, rel=U)
        assert 0 < out.is_high_clipped.sum() < rows
    if beta:
        kl = (kl_estimate(logp, ref, "k3") * out.ratio).masked_fill(mask == 0, 0.0)
        assert metrics["kl"][0] == pytest.approx(kl.sum().item() / mask.sum().item(), rel=1e-12)


def test_sequence_level_takes_garbage_outside_the_mask_and_refuses_an_unknown_level() -> None:
    """Padding's log-probs (NaN, inf) never reach the sequence ratio, its loss or its gradient; a level other
    than token or sequence is an error naming it."""
    mask, logp, old, _, _, adv = _grpo_batch(seed=8)
    logp = logp.masked_fill(mask == 0, float("nan")).requires_grad_(True)
    old = old.masked_fill(mask == 0, float("inf"))
    out = clipped_surrogate(logp, old, adv, mask.bool(), level="sequence")
    (grad,) = torch.autograd.grad(out.loss.sum(), logp)
    assert torch.isfinite(out.ratio).all() and torch.isfinite(out.loss).all() and torch.isfinite(grad).all()
    with pytest.raises(ValueError, match="^level: unknown importance sampling level 'seq'"):
        clipped_surrogate(logp, old, adv, mask, level="seq")
