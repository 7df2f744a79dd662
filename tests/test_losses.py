"""Losses against float64 hand computations (plain Python loops and `math`), and the aggregation's
invariance to how a batch is split into micro-batches."""

from __future__ import annotations

import math

import pytest
import torch
from float_bounds import EXP_ERROR, U, gamma, sum_bound

from pagedrl.train.logprobs import entropy_from_logits, entropy_from_logprobs
from pagedrl.train.losses import (
    aggregate,
    clipped_surrogate,
    kl_estimate,
    resolve_aggregation,
    reward_model_loss,
    sft_loss,
)
from pagedrl.train.tis import tis_weight


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def random_batch(rows: int = 8, cols: int = 6, seed: int = 0, empty_row: bool = True):
    """Per-token values in float64 and a right-padded mask with ragged lengths (one row empty)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(rows, cols, generator=g, dtype=torch.float64)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    if empty_row:
        lengths[2] = 0
    mask = torch.arange(cols)[None, :] < lengths[:, None]
    return values, mask


# --------------------------------------------------------------------------------------- aggregate


def hand_aggregate(values, mask, mode, normaliser=None, max_len=None) -> float:
    rows = values.tolist()
    keep = mask.tolist()
    token_sum = sum(v for row, k in zip(rows, keep, strict=True) for v, m in zip(row, k, strict=True) if m)
    if mode == "token_mean":
        n = sum(sum(k) for k in keep) if normaliser is None else normaliser
        return token_sum / n
    if mode == "seq_mean_token_mean":
        seq_means = []
        for row, k in zip(rows, keep, strict=True):
            picked = [v for v, m in zip(row, k, strict=True) if m]
            seq_means.append(sum(picked) / max(len(picked), 1))
        return sum(seq_means) / (len(rows) if normaliser is None else normaliser)
    return token_sum / ((len(rows) if normaliser is None else normaliser) * (max_len if mode.endswith("norm") else 1))


@pytest.mark.parametrize(
    ("mode", "canonical"),
    [
        ("token_mean", "token_mean"),
        ("seq_mean_token_mean", "seq_mean_token_mean"),
        ("seq_mean_token_sum_norm", "seq_mean_token_sum_norm"),
        ("grpo", "seq_mean_token_mean"),
        ("bnpo", "token_mean"),
        ("dapo", "token_mean"),
        ("dr_grpo", "seq_mean_token_sum_norm"),
        ("seq_mean_token_sum", "seq_mean_token_sum"), ("luspo", "seq_mean_token_sum"), ("vespo", "token_mean"),
    ],
)
@pytest.mark.parametrize("normaliser", [None, 37])
def test_aggregate_matches_hand_computation(mode: str, canonical: str, normaliser) -> None:
    values, mask = random_batch(seed=1)
    assert resolve_aggregation(mode) == canonical
    got = aggregate(values, mask, mode, normaliser=normaliser, max_completion_length=11)
    assert got.item() == pytest.approx(hand_aggregate(values, mask, canonical, normaliser, 11), rel=1e-12)


def test_aggregate_sums_half_precision_losses_in_float32() -> None:
    values = torch.full((1, 3000), 1.001, dtype=torch.bfloat16)
    got = aggregate(values, torch.ones(1, 3000, dtype=torch.bool), "token_mean", normaliser=torch.tensor(3001))
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(float(values[0, 0]) * 3000 / 3001, rel=1e-6)


def test_aggregate_takes_float_masks_and_tensor_normalisers() -> None:
    values, mask = random_batch(seed=2)
    expected = aggregate(values, mask, "token_mean", normaliser=13)
    assert aggregate(values, mask.long(), "token_mean", normaliser=torch.tensor(13)).item() == expected.item()
    assert aggregate(values, mask.float(), "token_mean", normaliser=13.0).item() == expected.item()


def test_aggregate_ignores_garbage_outside_the_mask() -> None:
    values, mask = random_batch(seed=3)
    values = values.masked_fill(~mask, float("nan")).requires_grad_(True)
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
        loss = aggregate(values, mask, mode, max_completion_length=6)
        (grad,) = torch.autograd.grad(loss, values)
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        assert (grad[~mask] == 0).all()


def test_aggregate_of_an_empty_batch_is_zero_not_nan() -> None:
    values = torch.randn(3, 4, dtype=torch.float64)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    assert aggregate(values, mask, "token_mean").item() == 0.0
    assert aggregate(values, mask, "seq_mean_token_mean").item() == 0.0


def _accumulated_grad(x, theta, mask, mode, micro_batches, normaliser_of):
    """Sum of micro-batch gradients of aggregate(x @ theta) over row chunks."""
    theta = theta.clone().requires_grad_(True)
    for rows in torch.arange(x.shape[0]).tensor_split(micro_batches):
        per_token = torch.tanh(x[rows] @ theta)
        aggregate(per_token, mask[rows], mode, normaliser=normaliser_of(mask[rows]), max_completion_length=9).backward()
    return theta.grad


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_aggregate_gradient_does_not_depend_on_micro_batch_split(mode: str) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(10, 7, 5, generator=g, dtype=torch.float64)  # 10 sequences, 7 tokens, 5 features
    theta = torch.randn(5, generator=g, dtype=torch.float64)
    _, mask = random_batch(rows=10, cols=7, seed=5)
    global_count = mask.sum() if mode == "token_mean" else mask.shape[0]

    whole = _accumulated_grad(x, theta, mask, mode, 1, lambda m: None)
    split = _accumulated_grad(x, theta, mask, mode, 4, lambda m: global_count)  # uneven: 3, 3, 2, 2 rows
    torch.testing.assert_close(split, whole, rtol=1e-12, atol=1e-14)
    # the same split with each micro-batch's own count is a different gradient: the test can fail
    local = _accumulated_grad(x, theta, mask, mode, 4, lambda m: None)
    assert not torch.allclose(local, whole, rtol=1e-3)


def test_aggregate_rejects_bad_arguments() -> None:
    values, mask = random_batch()
    with pytest.raises(ValueError, match="mode"):
        aggregate(values, mask, "sequence_mean")
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate(values, mask, "dr_grpo")
    with pytest.raises(ValueError, match="normaliser"):
        aggregate(values, mask, "token_mean", normaliser=0)
    with pytest.raises(ValueError, match="mask"):
        aggregate(values, mask[:, :-1], "token_mean")
    with pytest.raises(ValueError, match="per_token_loss"):
        aggregate(values[0], mask[0], "token_mean")


# --------------------------------------------------------------------------------------------- SFT


def test_sft_loss_is_token_cross_entropy_over_the_global_count() -> None:
    logps, mask = random_batch(seed=6)
    logps = -logps.abs()
    picked = [v for row, k in zip(logps.tolist(), mask.tolist(), strict=True)
              for v, m in zip(row, k, strict=True) if m]
    assert sft_loss(logps, mask).item() == pytest.approx(-sum(picked) / len(picked), rel=1e-12)
    assert sft_loss(logps, mask, num_items_in_batch=100).item() == pytest.approx(-sum(picked) / 100, rel=1e-12)


def test_entropy_from_logits_matches_shannon_entropy() -> None:
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(3, 4, 7, generator=g, dtype=torch.float64) * 3
    got = entropy_from_logits(logits)
    for idx in [(0, 0), (1, 2), (2, 3)]:
        row = logits[idx].tolist()
        z = sum(math.exp(v) for v in row)
        expected = -sum(math.exp(v) / z * (v - math.log(z)) for v in row)
        assert got[idx].item() == pytest.approx(expected, rel=1e-12)


def test_entropy_from_logits_skips_filtered_tokens_in_value_and_gradient() -> None:
    logits = torch.tensor([[0.3, -1.2, float("-inf"), 2.0, float("-inf")]], dtype=torch.float64, requires_grad=True)
    h = entropy_from_logits(logits)
    kept = [0.3, -1.2, 2.0]
    z = sum(math.exp(v) for v in kept)
    assert h.item() == pytest.approx(-sum(math.exp(v) / z * (v - math.log(z)) for v in kept), rel=1e-12)
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


@pytest.mark.parametrize("kernels", ["1", "0"])
def test_entropy_from_logprobs_matches_float64(kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A trainer's entropy metric from its log-probs, through the CPU kernel and through torch, over
    rows of the default model's vocabulary size (a tail of 49159 % 16 values after the vector loop),
    peaked and flat."""
    monkeypatch.setenv("PAGEDRL_CPU_KERNELS", kernels)
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 49159, generator=g) * torch.tensor([[0.1], [1.0], [3.0], [10.0], [40.0]])
    logp = torch.log_softmax(logits, dim=-1)
    terms = logp.double().exp() * logp.double()
    expected = -terms.sum(-1)
    got = entropy_from_logprobs(logp)
    assert got.dtype == torch.float32 and got.shape == (5,)
    if kernels == "1":  # each term rounded once to float32 (exp's error, the product's), summed in float64
        bound = terms.abs().sum(-1) * (EXP_ERROR + U) + expected.abs() * U
    else:  # torch: exp, product, then a float32 sum of 49159 terms in its own order
        bound = terms.abs().sum(-1) * (EXP_ERROR + U) * (1 + gamma(49158)) + sum_bound(terms, 49159) + expected.abs() * U
    assert ((got.double() - expected).abs() <= bound * 1.001).all()


# ------------------------------------------------------------------------------------ reward model


def test_reward_model_loss_is_bradley_terry_with_margin_and_centering() -> None:
    g = torch.Generator().manual_seed(10)
    chosen, rejected, margin = (torch.randn(6, generator=g, dtype=torch.float64) for _ in range(3))
    c, r, m = chosen.tolist(), rejected.tolist(), margin.tolist()
    plain = sum(-log_sigmoid(a - b) for a, b in zip(c, r, strict=True)) / 6
    with_margin = sum(-log_sigmoid(a - b - k) for a, b, k in zip(c, r, m, strict=True)) / 6
    centre = sum((a + b) ** 2 for a, b in zip(c, r, strict=True)) / 6
    assert reward_model_loss(chosen, rejected).item() == pytest.approx(plain, rel=1e-12)
    assert reward_model_loss(chosen, rejected, margin).item() == pytest.approx(with_margin, rel=1e-12)
    got = reward_model_loss(chosen, rejected, margin, center_rewards_coefficient=0.01)
    assert got.item() == pytest.approx(with_margin + 0.01 * centre, rel=1e-12)
    got = reward_model_loss(chosen, rejected, center_rewards_coefficient=0.01, normaliser=24)
    assert got.item() == pytest.approx((plain + 0.01 * centre) * 6 / 24, rel=1e-12)


def test_reward_model_loss_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="r_rejected"):
        reward_model_loss(torch.zeros(3), torch.zeros(4))


# ---------------------------------------------------------------------------------- policy gradient


def hand_surrogate(lp, old, adv, keep, eps_low, eps_high, delta):
    """Per-token loss, d loss / d logp, and the low/high clip flags, token by token."""
    loss, grad, low, high = [], [], [], []
    for b in range(len(lp)):
        row_l, row_g, row_lo, row_hi = [], [], [], []
        for t in range(len(lp[b])):
            a = adv[b][t]
            r = math.exp(lp[b][t] - old[b][t])
            capped = r if delta is None else min(r, delta)
            clipped = min(max(r, 1 - eps_low), 1 + eps_high)
            take_unclipped = capped * a <= clipped * a
            value = -(capped * a if take_unclipped else clipped * a)
            if take_unclipped:
                d = -a * r if delta is None or r < delta else 0.0
            else:
                d = -a * r if 1 - eps_low < r < 1 + eps_high else 0.0
            m = keep[b][t]
            row_l.append(value if m else 0.0)
            row_g.append(d if m else 0.0)
            row_lo.append(bool(m and capped < 1 - eps_low and a < 0))
            row_hi.append(bool(m and capped > 1 + eps_high and a > 0))
        loss.append(row_l)
        grad.append(row_g)
        low.append(row_lo)
        high.append(row_hi)
    return loss, grad, low, high


@pytest.mark.parametrize(("eps_high", "delta", "per_token_adv"), [(0.2, None, False), (0.28, 1.5, False),
                                                                   (0.28, None, True)])
def test_clipped_surrogate_matches_hand_computation(eps_high, delta, per_token_adv) -> None:
    g = torch.Generator().manual_seed(12)
    lp, keep = random_batch(rows=6, cols=5, seed=13)
    lp = -lp.abs()
    old = lp + torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(6, 5, generator=g, dtype=torch.float64) if per_token_adv else torch.randn(6, generator=g,
                                                                                                 dtype=torch.float64)
    adv_rows = adv.tolist() if per_token_adv else [[a] * 5 for a in adv.tolist()]
    lp = lp.requires_grad_(True)
    out = clipped_surrogate(lp, old, adv, keep, epsilon_low=0.2, epsilon_high=eps_high, delta=delta)
    out.loss.sum().backward()
    loss, grad, low, high = hand_surrogate(lp.tolist(), old.tolist(), adv_rows, keep.tolist(), 0.2, eps_high, delta)
    assert out.loss.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in loss]
    assert lp.grad.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in grad]
    assert out.is_low_clipped.tolist() == low
    assert out.is_high_clipped.tolist() == high
    assert out.is_region_clipped.tolist() == [[a or b for a, b in zip(x, y, strict=True)] for x, y in zip(low, high,
                                                                                                         strict=True)]
    assert any(any(row) for row in low) and any(any(row) for row in high)
    torch.testing.assert_close(out.ratio, torch.exp(lp - old))


def hand_weighted(kind, lp, old, adv, phi, eps_high, tau):
    """Per-token loss and d loss / d logp of the surrogates with no clip region, token by token: cispo
    -min(r, ε_high)·A·logp (the weight no gradient), sapo -σ(τ(r-1))·4/τ·A (τ by A's sign; its slope in logp
    is -4A·σ(1-σ)·r), vespo -φ·A·logp (φ one per completion, no gradient). SAPO's τ is a float32 number, as
    TRL's `torch.where` over two Python floats makes it (1.05 is 1.0499999523...), in a float64 loss too."""
    loss, grad = [], []
    for b in range(len(lp)):
        row_l, row_g = [], []
        for t in range(len(lp[b])):
            a, r = adv[b][t], math.exp(lp[b][t] - old[b][t])
            if kind == "cispo":
                w = min(r, eps_high)
                row_l.append(-w * a * lp[b][t])
                row_g.append(-w * a)
            elif kind == "sapo":
                temp = float(torch.tensor(tau[0] if a > 0 else tau[1], dtype=torch.float32))
                s = 1 / (1 + math.exp(-temp * (r - 1)))
                row_l.append(-s * 4 / temp * a)
                row_g.append(-4 * a * s * (1 - s) * r)
            else:
                row_l.append(-phi[b] * a * lp[b][t])
                row_g.append(-phi[b] * a)
        loss.append(row_l)
        grad.append(row_g)
    return loss, grad


@pytest.mark.parametrize("kind", ["cispo", "sapo", "vespo"])
def test_soft_surrogates_match_hand_computation(kind: str) -> None:
    """CISPO's, SAPO's and VESPO's per-token losses and gradients (TRL's `cispo`, `sapo`, `vespo`), 0 off the
    mask; only cispo flags tokens, those whose ratio passes its cap ε_high where A > 0."""
    g = torch.Generator().manual_seed(14)
    lp, keep = random_batch(rows=6, cols=5, seed=15)
    lp = -lp.abs()
    old = lp + torch.randn(6, 5, generator=g, dtype=torch.float64) * 0.4
    adv = torch.randn(6, 5, generator=g, dtype=torch.float64)
    phi = torch.rand(6, 1, generator=g, dtype=torch.float64) * 2
    lp = lp.requires_grad_(True)
    out = clipped_surrogate(lp, old, adv, keep, epsilon_high=1.1, cispo=kind == "cispo",
                            sapo=(1.0, 1.05) if kind == "sapo" else None, vespo=phi if kind == "vespo" else None)
    out.loss.sum().backward()
    loss, grad = hand_weighted(kind, lp.tolist(), old.tolist(), adv.tolist(), phi.flatten().tolist(), 1.1, (1.0, 1.05))
    mask = keep.tolist()
    loss = [[v if m else 0.0 for v, m in zip(row, k, strict=True)] for row, k in zip(loss, mask, strict=True)]
    grad = [[v if m else 0.0 for v, m in zip(row, k, strict=True)] for row, k in zip(grad, mask, strict=True)]
    assert out.loss.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in loss]
    assert lp.grad.tolist() == [pytest.approx(row, rel=1e-12, abs=1e-15) for row in grad]
    capped = (out.ratio > 1.1) & (adv > 0) & keep if kind == "cispo" else torch.zeros_like(keep)
    assert out.is_high_clipped.tolist() == capped.tolist() and out.is_region_clipped.tolist() == capped.tolist()
    assert not out.is_low_clipped.any() and (capped.any() or kind != "cispo")


def test_clipped_surrogate_rejects_bad_shapes() -> None:
    x = torch.zeros(2, 3)
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="advantages"):
        clipped_surrogate(x, x, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="old_logp"):
        clipped_surrogate(x, torch.zeros(2, 2), torch.zeros(2), mask)
    with pytest.raises(ValueError, match="epsilon"):
        clipped_surrogate(x, x, torch.zeros(2), mask, epsilon_low=-0.1)


def test_kl_estimators_match_schulmans_formulas() -> None:
    g = torch.Generator().manual_seed(14)
    lp = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(4, 5, generator=g, dtype=torch.float64) * 3
    flat = list(zip(lp.flatten().tolist(), ref.flatten().tolist(), strict=True))
    k1 = [a - b for a, b in flat]
    k2 = [0.5 * (b - a) ** 2 for a, b in flat]
    k3 = [math.exp(b - a) - (b - a) - 1 for a, b in flat]
    for kind, expected in (("k1", k1), ("k2", k2), ("k3", k3)):
        assert kl_estimate(lp, ref, kind).flatten().tolist() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    assert (kl_estimate(lp, ref, "k3") >= 0).all()
    with pytest.raises(ValueError, match="kind"):
        kl_estimate(lp, ref, "k4")


def test_k1_and_k3_average_to_the_exact_kl_over_samples_from_the_policy() -> None:
    """With many samples from π, the unbiased estimators k1 and k3 average to KL(π || π_ref)."""
    g = torch.Generator().manual_seed(15)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    exact = sum(a * math.log(a / b) for a, b in zip(p.tolist(), q.tolist(), strict=True))
    samples = torch.multinomial(p, 200_000, replacement=True, generator=g)
    lp, ref = p.log()[samples], q.log()[samples]
    assert kl_estimate(lp, ref, "k1").mean().item() == pytest.approx(exact, rel=0.02)
    assert kl_estimate(lp, ref, "k3").mean().item() == pytest.approx(exact, rel=0.02)


def test_tis_weight_is_the_capped_ratio_and_carries_no_gradient() -> None:
    g = torch.Generator().manual_seed(16)
    old = -torch.rand(3, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    sampling = old.detach() + torch.randn(3, 4, generator=g, dtype=torch.float64)
    w = tis_weight(old, sampling, cap=2.0)
    expected = [min(math.exp(a - b), 2.0) for a, b in zip(old.flatten().tolist(), sampling.flatten().tolist(),
                                                          strict=True)]
    assert w.flatten().tolist() == pytest.approx(expected, rel=1e-12)
    assert not w.requires_grad and (w == 2.0).any()
    with pytest.raises(ValueError, match="cap"):
        tis_weight(old, sampling, cap=0.0)
