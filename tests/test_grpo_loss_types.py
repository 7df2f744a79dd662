"""GRPO's loss types beyond PPO-clip, on a real rollout of the tiny model: CISPO's and SAPO's gradients
on-policy equal the clipped losses' they reduce to there (their numbers off-policy are held to TRL's
GRPOTrainer in tests/test_losses_trl.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_grpo import grpo, write_prompts

from pagedrl.train.losses import aggregate, clipped_surrogate, kl_estimate, tis_weight
from pagedrl.train.rl.config import GRPOConfig


@pytest.fixture
def prompts_file(tmp_path):
    return write_prompts(tmp_path)


def flat_gradient(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def on_policy_gradients(algo, loss_types: tuple[str, ...]) -> tuple[list[torch.Tensor], list[dict]]:
    """The gradient and metrics of one rollout's first batch under each loss type, in turn."""
    b = algo.step_batches(1)[0]
    total = torch.tensor(float(algo.count(b)))
    grads, metrics = [], []
    for loss_type in loss_types:
        algo.config = dataclasses.replace(algo.config, loss_type=loss_type)
        algo.model.zero_grad()
        loss, logged = algo.loss(algo.model, b, total)
        loss.backward()
        grads.append(flat_gradient(algo.model))
        metrics.append(logged)
    return grads, metrics


def test_cispo_trains_on_policy_as_dapo_does_and_logs_trl_s_metric(tiny_train_model, prompts_file) -> None:
    """On-policy (ratio 1, nothing capped under ε_high 5) CISPO's gradient is dapo's: -A · ∇logp over the
    tokens; it logs TRL's `cispo_clip_ratio`, and PPO-clip's `delta` is refused with it."""
    grads, metrics = on_policy_gradients(grpo(tiny_train_model, prompts_file, loss_type="cispo", epsilon_high=5.0),
                                         ("cispo", "dapo"))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert grads[0].abs().max() > 0
    assert "cispo_clip_ratio" in metrics[0] and "clip_ratio/high_mean" not in metrics[0]
    assert "cispo_clip_ratio" not in metrics[1] and "clip_ratio/high_mean" in metrics[1]
    with pytest.raises(ValueError, match="delta"):
        GRPOConfig(loss_type="cispo", delta=2.0)
    warned = grpo(tiny_train_model, prompts_file, loss_type="cispo")  # epsilon_high unset: epsilon, 0.2
    assert any("caps every importance weight at epsilon_high=0.2" in line for line in warned.summary_lines())


def test_sapo_trains_on_policy_as_grpo_does(tiny_train_model, prompts_file) -> None:
    """On-policy SAPO's gate σ(τ(r - 1)) · 4/τ has slope 1 at r = 1 whatever τ: its gradient is grpo's
    (each sequence's token mean, then the mean over sequences)."""
    grads, _ = on_policy_gradients(grpo(tiny_train_model, prompts_file, loss_type="sapo", sapo_temperature_neg=2.0),
                                   ("sapo", "grpo"))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert grads[0].abs().max() > 0


@pytest.mark.parametrize("corrected", [True, False])
def test_the_kl_term_is_trl_s_bias_corrected_one_by_default(tiny_train_model, prompts_file, corrected) -> None:
    """With beta > 0 the trainer's loss is the one composed from the pieces tests/test_losses_trl.py holds to
    TRL's GRPOTrainer: the KL weighted by the live ratio (TRL's use_bias_correction_kl, its default), whose
    gradient differs from the plain KL's even on-policy; `use_bias_correction_kl: false` is the plain one."""
    algo = grpo(tiny_train_model, prompts_file, beta=0.04, use_bias_correction_kl=corrected)
    c = algo.config
    b = algo.step_batches(1)[0]
    total = torch.tensor(float(algo.count(b)))
    with torch.no_grad():  # the policy moved off its reference (the KL is 0 at the start, and so its weight)
        for p in algo.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    grads = []
    for composed in (False, True):
        algo.model.zero_grad()
        if composed:
            logp = b.to_padded(algo.token_logps(algo.model, b).logps)
            out = clipped_surrogate(logp, logp.detach(), b.advantages, b.mask, c.epsilon, c.epsilon_high, c.delta)
            kl = kl_estimate(logp, b.ref_logps, "k3") * (out.ratio if corrected else 1.0)
            per_token = out.loss * tis_weight(logp.detach(), b.sampling_logps, c.tis_cap) + c.beta * kl
            loss = aggregate(per_token, b.mask, "dapo", normaliser=total)
        else:
            loss = algo.loss(algo.model, b, total)[0]
        loss.backward()
        grads.append(flat_gradient(algo.model))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-8)
