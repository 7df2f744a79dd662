"""Every DPO loss type of TRL 1.16 against a float64 hand computation: plain Python loops and `math`, one
pair at a time, written from the papers' formulas as TRL's DPOTrainer states them (tests/test_losses_trl.py
and tests/test_dpo_loss_types.py hold the same losses to TRL's own code); then TRL's weighted lists of
several losses, and the settings the loss refuses."""

from __future__ import annotations

import math

import pytest
import torch
from test_losses import log_sigmoid

from pagedrl.train.dpo_losses import DPO_LOSS_TYPES, dpo_loss


def sigmoid(x: float) -> float:
    return math.exp(log_sigmoid(x))


def smoothed(z: float, ls: float) -> float:
    """Conservative DPO's -(1-ε)·logσ(z) - ε·logσ(-z)."""
    return -(1 - ls) * log_sigmoid(z) - ls * log_sigmoid(-z)


def hand_dpo(pc, pr, rc, rr, beta, loss_type, ls, lc, lr, tau=0.05) -> list[float]:
    """One loss type's per-pair losses from lists of summed log-probs and completion lengths."""
    n = len(pc)
    cl = [pc[i] - rc[i] for i in range(n)]  # each answer's log-ratio log π/π_ref
    rl = [pr[i] - rr[i] for i in range(n)]
    if loss_type == "aot":  # the i-th smallest policy margin against the i-th smallest reference margin
        policy, ref = sorted(pc[i] - pr[i] for i in range(n)), sorted(rc[i] - rr[i] for i in range(n))
        return [smoothed(beta * (policy[i] - ref[i]), ls) for i in range(n)]
    if loss_type == "aot_unpaired":
        chosen, rejected = sorted(cl), sorted(rl)
        return [smoothed(beta * (chosen[i] - rejected[i]), ls) for i in range(n)]
    if loss_type == "sft":  # the chosen tokens' mean NLL, the same number on every pair
        return [-sum(pc) / max(sum(lc), 1)] * n
    return [pair_loss(loss_type, beta * (cl[i] - rl[i]), cl[i], rl[i], cl[i] / max(lc[i], 1) - rl[i] / max(lr[i], 1),
                      beta, ls, tau) for i in range(n)]


def pair_loss(loss_type: str, z: float, cl: float, rl: float, avg: float, beta: float, ls: float,
              tau: float) -> float:
    """One pair's loss from z = βΔ, the answers' log-ratios and avg, their per-token difference."""
    c, r = beta * cl, beta * rl
    if loss_type == "sigmoid":
        return smoothed(z, ls)
    if loss_type == "hinge":
        return max(0.0, 1 - z)
    if loss_type == "ipo":
        return (avg - 1 / (2 * beta)) ** 2
    if loss_type == "sigmoid_norm":
        return -log_sigmoid(beta * avg)
    if loss_type == "robust":
        return (-(1 - ls) * log_sigmoid(z) + ls * log_sigmoid(-z)) / (1 - 2 * ls)
    if loss_type == "exo_pair":  # EXO: KL([σ(z), σ(-z)] || [1-ε, ε])
        return sigmoid(z) * (log_sigmoid(z) - math.log(1 - ls)) + sigmoid(-z) * (log_sigmoid(-z) - math.log(ls))
    if loss_type == "nca_pair":
        return -log_sigmoid(c) - 0.5 * log_sigmoid(-c) - 0.5 * log_sigmoid(-r)
    if loss_type == "bco_pair":
        return -log_sigmoid(c) - log_sigmoid(-r)
    if loss_type == "sppo_hard":
        return (cl - 0.5 / beta) ** 2 + (rl + 0.5 / beta) ** 2
    if loss_type == "apo_zero":
        return 1 - sigmoid(c) + sigmoid(r)
    if loss_type == "apo_down":
        return sigmoid(c) + 1 - sigmoid(z)
    assert loss_type == "discopop"  # the logistic and the exponential loss, blended by σ(z/τ)
    return -log_sigmoid(z) * (1 - sigmoid(z / tau)) + math.exp(-z) * sigmoid(z / tau)


def random_pairs(seed: int, n: int = 7):
    """float64 summed log-probs in [-40, 0] and completion lengths, the first chosen answer empty."""
    g = torch.Generator().manual_seed(seed)
    pc, pr, rc, rr = (-torch.rand(n, generator=g, dtype=torch.float64) * 40 for _ in range(4))
    lc = torch.randint(0, 30, (n,), generator=g)
    lr = torch.randint(1, 30, (n,), generator=g)
    lc[0] = 0  # an empty completion: its length counts as 1, as in TRL
    return pc, pr, rc, rr, lc, lr


CASES = [("sigmoid", 0.0, {}), ("sigmoid", 0.1, {}), ("ipo", 0.0, {}), ("hinge", 0.0, {}), ("robust", 0.0, {}),
         ("robust", 0.3, {}), ("robust", 0.7, {}), ("robust", -0.2, {}),  # TRL takes these with a warning
         ("sigmoid_norm", 0.0, {}), ("exo_pair", 1e-3, {}), ("exo_pair", 0.5, {}), ("exo_pair", 0.9, {}),
         ("nca_pair", 0.0, {}), ("bco_pair", 0.0, {}), ("sppo_hard", 0.0, {}), ("apo_zero", 0.0, {}),
         ("apo_down", 0.0, {}), ("aot", 0.0, {}), ("aot", 0.2, {}), ("aot", 0.75, {}), ("aot_unpaired", 0.0, {}),
         ("aot_unpaired", 0.35, {}), ("discopop", 0.0, {}), ("discopop", 0.0, dict(discopop_tau=0.7)),
         ("sft", 0.0, {})]


def test_the_cases_cover_every_loss_type() -> None:
    assert {case[0] for case in CASES} == set(DPO_LOSS_TYPES)


@pytest.mark.parametrize(("loss_type", "label_smoothing", "extra"), CASES)
def test_dpo_loss_matches_hand_computation(loss_type: str, label_smoothing: float, extra: dict) -> None:
    pc, pr, rc, rr, lc, lr = random_pairs(seed=11)
    beta = 0.2
    out = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                   chosen_lengths=lc, rejected_lengths=lr, **extra)
    expected = hand_dpo(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), beta, loss_type, label_smoothing,
                        lc.tolist(), lr.tolist(), extra.get("discopop_tau", 0.05))
    assert out.losses.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    pairs_c = zip(pc.tolist(), rc.tolist(), strict=True)
    pairs_r = zip(pr.tolist(), rr.tolist(), strict=True)
    assert out.chosen_rewards.tolist() == pytest.approx([beta * (a - b) for a, b in pairs_c], rel=1e-12)
    assert out.rejected_rewards.tolist() == pytest.approx([beta * (a - b) for a, b in pairs_r], rel=1e-12)


@pytest.mark.parametrize(("loss_type", "loss_weights", "label_smoothing"), [
    (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], 0.0),  # MPO
    (["sigmoid", "sft"], None, 0.0),  # RPO's NLL at weight 1, TRL's default weights
    (["exo_pair", "aot_unpaired", "discopop", "sigmoid_norm", "sppo_hard"], [0.5, 2.0, 0.25, 1.5, 0.125], 0.05),
    (["apo_zero", "apo_down", "nca_pair", "apo_zero"], [1.0, 3.0, 0.5, 0.25], 0.0),  # a name twice counts twice
    (["sigmoid", "sft", "bco_pair"], [1.0, -0.5, -2.0], 0.0),  # negative weights, as TRL takes them
])
def test_a_loss_list_is_the_weighted_sum_by_hand(loss_type, loss_weights, label_smoothing) -> None:
    """Each pair's loss is Σ_k w_k · loss_k, so its mean over pairs is TRL's Σ_k w_k · mean(loss_k)."""
    pc, pr, rc, rr, lc, lr = random_pairs(seed=5)
    beta = 0.3
    out = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
                   chosen_lengths=lc, rejected_lengths=lr, loss_weights=loss_weights)
    weights = loss_weights or [1.0] * len(loss_type)
    terms = [hand_dpo(pc.tolist(), pr.tolist(), rc.tolist(), rr.tolist(), beta, t, label_smoothing, lc.tolist(),
                      lr.tolist()) for t in loss_type]
    expected = [sum(w * term[i] for w, term in zip(weights, terms, strict=True)) for i in range(len(pc))]
    assert out.losses.tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_dpo_rewards_are_detached() -> None:
    pc = torch.tensor([-3.0, -5.0], requires_grad=True)
    pr = torch.tensor([-4.0, -4.0], requires_grad=True)
    out = dpo_loss(pc, pr, torch.tensor([-3.5, -5.0]), torch.tensor([-3.0, -4.5]), beta=0.5)
    assert not out.chosen_rewards.requires_grad and out.losses.requires_grad
    assert out.chosen_rewards.tolist() == pytest.approx([0.25, 0.0])
    assert out.rejected_rewards.tolist() == pytest.approx([-0.5, 0.25])


def test_dpo_loss_rejects_bad_settings() -> None:
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss(x, x, x, x, loss_type="ipo")
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss(x, x, x, x, loss_type="sigmoid_norm")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(x, x, x, x, loss_type="kto")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(ValueError, match="ref_chosen_logps"):
        dpo_loss(x, x, torch.zeros(2), x)
