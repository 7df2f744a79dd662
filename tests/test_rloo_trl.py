"""RLOO's advantage, loss and logged numbers against TRL 1.16's RLOOTrainer's own code, in float64.

TRL computes them inside trainer methods (`_generate_and_score_completions`: the KL in the reward, the
leave-one-out baseline, the normalisation and the reward metrics; `_compute_loss`: the clipped sequence
ratio and the clip ratios). Both are called unbound on a stand-in trainer whose generation, reward functions
and forwards return the tensors chosen here, so what runs is TRL's code line for line; pagedrl's pure pieces
(and the RLOO algorithm's own methods, on a stand-in) must give the same numbers. Plus the baseline and the
KL-in-reward by hand for one small group.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import trl.trainer.rloo_trainer as rloo_module
from test_losses_trl import _Accelerator, _metrics
from trl.trainer.rloo_trainer import RLOOTrainer

from pagedrl.train.algorithms.grpo import clip_extremes
from pagedrl.train.algorithms.rloo import RLOO
from pagedrl.train.distributed import DistInfo
from pagedrl.train.losses import rloo_surrogate
from pagedrl.train.metrics import MetricTotals
from pagedrl.train.rl.advantages import combine_rewards, rloo_advantages
from pagedrl.train.rl.config import RLOOConfig

G = 4
WEIGHTS = [1.0, 0.5]


def _batch(prompts: int = 3, seq_len: int = 6, seed: int = 0):
    """Completions of random lengths (1..seq_len), the policy's (before the update), the reference's and the
    updated policy's per-token log-probs, and two reward functions' scores with TRL's NaN cases: a completion
    no function scores, a group whose scored rewards agree, and a group with a single scorable completion."""
    g = torch.Generator().manual_seed(seed)
    rows = prompts * G
    lengths = torch.randint(1, seq_len + 1, (rows,), generator=g)
    mask = (torch.arange(seq_len)[None, :] < lengths[:, None]).long()
    old = -torch.rand(rows, seq_len, generator=g, dtype=torch.float64) * 2 * mask
    ref = (old + torch.randn(rows, seq_len, generator=g, dtype=torch.float64) * 0.3) * mask
    logp = (old + torch.randn(rows, seq_len, generator=g, dtype=torch.float64) * 0.15) * mask
    rewards = torch.rand(rows, 2, generator=g, dtype=torch.float64)
    rewards[1, 1] = float("nan")  # one function skips it: the other's score alone
    rewards[G:G * 2] = 0.5  # the second group's agree (its std 0 unless the KL penalty tells them apart)
    rewards[5] = float("nan")  # unscorable
    rewards[G * 2 + 1:G * 3] = float("nan")  # the last group: one scorable completion
    return mask, old, ref, logp, rewards


class _Gathers(_Accelerator):
    process_index = 0


def _trl_scored(monkeypatch, mask, old, ref, rewards, beta, normalize, clip, truncated, mask_truncated):
    """TRL's `_generate_and_score_completions` output and metrics for this batch, on one process; a
    completion not `truncated` ends with the EOS token (1)."""
    monkeypatch.setattr(rloo_module, "gather", lambda t: t)
    monkeypatch.setattr(rloo_module, "gather_object", lambda o: o)
    rows = mask.shape[0]
    model, ref_model = SimpleNamespace(training=True, is_gradient_checkpointing=False), object()
    completion_ids = [[7] * (int(n) - 1) + [7 if cut else 1] for n, cut in zip(mask.sum(1), truncated, strict=True)]
    trainer = SimpleNamespace(
        accelerator=_Gathers(), model=model, ref_model=ref_model, _tokenizer=SimpleNamespace(pad_token_id=0),
        pad_to_multiple_of=None, mask_truncated_completions=mask_truncated, eos_token_ids=[1],
        args=SimpleNamespace(per_device_train_batch_size=rows, gradient_checkpointing_kwargs=None), beta=beta,
        num_generations=G, reward_weights=torch.tensor(WEIGHTS, dtype=torch.float64), reward_clip_range=clip,
        normalize_advantages=normalize, reward_func_names=["a", "b"], _metrics=_metrics(),
        _logs={"prompt": [], "completion": [], "rewards": defaultdict(list), "advantages": [],
               "extra": defaultdict(list)}, _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False,
        _generate=lambda prompts: ([[3, 4]] * rows, completion_ids, ["x"] * rows),
        _get_per_token_logps_and_entropies=lambda m, *a, **k: (old if m is model else ref, None, None),
        _calculate_rewards=lambda *a: rewards.clone())
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # TRL's nanstd divides int counts: a tensor of the default dtype
    try:
        out = RLOOTrainer._generate_and_score_completions(trainer, [{"prompt": "p"}] * rows)
    finally:
        torch.set_default_dtype(default)
    return out, trainer._metrics["train"]


def _ours(mask, old, ref, rewards, beta, normalize, clip):
    """pagedrl's advantages, and the RLOO algorithm's KL and frac_reward_zero_std metrics on a stand-in."""
    config = RLOOConfig(beta=beta, normalize_advantages=normalize, reward_clip_range=clip, num_generations=G)
    batch = SimpleNamespace(old_logps=old, ref_logps=ref, mask=mask.bool(), completion_index=torch.arange(len(mask)))
    algo = SimpleNamespace(config=config, batches=[batch], rollout=[None] * len(mask), dist=DistInfo())
    kls = RLOO.sequence_kls(algo)  # type: ignore[arg-type]
    totals = combine_rewards(rewards, WEIGHTS)
    advantages, penalised = rloo_advantages(totals, G, kls, beta, clip, normalize)
    algo.rollout = SimpleNamespace(num_generations=G, num_prompts=len(mask) // G)
    algo.penalised_rewards, algo.rollout_metrics = penalised, dict
    return advantages, RLOO.step_metrics(algo, 1)  # type: ignore[arg-type]


@pytest.mark.parametrize(("beta", "normalize", "clip", "cut"), [
    (0.05, False, None, None), (0.2, True, None, None), (0.0, False, None, None), (0.1, True, [0.2, 0.7], None),
    (0.1, False, None, "some"), (0.05, True, None, "all")])
def test_advantages_and_rollout_metrics_equal_trls(monkeypatch, beta, normalize, clip, cut) -> None:
    """`cut`: mask_truncated_completions, with every third completion cut by the length limit ("some") or
    every one ("all": no token left, where TRL logs a KL of 0)."""
    mask, old, ref, _, rewards = _batch(seed=int(beta * 100))
    rows = torch.arange(mask.shape[0])
    truncated = rows % 3 == 0 if cut == "some" else torch.full_like(rows, cut == "all", dtype=torch.bool)
    out, metrics = _trl_scored(monkeypatch, mask, old, ref, rewards, beta, normalize, clip, truncated, cut is not None)
    kept = mask * ~truncated[:, None] if cut else mask  # what `pack` leaves of a cut completion's mask
    advantages, ours = _ours(kept, old, ref, rewards, beta, normalize, clip)
    torch.testing.assert_close(advantages, out["advantages"], rtol=0, atol=1e-10)
    assert advantages[5] == 0 and advantages[G * 2] == 0  # unscorable; no scored sibling
    assert (advantages[:G] != 0).all()
    frac = ours["frac_reward_zero_std"].total / ours["frac_reward_zero_std"].weight
    # TRL's: the agreeing group without a KL penalty (none, or none left unmasked); never the group of one scored
    # reward (its nanstd is NaN) (TRL takes that share's mean in float32: 1/3 to 1e-8)
    penalty = beta and cut != "all"
    assert frac == pytest.approx(metrics["frac_reward_zero_std"][0], abs=3e-8) and frac == (0 if penalty else 1 / 3)
    if beta:
        assert float(ours["kl"].total / ours["kl"].weight) == pytest.approx(metrics["kl"][0], rel=1e-10)
        assert metrics["kl"][0] == 0 if cut == "all" else abs(metrics["kl"][0]) > 1e-3
    else:
        assert "kl" not in ours and "kl" not in metrics


def test_loss_gradient_and_clip_ratios_equal_trls() -> None:
    mask, old, _, logp, _ = _batch(prompts=4, seed=3)
    mask[2] = 0  # an empty completion: ratio 1, its loss -A, no gradient
    rows = mask.shape[0]
    advantages = torch.randn(rows, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    theirs = logp.clone().requires_grad_(True)
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False,
        epsilon_low=0.2, epsilon_high=0.28, _metrics=_metrics(),
        _get_per_token_logps_and_entropies=lambda *a, **k: (theirs, torch.ones_like(theirs), None))
    inputs = {"prompt_ids": torch.ones(rows, 2, dtype=torch.long), "prompt_mask": torch.ones(rows, 2, dtype=torch.long),
              "completion_ids": torch.ones_like(mask), "completion_mask": mask,
              "old_logps": (old * mask).sum(1), "advantages": advantages}
    trl_loss = RLOOTrainer._compute_loss(trainer, None, inputs)
    (trl_grad,) = torch.autograd.grad(trl_loss, theirs)
    ours = logp.clone().requires_grad_(True)
    out = rloo_surrogate(ours, old, advantages, mask.bool(), 0.2, 0.28)
    loss = out.loss.sum() / rows
    (grad,) = torch.autograd.grad(loss, ours)
    torch.testing.assert_close(loss.detach(), trl_loss.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, trl_grad, rtol=0, atol=1e-12)
    assert grad.abs().max() > 0 and grad[2].abs().max() == 0
    logged = trainer._metrics["train"]
    assert 0 < out.is_region_clipped.sum() < rows - 1  # some clipped, some not
    for name, flags in (("low", out.is_low_clipped), ("high", out.is_high_clipped), ("region", out.is_region_clipped)):
        assert flags.double().mean().item() == pytest.approx(logged[f"clip_ratio/{name}_mean"][0], abs=1e-15)
    assert out.is_low_clipped.double().min().item() == logged["clip_ratio/low_min"][0]
    assert out.is_high_clipped.double().max().item() == logged["clip_ratio/high_max"][0]


def test_clip_extremes_are_trls_means_over_micro_batches() -> None:
    """TRL appends each micro-batch's min (max) clip flag and logs their mean: two micro-batches, one with
    both completions low-clipped and one with one of them, log a `low_min` of 0.5 (the step's min is 0)."""
    mask, old = torch.ones(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.float64)
    logp = torch.full((2, 3), -0.2, dtype=torch.float64)  # ratio exp(-0.6): low-clipped where A < 0
    trainer = SimpleNamespace(model=SimpleNamespace(training=True), accelerator=_Accelerator(), aux_loss_enabled=False,
                              epsilon_low=0.2, epsilon_high=0.2, _metrics=_metrics(),
                              _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.ones_like(logp), None))
    totals = MetricTotals()
    for advantages in ([-1.0, -1.0], [-1.0, 1.0]):
        adv = torch.tensor(advantages, dtype=torch.float64)
        RLOOTrainer._compute_loss(trainer, None, {
            "prompt_ids": torch.ones(2, 1, dtype=torch.long), "prompt_mask": torch.ones(2, 1, dtype=torch.long),
            "completion_ids": mask, "completion_mask": mask, "old_logps": old.sum(1), "advantages": adv})
        out = rloo_surrogate(logp, old, adv, mask.bool())
        for name, metric in clip_extremes(out.is_low_clipped, out.is_high_clipped, mask.bool()).items():
            totals.add(name, metric)
    ours, logged = totals.all_reduce(DistInfo()).values(), trainer._metrics["train"]
    for name in ("clip_ratio/low_min", "clip_ratio/high_max"):
        assert ours[name] == statistics.fmean(logged[name]), name
    assert ours["clip_ratio/low_min"] == 0.5


def test_leave_one_out_baseline_and_kl_in_reward_by_hand() -> None:
    """One group of three: r_i - beta·KL_i, less the mean of the other two's; with a NaN reward, the other
    two are each other's baseline; normalised: (A - mean) / (stdev + 1e-4) over the batch."""
    r, kl, beta = [1.0, 0.0, 0.5], [0.3, -0.2, 1.1], 0.1
    p = [ri - beta * ki for ri, ki in zip(r, kl, strict=True)]
    expected = [p[0] - (p[1] + p[2]) / 2, p[1] - (p[0] + p[2]) / 2, p[2] - (p[0] + p[1]) / 2]
    t = torch.tensor
    got, penalised = rloo_advantages(t(r, dtype=torch.float64), 3, t(kl, dtype=torch.float64), beta)
    assert got.tolist() == pytest.approx(expected, abs=1e-15) and penalised.tolist() == pytest.approx(p, abs=1e-15)
    got, _ = rloo_advantages(t([1.0, float("nan"), 0.5], dtype=torch.float64), 3, t(kl, dtype=torch.float64), beta)
    assert got.tolist() == pytest.approx([p[0] - p[2], 0.0, p[2] - p[0]], abs=1e-15)
    got, _ = rloo_advantages(t(r, dtype=torch.float64), 3, t(kl, dtype=torch.float64), beta, normalize=True)
    mean, std = statistics.fmean(expected), statistics.stdev(expected)
    assert got.tolist() == pytest.approx([(a - mean) / (std + 1e-4) for a in expected], abs=1e-15)
    with pytest.raises(ValueError, match="num_generations: the leave-one-out baseline needs >= 2"):
        rloo_advantages(t(r), 1)
