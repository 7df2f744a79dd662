"""PPO's numbers against float64 hand computations: reward placement at the last real token, the
missing-EOS penalty and clamp, the KL estimators, whitening, GAE, the clipped value loss and the
adaptive KL controller. Loops over plain Python floats, written from the papers' formulas."""

from __future__ import annotations

import math

import pytest
import torch

from pagedrl.train.losses import clipped_surrogate, clipped_value_loss
from pagedrl.train.rl.advantages import explained_variance, ppo_targets, ppo_token_rewards
from pagedrl.train.rl.kl_control import AdaptiveKLController, KLController

# Three completions of lengths 4, 2 and 5 (the last one cut by max_tokens: no EOS). With SmolLM2
# the pad id is the EOS id; nothing here reads ids, the mask comes from the lengths.
LENGTHS = [4, 2, 5]
T = 5


def mask_of(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([[j < n for j in range(T)] for n in lengths])


def rand(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def hand_whiten(rows: list[list[float]], lengths: list[int], shift_mean: bool = True) -> list[list[float]]:
    vals = [rows[i][j] for i, n in enumerate(lengths) for j in range(n)]
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    out = [[0.0] * T for _ in rows]
    for i, n in enumerate(lengths):
        for j in range(n):
            w = (rows[i][j] - mean) / math.sqrt(var + 1e-8)
            out[i][j] = w + (0.0 if shift_mean else mean)
    return out


def hand_gae(rewards, values, lengths, gamma, lam):
    adv = [[0.0] * T for _ in rewards]
    ret = [[0.0] * T for _ in rewards]
    for i, n in enumerate(lengths):
        last = 0.0
        for t in reversed(range(n)):
            next_v = values[i][t + 1] if t + 1 < n else 0.0
            delta = rewards[i][t] + gamma * next_v - values[i][t]
            last = delta + gamma * lam * last
            adv[i][t] = last
            ret[i][t] = last + values[i][t]
    return adv, ret


def test_the_score_lands_on_the_last_real_token_of_each_completion() -> None:
    mask = mask_of(LENGTHS)
    kl = rand((3, T), 0) * mask
    rewards, non_score = ppo_token_rewards(torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64), kl, mask, 0.1)
    for i, n in enumerate(LENGTHS):
        for j in range(T):
            expected = (-0.1 * float(kl[i, j]) if j < n else 0.0) + ([1.0, -2.0, 0.5][i] if j == n - 1 else 0.0)
            assert float(rewards[i, j]) == pytest.approx(expected, abs=1e-12)
            assert float(non_score[i, j]) == pytest.approx(-0.1 * float(kl[i, j]) if j < n else 0.0, abs=1e-12)
    with pytest.raises(ValueError, match="at least one token"):
        ppo_token_rewards(torch.zeros(3, dtype=torch.float64), kl, mask_of([4, 0, 5]), 0.1)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
@pytest.mark.parametrize("whiten_rewards", [False, True])
def test_ppo_targets_match_a_float64_hand_computation(estimator: str, whiten_rewards: bool) -> None:
    mask = mask_of(LENGTHS)
    logps, ref, values = -rand((3, T), 1).abs(), -rand((3, T), 2).abs(), rand((3, T), 3)
    scores = torch.tensor([3.0, -14.0, 0.25], dtype=torch.float64)
    has_eos = torch.tensor([True, True, False])
    kl_coef, penalty, clip, gamma, lam = 0.05, 1.0, 10.0, 0.99, 0.95
    out = ppo_targets(scores, has_eos, logps, ref, values, mask, kl_coef, estimator, penalty, clip,
                      whiten_rewards, gamma, lam)
    # by hand
    s = [3.0, -14.0, 0.25 - 1.0]  # the completion without EOS pays the penalty
    s = [min(max(x, -clip), clip) for x in s]  # then the clamp: -14 -> -10
    rewards = [[0.0] * T for _ in range(3)]
    for i, n in enumerate(LENGTHS):
        for j in range(n):
            log_r = float(ref[i, j]) - float(logps[i, j])
            kl = -log_r if estimator == "k1" else math.exp(log_r) - 1.0 - log_r
            assert float(out.kl[i, j]) == pytest.approx(kl, abs=1e-12)
            rewards[i][j] = -kl_coef * kl + (s[i] if j == n - 1 else 0.0)
    if whiten_rewards:
        rewards = hand_whiten(rewards, LENGTHS, shift_mean=False)
    v = [[float(values[i, j]) if j < n else 0.0 for j in range(T)] for i, n in enumerate(LENGTHS)]
    adv, ret = hand_gae(rewards, v, LENGTHS, gamma, lam)
    adv = hand_whiten(adv, LENGTHS)
    assert out.scores.tolist() == pytest.approx(s, abs=1e-12)
    torch.testing.assert_close(out.rewards, torch.tensor(rewards, dtype=torch.float64), atol=1e-10, rtol=0)
    torch.testing.assert_close(out.returns, torch.tensor(ret, dtype=torch.float64), atol=1e-10, rtol=0)
    torch.testing.assert_close(out.advantages, torch.tensor(adv, dtype=torch.float64), atol=1e-8, rtol=0)


def test_the_log_ratio_is_clamped_before_the_kl() -> None:
    mask = mask_of([2, 2, 2])
    logps = torch.zeros(3, T, dtype=torch.float64)
    ref = torch.full((3, T), -100.0, dtype=torch.float64)  # a token the reference all but rules out
    out = ppo_targets(torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.bool), logps, ref,
                      torch.zeros(3, T, dtype=torch.float64), mask, 1.0, "k1", log_ratio_clamp=20.0)
    assert out.kl[0, 0] == 20.0 and out.kl[0, 2] == 0.0


def test_clipped_value_loss_matches_a_hand_computation() -> None:
    mask = mask_of(LENGTHS)
    values, old, returns = rand((3, T), 4), rand((3, T), 5), rand((3, T), 6)
    out = clipped_value_loss(values, old, returns, mask, 0.2)
    for i, n in enumerate(LENGTHS):
        for j in range(T):
            v, o, r = float(values[i, j]), float(old[i, j]), float(returns[i, j])
            clipped = min(max(v, o - 0.2), o + 0.2)
            a, b = (v - r) ** 2, (clipped - r) ** 2
            assert float(out.loss[i, j]) == pytest.approx(0.5 * max(a, b) if j < n else 0.0, abs=1e-12)
            assert bool(out.is_clipped[i, j]) == (j < n and b > a)


def test_policy_loss_is_trls_clipped_surrogate_by_hand() -> None:
    mask = mask_of(LENGTHS)
    new, old, adv = -rand((3, T), 7).abs(), -rand((3, T), 8).abs(), rand((3, T), 9)
    out = clipped_surrogate(new, old, adv, mask, 0.2)
    for i, n in enumerate(LENGTHS):
        for j in range(n):
            r = math.exp(float(new[i, j]) - float(old[i, j]))
            a = float(adv[i, j])
            expected = max(-a * r, -a * min(max(r, 0.8), 1.2))  # TRL: max(pg_losses, pg_losses2)
            assert float(out.loss[i, j]) == pytest.approx(expected, abs=1e-12)
            assert bool(out.is_region_clipped[i, j]) == (-a * min(max(r, 0.8), 1.2) > -a * r)


def test_adaptive_kl_controller_follows_ziegler_et_al() -> None:
    ctl = AdaptiveKLController(0.1, target=6.0, horizon=10000)
    expected = 0.1
    for kl, n in ((12.0, 64), (6.5, 64), (1.0, 128), (6.0, 64)):
        ctl.update(kl, n)
        error = min(max(kl / 6.0 - 1.0, -0.2), 0.2)
        expected *= 1.0 + error * n / 10000
        assert ctl.value == pytest.approx(expected, rel=1e-15)
    fixed = KLController(0.05)
    fixed.update(100.0, 64)
    assert fixed.value == 0.05
    restored = AdaptiveKLController(0.1, 6.0, 10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


def test_explained_variance_by_hand() -> None:
    mask = mask_of(LENGTHS)
    pred, target = rand((3, T), 10), rand((3, T), 11)
    ys = [float(target[i, j]) for i, n in enumerate(LENGTHS) for j in range(n)]
    ps = [float(pred[i, j]) for i, n in enumerate(LENGTHS) for j in range(n)]

    def var(xs):
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs)

    expected = 1.0 - var([y - p for y, p in zip(ys, ps, strict=True)]) / var(ys)
    assert explained_variance(pred, target, mask) == pytest.approx(expected, abs=1e-12)
