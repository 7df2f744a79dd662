"""GRPO's loss types beyond PPO-clip, on a real rollout of the tiny model: CISPO's, SAPO's, LUSPO's and
VESPO's gradients on-policy equal those of the losses they reduce to there (their numbers off-policy are
held to TRL's GRPOTrainer in tests/test_losses_trl.py)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_grpo import grpo, write_prompts

from pagedrl.train.config import load_config
from pagedrl.train.losses import aggregate, clipped_surrogate, kl_estimate, vespo_weights
from pagedrl.train.rl.config import GRPOConfig
from pagedrl.train.tis import tis_weight


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


def test_luspo_trains_on_policy_as_dr_grpo_times_the_completion_length(tiny_train_model, prompts_file) -> None:
    """LUSPO sums each completion's tokens and averages completions; Dr. GRPO divides the same sum by
    max_completion_length too: with the same PPO-clip per token, luspo's gradient is max_completion_length
    times dr_grpo's, and it logs PPO-clip's clip ratios."""
    algo = grpo(tiny_train_model, prompts_file, loss_type="luspo")
    grads, metrics = on_policy_gradients(algo, ("luspo", "dr_grpo"))
    torch.testing.assert_close(grads[0] / algo.config.max_completion_length, grads[1], rtol=1e-5, atol=1e-7)
    assert grads[0].abs().max() > 0 and "clip_ratio/region_mean" in metrics[0]
    # TRL's luspo at either importance_sampling_level (its paper's, sequence: tests/test_grpo_gspo.py)
    for level in ("token", "sequence"):
        config = load_config(GRPOConfig, None, ["loss_type=luspo", f"importance_sampling_level={level}"])
        assert (config.loss_type, config.importance_sampling_level) == ("luspo", level)


def test_vespo_weight_by_hand() -> None:
    """φ(w) = e^λ · w^k · e^(-λw) of a completion's ratio w = Π over its tokens of π/π_old times the rollout's
    weights: 1 at w = 1, k and λ by the advantage's sign (0 counts as positive), padding left out."""
    logp = torch.tensor([[-1.0, -2.0, 7.0], [-0.5, -0.25, -3.0]], dtype=torch.float64)
    old = torch.tensor([[-1.25, -1.5, 0.0], [-0.5, -0.25, -3.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    rollout = torch.tensor([[2.0, 1.0, 100.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    phi = vespo_weights(logp, old, torch.tensor([-1.0, 0.0]), mask, rollout, (2.0, 3.0), (3.0, 2.0))
    w = math.exp(0.25 - 0.5) * 2.0  # the first row's ratio; the second's is 1
    expected = [math.exp(2.0) * w**3 * math.exp(-2.0 * w), 1.0]  # A < 0: k = 3, λ = 2
    assert phi.flatten().tolist() == pytest.approx(expected, rel=1e-12)
    # k and λ are float32 numbers, as TRL's torch.where over two Python floats makes them, in a float64 loss too
    phi = vespo_weights(logp[:1], old[:1], torch.tensor([1.0]), mask[:1], None, (2.1, 3.0), (0.3, 2.0))
    k, lam = (float(torch.tensor(v, dtype=torch.float32)) for v in (2.1, 0.3))
    w = math.exp(0.25 - 0.5)
    assert phi.item() == pytest.approx(math.exp(lam + k * math.log(w) - lam * w), rel=1e-14)


def test_vespo_trains_on_policy_as_dapo_and_weighs_in_the_rollout_s_importance_weights(tiny_train_model,
                                                                                      prompts_file) -> None:
    """On-policy without the rollout's importance weights (tis_correction: false) every VESPO weight φ(1) is 1: its
    gradient is dapo's. With them (token_truncate at 3, the default) the weights are φ of their product over each
    completion's tokens, and the logged `vespo/phi_seq_mean` is theirs; PPO-clip's `delta` is refused with it,
    and the vespo parameters without it."""
    grads, metrics = on_policy_gradients(grpo(tiny_train_model, prompts_file, loss_type="vespo", tis_correction=False),
                                         ("vespo", "dapo"))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    assert grads[0].abs().max() > 0
    phi = metrics[0]["vespo/phi_seq_mean"]
    assert float(phi.total) / float(phi.weight) == pytest.approx(1.0, abs=1e-6)
    assert "clip_ratio/region_mean" not in metrics[0]
    algo = grpo(tiny_train_model, prompts_file, loss_type="vespo", vespo_k_neg=1.0, vespo_lambda_neg=5.0)
    b = algo.step_batches(1)[0]
    # an engine whose log-probs are ~0.1 off the trainer's per token, so that the weights count
    noise = torch.randn(b.sampling_logps.shape, generator=torch.Generator().manual_seed(0))
    b.sampling_logps = b.sampling_logps + 0.1 * noise
    logged = algo.loss(algo.model, b, torch.tensor(float(algo.count(b))))[1]["vespo/phi_seq_mean"]
    with torch.no_grad():
        logp = b.to_padded(algo.token_logps(algo.model, b).logps)
    phi = vespo_weights(logp, logp, b.advantages, b.mask, tis_weight(logp, b.sampling_logps, 3.0), (2.0, 1.0),
                        (3.0, 5.0))
    assert float(logged.total) / float(logged.weight) == pytest.approx(phi.mean().item(), rel=1e-5)
    assert (phi - 1).abs().max() > 0.05
    with pytest.raises(ValueError, match="^delta: "):
        GRPOConfig(loss_type="vespo", delta=2.0)
    with pytest.raises(ValueError, match="^vespo_lambda_pos: only the vespo loss uses it"):
        GRPOConfig(loss_type="dapo", vespo_lambda_pos=1.0)
    with pytest.raises(ValueError, match="^vespo_lambda_neg: must be > 0"):
        GRPOConfig(loss_type="vespo", vespo_lambda_neg=0.0)


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
