"""TRL 1.16 DPOConfig options beyond the loss type, each held to TRL's own DPOTrainer code on the same
batch: f-DPO's `f_divergence_type` (loss, gradient and reward metrics to 1e-12 in float64; alpha_divergence,
whose TRL code runs in float32 only, in float32), and the settings refused, naming the key, where they do
not fit."""

from __future__ import annotations

import pytest
import torch
from float_bounds import gamma
from test_losses_trl import _dpo_batch, _ours_dpo, _trl_dpo

from pagedrl.train.config import TrainConfigError
from pagedrl.train.dpo_losses import dpo_loss
from pagedrl.train.offline_config import DPOConfig


def assert_options_equal_trl(settings: dict, options: dict, seed: int, dtype=torch.float64, tol: float = 1e-12) -> None:
    """pagedrl's DPO loss with `options` (TRL's trainer attributes, pagedrl's `dpo_loss` arguments of the same
    names) against TRL's `_compute_loss`: loss, gradient in the per-token log-probs, reward metrics."""
    completion_mask, token_logps, ref_logps = _dpo_batch(seed=seed)
    token_logps, ref_logps = token_logps.to(dtype), ref_logps.to(dtype)
    trl_loss, trl_grad, metrics = _trl_dpo(settings["loss_type"], settings["beta"],
                                           settings.get("label_smoothing", 0.0), completion_mask, token_logps,
                                           ref_logps, settings.get("loss_weights"), dtype=dtype, **options)
    loss, grad, out = _ours_dpo(completion_mask, token_logps, ref_logps, **settings, **options)
    torch.testing.assert_close(loss, trl_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, trl_grad * completion_mask[:, 1:], rtol=tol, atol=tol)
    for name, ours in (("rewards/chosen", out.chosen_rewards.mean()), ("rewards/rejected", out.rejected_rewards.mean()),
                       ("rewards/margins", (out.chosen_rewards - out.rejected_rewards).mean())):
        assert metrics[name][0] == pytest.approx(ours.item(), rel=tol, abs=tol), name


@pytest.mark.parametrize("f_divergence_type", ["forward_kl", "js_divergence"])
@pytest.mark.parametrize(("loss_type", "extra"), [
    ("sigmoid", {}), ("hinge", {}), ("ipo", {}), ("sigmoid_norm", {}), ("robust", dict(label_smoothing=0.2)),
    ("exo_pair", dict(label_smoothing=1e-3)), ("discopop", {}), ("sft", {}),
    (["sigmoid", "sft"], dict(loss_weights=[1.0, 0.5])),
])
def test_f_divergence_equals_trl_dpo_trainer(f_divergence_type: str, loss_type, extra: dict) -> None:
    """f-DPO: each answer's f'(π/π_ref) in place of its log-ratio, for every loss TRL allows it with."""
    assert_options_equal_trl(dict(loss_type=loss_type, beta=0.3, **extra),
                             dict(f_divergence_type=f_divergence_type), seed=11)


def test_alpha_divergence_at_one_is_reverse_kl_as_in_trl() -> None:
    """α within 1e-6 of 1, the limit where (t^(α-1) - 1)/(α-1) → log t: DPO's own log-ratios (float64, TRL takes
    this branch before its float32-only clamp)."""
    options = dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=1.0 + 1e-7)
    assert_options_equal_trl(dict(loss_type="sigmoid", beta=0.2), options, seed=12)


@pytest.mark.parametrize(("loss_type", "alpha"), [("sigmoid", 0.5), ("ipo", 0.3), ("hinge", -40.0),
                                                  ("discopop", 1.5)])
def test_alpha_divergence_equals_trl_dpo_trainer_in_float32(loss_type: str, alpha: float) -> None:
    """TRL's alpha_divergence clamps the exponent by dtype and knows float16, bfloat16 and float32 only (a
    float64 batch is a KeyError there), so both run in float32, the trainer's loss precision: the same
    operations in the same order, within a few dozen roundings. α = -40 puts exponents past the clamp at 80."""
    options = dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=alpha)
    assert_options_equal_trl(dict(loss_type=loss_type, beta=0.25), options, seed=13, dtype=torch.float32,
                             tol=gamma(64))
    if alpha == -40.0:
        _, token_logps, ref_logps = _dpo_batch(seed=13)
        assert ((alpha - 1) * (token_logps.sum(1) - ref_logps)).max() > 80  # the clamp is exercised


@pytest.mark.parametrize(("fields", "key", "says"), [
    (dict(f_divergence_type="forward_kl", loss_type="bco_pair"), "f_divergence_type", "bco_pair takes only reverse_kl"),
    (dict(f_divergence_type="js_divergence", loss_type=["sigmoid", "aot", "nca_pair"]), "f_divergence_type",
     "aot, nca_pair takes only"),
    (dict(f_alpha_divergence_coef=0.3), "f_alpha_divergence_coef", "only f_divergence_type alpha_divergence"),
    (dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=float("nan")), "f_alpha_divergence_coef",
     "must be .*finite"),
    (dict(f_divergence_type="chi2"), "f_divergence_type", "unknown 'chi2'"),
])
def test_options_that_do_not_fit_are_refused_naming_the_key(fields: dict, key: str, says: str) -> None:
    with pytest.raises(TrainConfigError, match=rf"^{key}: .*{says}"):
        DPOConfig(**fields)
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=rf"^{key}: .*{says}"):  # the loss itself checks the same way
        dpo_loss(x, x, x, x, chosen_lengths=x, rejected_lengths=x, **fields)
