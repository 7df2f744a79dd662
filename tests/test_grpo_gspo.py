"""GSPO (`importance_sampling_level: sequence`) in the trainer, on a real rollout of the tiny model: what must
hold given the sequence ratio s = exp(mean over a completion's tokens of log π/π_old). Its numbers off-policy
are held to TRL's GRPOTrainer in tests/test_losses_trl_gspo.py.

On-policy s = 1 and ∇s = (1/n) Σ ∇logp over the completion's n tokens. Every loss type spreads a completion's
one value over its n tokens (n · ∇s = Σ ∇logp, each token's ∇r), so without the rollout's weights and the KL
its gradient is the token level's, whatever the aggregation. The KL's bias correction kl_t · s instead of
kl_t · r_t moves the gradient by β Σ_t (k̄ - kl_t) ∇logp_t, k̄ the completion's mean KL."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_grpo import grpo, write_prompts
from test_grpo_loss_types import flat_gradient

from pagedrl.train.algorithms.grpo import loss_warnings
from pagedrl.train.config import load_config
from pagedrl.train.losses import aggregate, kl_estimate
from pagedrl.train.rl.config import GRPOConfig

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo", "cispo", "sapo", "vespo")


@pytest.fixture
def prompts_file(tmp_path):
    return write_prompts(tmp_path)


def gradient(algo, b, **fields) -> tuple[torch.Tensor, dict]:
    algo.config = dataclasses.replace(algo.config, **fields)
    algo.model.zero_grad()
    loss, metrics = algo.loss(algo.model, b, torch.tensor(float(algo.count(b))))
    loss.backward()
    return flat_gradient(algo.model), metrics


def test_on_policy_the_sequence_level_gradient_is_the_token_level_one(tiny_train_model, prompts_file) -> None:
    """Every loss type, on-policy, the rollout's weights off (tis_correction: false), beta 0: the same gradient at either
    level; the clip ratios are 0 and counted per completion at sequence level, per token at token level."""
    algo = grpo(tiny_train_model, prompts_file, tis_correction=False, epsilon=3e-4, epsilon_high=4e-4)
    b = algo.step_batches(1)[0]
    for loss_type in LOSS_TYPES:
        eps_high = 5.0 if loss_type == "cispo" else 4e-4  # cispo's cap above the ratio 1, as TRL recommends
        token, _ = gradient(algo, b, loss_type=loss_type, epsilon_high=eps_high, importance_sampling_level="token")
        sequence, metrics = gradient(algo, b, loss_type=loss_type, epsilon_high=eps_high,
                                     importance_sampling_level="sequence")
        torch.testing.assert_close(sequence, token, rtol=1e-5, atol=1e-7, msg=loss_type)
        assert token.abs().max() > 0
        if loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
            region = metrics["clip_ratio/region_mean"]
            assert float(region.total) == 0.0 and float(region.weight) == b.num_sequences


def test_the_kl_bias_correction_weighs_by_the_sequence_ratio(tiny_train_model, prompts_file) -> None:
    """On-policy with beta > 0 the sequence level's gradient is the token level's plus β · ∇ of the dapo
    aggregate of sg(k̄ - kl_t) · logp_t (see the module's docstring); the logged KL is TRL's, kl_t · s (here 1)."""
    algo = grpo(tiny_train_model, prompts_file, beta=0.04, tis_correction=False)
    b = algo.step_batches(1)[0]
    with torch.no_grad():  # the policy moved off its reference (the KL is 0 at the start)
        for p in algo.model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    token, _ = gradient(algo, b)
    sequence, metrics = gradient(algo, b, importance_sampling_level="sequence")
    algo.model.zero_grad()
    logp = b.to_padded(algo.token_logps(algo.model, b).logps)
    with torch.no_grad():
        kl = kl_estimate(logp, b.ref_logps, "k3").masked_fill(~b.mask, 0.0)
        k_bar = kl.sum(-1, keepdim=True) / b.mask.sum(-1, keepdim=True).clamp(min=1)
    total = torch.tensor(float(algo.count(b)))
    (0.04 * aggregate((k_bar - kl) * logp, b.mask, "dapo", normaliser=total)).backward()
    torch.testing.assert_close(sequence, token + flat_gradient(algo.model), rtol=1e-4, atol=1e-8)
    assert (sequence - token).abs().max() > 1e-3 * token.abs().max()  # the two corrections do differ
    logged = metrics["kl"]
    assert float(logged.total) / float(logged.weight) == pytest.approx(float(kl.sum() / b.mask.sum()), rel=1e-5)


def test_off_policy_the_clip_ratios_count_completions(tiny_train_model, prompts_file) -> None:
    """With each completion's old log-probs shifted by one constant c per completion, its sequence ratio is
    exactly exp(-c): the completions clipped are those moved outside 1 ± ε in their advantage's direction, and
    `clip_ratio/*_mean` is their share of the completions; the KL logged is kl_t · exp(-c), TRL's."""
    algo = grpo(tiny_train_model, prompts_file, beta=0.04, importance_sampling_level="sequence", epsilon=0.2)
    b = algo.step_batches(1)[0]
    with torch.no_grad():
        logp = b.to_padded(algo.token_logps(algo.model, b).logps)
    shift = torch.tensor([0.5 if i % 3 == 0 else -0.5 if i % 3 == 1 else 0.1 for i in range(b.num_sequences)])
    b.old_logps = logp + shift[:, None]
    metrics = gradient(algo, b)[1]
    ratio = torch.exp(-shift).to(logp.dtype)
    adv = b.advantages.to(logp.dtype)
    low = ((ratio < 0.8) & (adv < 0)).sum().item()
    high = ((ratio > 1.2) & (adv > 0)).sum().item()
    assert low > 0 and high > 0
    for name, count in (("low", low), ("high", high), ("region", low + high)):
        m = metrics[f"clip_ratio/{name}_mean"]
        assert float(m.total) == count and float(m.weight) == b.num_sequences
    with torch.no_grad():
        kl = (kl_estimate(logp, b.ref_logps, "k3") * ratio[:, None]).masked_fill(~b.mask, 0.0)
    logged = metrics["kl"]
    assert float(logged.total) / float(logged.weight) == pytest.approx(float(kl.sum() / b.mask.sum()), rel=1e-4)


def test_trl_s_warnings_are_start_up_lines_and_an_unknown_level_is_refused() -> None:
    """TRL takes every loss type at either level and warns about four cases; each is a start-up line here.
    An unknown level is refused naming the key."""
    def lines(**fields) -> list[str]:
        return loss_warnings(GRPOConfig(**fields))

    for loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
        warned = lines(loss_type=loss_type, importance_sampling_level="sequence", epsilon_high=5.0)
        assert any(f"with loss_type {loss_type}: the {loss_type} loss sums per-token" in w for w in warned)
        assert not lines(loss_type=loss_type, epsilon_high=5.0)
    assert not lines(loss_type="grpo", importance_sampling_level="sequence")
    assert not lines(loss_type="sapo", importance_sampling_level="sequence")
    assert any("luspo with importance_sampling_level token" in w for w in lines(loss_type="luspo"))
    assert not lines(loss_type="luspo", importance_sampling_level="sequence")
    assert any("changes only the KL term" in w for w in lines(loss_type="vespo", importance_sampling_level="sequence"))
    assert not lines(loss_type="vespo")
    config = load_config(GRPOConfig, None, ["importance_sampling_level=sequence", "epsilon=3e-4", "epsilon_high=4e-4"])
    assert config.importance_sampling_level == "sequence"
    with pytest.raises(ValueError, match="^command line: importance_sampling_level: expected one of 'token', "
                                         "'sequence', got 'seq'"):
        load_config(GRPOConfig, None, ["importance_sampling_level=seq"])
    with pytest.raises(ValueError, match="^importance_sampling_level: expected 'token' or 'sequence'"):
        GRPOConfig(importance_sampling_level="Sequence")
