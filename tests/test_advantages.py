"""Advantages against float64 hand computations (NumPy with explicit NaN handling, Python loops)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from trl.trainer.utils import nanstd as trl_nanstd

from pagedrl.train.rl.advantages import (
    combine_rewards,
    gae,
    group_advantages,
    masked_whiten,
    nanstd,
    zero_std_groups,
)

NAN = float("nan")


def hand_group_advantages(rewards: np.ndarray, scale: str, eps: float = 1e-4) -> np.ndarray:
    """[groups, G] float64 -> advantages; NaN rewards excluded, unscorable -> 0."""
    out = np.zeros_like(rewards)
    scored_all = rewards[~np.isnan(rewards)]
    batch_std = float(np.std(scored_all, ddof=1)) if scored_all.size > 1 else math.nan
    for i, row in enumerate(rewards):
        scored = row[~np.isnan(row)]
        if scored.size == 0 or np.all(scored == scored[0]):
            continue  # unscorable group, or nothing to prefer: zero advantage
        mean = float(np.mean(scored))
        std = float(np.std(scored, ddof=1))
        for j, r in enumerate(row):
            if math.isnan(r):
                continue
            if scale == "group":
                out[i, j] = (r - mean) / (std + eps)
            elif scale == "batch":
                out[i, j] = (r - mean) / (batch_std + eps)
            else:
                out[i, j] = r - mean
    return out


def reward_table(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rewards = rng.normal(size=(5, 4))
    rewards[1, :] = 0.1  # every completion got the same reward
    rewards[2, 1] = NAN  # one completion unscorable
    rewards[3, :] = NAN  # a group nobody could score
    rewards[4, :3] = NAN  # a single scored completion
    return rewards


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_group_advantages_match_hand_computation(scale_rewards: str) -> None:
    rewards = reward_table()
    expected = hand_group_advantages(rewards, scale_rewards)
    got_2d = group_advantages(torch.tensor(rewards), scale_rewards=scale_rewards)
    got_flat = group_advantages(torch.tensor(rewards).flatten(), num_generations=4, scale_rewards=scale_rewards)
    np.testing.assert_allclose(got_2d.numpy(), expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(got_flat.numpy(), expected.flatten(), rtol=1e-12, atol=1e-15)
    assert got_flat.shape == (20,) and torch.isfinite(got_flat).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_a_group_whose_rewards_agree_gets_exactly_zero(dtype, scale_rewards) -> None:
    rewards = torch.tensor([[0.1] * 8, [0.7, 0.7, NAN, 0.7, 0.7, 0.7, 0.7, 0.7], [1.0, 0.0] * 4], dtype=dtype)
    adv = group_advantages(rewards, scale_rewards=scale_rewards)
    assert (adv[:2] == 0).all()
    assert not torch.isnan(adv).any()
    assert (adv[2] != 0).all()
    assert zero_std_groups(rewards).tolist() == [True, True, False]


def test_group_advantages_use_the_unbiased_std_as_trl() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    # mean 0.25; unbiased std sqrt(0.75 / 3) = 0.5
    assert group_advantages(rewards, eps=1e-4)[0, 0].item() == pytest.approx(0.75 / 0.5001, rel=1e-12)
    x = torch.tensor(reward_table(1))
    torch.testing.assert_close(nanstd(x, dim=1), trl_nanstd(x, dim=1), equal_nan=True)
    torch.testing.assert_close(nanstd(x), trl_nanstd(x))


def test_group_advantages_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(2, 4), scale_rewards="std")
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(torch.zeros(8))
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(torch.zeros(10), num_generations=4)
    with pytest.raises(ValueError, match="num_generations"):
        group_advantages(torch.zeros(2, 4), num_generations=8)
    with pytest.raises(ValueError, match="eps"):
        group_advantages(torch.zeros(2, 4), eps=0.0)


def test_combine_rewards_is_a_weighted_nansum_keeping_unscorable_rows_nan() -> None:
    per_func = torch.tensor([[1.0, 0.5], [NAN, 2.0], [NAN, NAN], [-1.0, NAN]], dtype=torch.float64)
    got = combine_rewards(per_func, [2.0, 0.5])
    assert got[[0, 1, 3]].tolist() == pytest.approx([2.0 + 0.25, 1.0, -2.0])
    assert math.isnan(got[2].item())
    assert combine_rewards(per_func)[[0, 1, 3]].tolist() == pytest.approx([1.5, 2.0, -1.0])
    with pytest.raises(ValueError, match="weights"):
        combine_rewards(per_func, [1.0])


def test_none_rewards_are_excluded_from_the_group_baseline() -> None:
    """A completion no reward function could score must not pull its group's mean to 0."""
    per_func = torch.tensor([[1.0], [NAN], [0.0], [1.0]], dtype=torch.float64)
    adv = group_advantages(combine_rewards(per_func), num_generations=4, scale_rewards="none")
    assert adv.tolist() == pytest.approx([1 / 3, 0.0, -2 / 3, 1 / 3])


def hand_gae(rewards, values, mask, gamma, lam):
    rows, cols = len(rewards), len(rewards[0])
    adv = [[0.0] * cols for _ in range(rows)]
    for b in range(rows):
        length = sum(mask[b])  # right-padded: the episode is the first `length` tokens
        last = 0.0
        for t in reversed(range(length)):
            next_value = values[b][t + 1] if t + 1 < length else 0.0
            delta = rewards[b][t] + gamma * next_value - values[b][t]
            last = delta + gamma * lam * last
            adv[b][t] = last
    returns = [[adv[b][t] + values[b][t] if mask[b][t] else 0.0 for t in range(cols)] for b in range(rows)]
    return adv, returns


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.8), (1.0, 1.0)])
def test_gae_matches_hand_computation(gamma: float, lam: float) -> None:
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(4, 6, generator=g, dtype=torch.float64)
    values = torch.randn(4, 6, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 3, 1, 0])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    rewards_padded = rewards.masked_fill(~mask, NAN)  # garbage past the end must not matter
    adv, ret = gae(rewards_padded, values, mask, gamma=gamma, lam=lam)
    exp_adv, exp_ret = hand_gae(rewards.tolist(), values.tolist(), mask.int().tolist(), gamma, lam)
    assert adv.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in exp_adv]
    assert ret.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in exp_ret]


def test_gae_with_gamma_and_lambda_one_is_reward_to_go_minus_value() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.2, 0.5, 0.9]], dtype=torch.float64)
    adv, ret = gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=1.0)
    assert adv.tolist()[0] == pytest.approx([0.8, 0.5, 0.1])
    assert ret.tolist()[0] == pytest.approx([1.0, 1.0, 1.0])


def test_masked_whiten_matches_hand_computation() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, generator=g, dtype=torch.float64) * 2 + 1
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.bool)
    picked = x.numpy()[mask.numpy()]
    mean, var = picked.mean(), picked.var(ddof=1)
    expected = (x.numpy() - mean) / math.sqrt(var + 1e-8)
    np.testing.assert_allclose(masked_whiten(x, mask).numpy(), expected, rtol=1e-12)
    np.testing.assert_allclose(masked_whiten(x, mask, shift_mean=False).numpy(), expected + mean, rtol=1e-12)
    with pytest.raises(ValueError, match="mask"):
        masked_whiten(x, torch.zeros_like(mask))
