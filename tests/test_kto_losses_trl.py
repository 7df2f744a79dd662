"""KTO's loss, KL reference point and metrics against TRL 1.16's own `KTOTrainer._compute_loss`, fed the same
per-sequence log-probs in float64 (a stand-in model returns them, precomputed reference log-probs carry the
reference's), and against a float64 hand computation."""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from pagedrl.train.kto_losses import kl_estimate, kto_loss, kto_metrics
from pagedrl.train.metrics import MetricTotals

# Read from the forward's per-token outputs, not the sequence log-probs: the first-batch test compares them.
TOKEN_METRICS = ("entropy", "num_tokens", "logits/chosen", "logits/rejected")
BATCHES = {  # labels of one micro-batch
    "mixed": [True, False, True, True, False],
    "all desirable": [True, True, True],
    "all undesirable": [False, False, False, False],
}


class SequenceLogps:
    """A model whose forward returns given summed log-probs: the first scored position holds each row's sum.
    The main rows are 3 tokens wide and the KL rows 4, which tells the two calls apart."""

    training = True

    def __init__(self, main: torch.Tensor, kl: torch.Tensor, per_token: torch.Tensor | None = None) -> None:
        """`per_token`: each row's mean logit and entropy at both of its completion tokens (default 0)."""
        self.main, self.kl = main, kl
        self.per_token = torch.zeros_like(main) if per_token is None else per_token

    def __call__(self, input_ids: torch.Tensor, **_: object) -> SimpleNamespace:
        sums = self.kl if input_ids.shape[1] == 4 else self.main
        per_token = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1, dtype=torch.float64)
        per_token[:, 0] = sums
        each = torch.zeros_like(per_token) if input_ids.shape[1] == 4 else self.per_token[:, None].expand(-1, 2)
        return SimpleNamespace(log_probs=per_token, entropy=each, mean_logits=each)


def trl_trainer(**settings):
    """TRL's KTOTrainer with the loss's and `log()`'s own attributes only: no model, data or Accelerate."""
    from trl.trainer.kto_trainer import KTOTrainer

    trainer = KTOTrainer.__new__(KTOTrainer)
    accelerator = SimpleNamespace(device=torch.device("cpu"), gather_for_metrics=lambda x: x)
    trainer.__dict__.update(accelerator=accelerator, precompute_ref_logps=True,
                            calculate_KL=settings["loss_type"] != "apo_zero_unpaired", aux_loss_enabled=False,
                            _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
                            _tp_size=1, state=SimpleNamespace(epoch=None, global_step=1, log_history=[]),
                            args=SimpleNamespace(include_num_input_tokens_seen="no"), control=None,
                            callback_handler=SimpleNamespace(on_log=lambda *_: None), **settings)
    return trainer


def trl_loss(policy, ref, policy_kl, ref_kl, labels, trainer=None, per_token=None,
             **settings) -> tuple[float, dict[str, float]]:
    """TRL's loss and metrics of one micro-batch (appended to `trainer`'s metrics, if given)."""
    trainer = trainer or trl_trainer(**settings)
    trainer.model = SequenceLogps(policy, policy_kl, per_token)
    n = len(labels)
    batch = {"input_ids": torch.zeros(n, 3, dtype=torch.long), "attention_mask": torch.ones(n, 3, dtype=torch.long),
             "completion_mask": torch.tensor([[0, 1, 1]] * n), "KL_input_ids": torch.zeros(n, 4, dtype=torch.long),
             "KL_attention_mask": torch.ones(n, 4, dtype=torch.long), "KL_completion_mask": torch.tensor([[0, 1, 1, 1]] * n),
             "label": torch.tensor(labels), "ref_logps": ref, "ref_KL_logps": ref_kl}
    loss = trainer._compute_loss(trainer.model, batch, return_outputs=False)
    return float(loss), {k: v[-1] for k, v in trainer._metrics["train"].items() if k not in TOKEN_METRICS}


def ours(policy, ref, policy_kl, ref_kl, labels, loss_type, beta, desirable_weight, undesirable_weight):
    desirable = torch.tensor(labels)
    kl = kl_estimate(policy_kl, ref_kl) if loss_type == "kto" else torch.zeros((), dtype=torch.float64)
    out = kto_loss(policy, ref, desirable, kl, beta, loss_type, desirable_weight, undesirable_weight)
    totals = MetricTotals()
    for name, metric in kto_metrics(out, policy, desirable, kl).items():
        totals.add(name, metric)
    return float(out.losses.sum() / len(labels)), totals.values()


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.5)])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kl_sign", [1.0, -1.0])  # -1: the estimate is negative, clamped to 0
def test_equals_trl(loss_type, weights, batch, kl_sign) -> None:
    labels = BATCHES[batch]
    g = torch.Generator().manual_seed(len(labels) + int(10 * weights[0]))
    n = len(labels)
    policy, ref = -20 * torch.rand(n, generator=g, dtype=torch.float64), -20 * torch.rand(n, generator=g,
                                                                                          dtype=torch.float64)
    ref_kl = -20 * torch.rand(n, generator=g, dtype=torch.float64)
    policy_kl = ref_kl + kl_sign * (0.5 + torch.rand(n, generator=g, dtype=torch.float64))
    settings = dict(loss_type=loss_type, beta=0.3, desirable_weight=weights[0], undesirable_weight=weights[1])
    trl, trl_metrics = trl_loss(policy, ref, policy_kl, ref_kl, labels, **settings)
    loss, metrics = ours(policy, ref, policy_kl, ref_kl, labels, **settings)
    assert loss == pytest.approx(trl, abs=1e-10, rel=0)
    assert set(metrics) == set(trl_metrics)
    for name, value in trl_metrics.items():
        assert metrics[name] == pytest.approx(value, abs=1e-10, rel=0), name


def test_logged_window_averages_micro_batch_means_as_trl() -> None:
    """Three micro-batches of uneven labels (1 and 1, 3 and 0, 1 and 3 desirable and undesirable rows) logged as
    one window: TRL's `log()` averages the means it appended per micro-batch, each counting 1 however many rows
    or tokens it had, and a side a micro-batch lacks adds nothing (the second's undesirable side, its margin)."""
    settings = dict(loss_type="kto", beta=0.3, desirable_weight=1.0, undesirable_weight=1.0)
    trainer, totals, chosen = trl_trainer(**settings), MetricTotals(), []
    g = torch.Generator().manual_seed(7)
    for labels in ([True, False], [True, True, True], [True, False, False, False]):
        n = len(labels)
        policy, ref, ref_kl, per_token = (-20 * torch.rand(n, generator=g, dtype=torch.float64) for _ in range(4))
        policy_kl = ref_kl + 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
        trl_loss(policy, ref, policy_kl, ref_kl, labels, trainer, per_token, **settings)
        desirable = torch.tensor(labels)
        kl = kl_estimate(policy_kl, ref_kl)
        out = kto_loss(policy, ref, desirable, kl, **settings)
        chosen.append(float(out.rewards[desirable].sum()))
        more = {f"logits/{side}": (2 * per_token[mask].sum(), 2 * mask.sum())
                for side, mask in (("chosen", desirable), ("rejected", ~desirable))}  # 2 completion tokens a row
        more["entropy"] = (2 * per_token.sum(), torch.tensor(2 * n))
        for name, metric in kto_metrics(out, policy, desirable, kl, more).items():
            totals.add(name, metric)
    trainer.log({})
    logged = {k: v for k, v in trainer.state.log_history[-1].items() if k not in ("step", "num_tokens")}
    ours = totals.values()
    assert set(ours) == set(logged)
    for name, value in logged.items():
        assert ours[name] == pytest.approx(value, abs=1e-10, rel=0), name
    pooled = sum(chosen) / 5  # the 5 desirable rows' mean: another number, so the check can fail
    assert abs(pooled - logged["rewards/chosen"]) > 1e-3


def test_hand_computed() -> None:
    """Two desirable and one undesirable completion, β = 0.5, weights 2 and 0.5, in plain float64 arithmetic."""
    policy, ref = [-3.0, -5.0, -2.0], [-4.0, -4.5, -3.0]
    policy_kl, ref_kl = [-6.0, -7.0, -5.0], [-6.5, -6.0, -6.0]
    labels, beta = [True, True, False], 0.5
    z = max(0.0, sum(p - r for p, r in zip(policy_kl, ref_kl, strict=True)) / 3)  # (0.5 - 1 + 1) / 3
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    r = [p - q for p, q in zip(policy, ref, strict=True)]  # 1, -0.5, 1
    expected = [2 * (1 - sig(beta * (r[0] - z))), 2 * (1 - sig(beta * (r[1] - z))), 0.5 * (1 - sig(beta * (z - r[2])))]
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    kl = kl_estimate(t(policy_kl), t(ref_kl))
    assert float(kl) == pytest.approx(z, abs=1e-15)
    out = kto_loss(t(policy), t(ref), torch.tensor(labels), kl, beta, "kto", 2.0, 0.5)
    assert out.losses.tolist() == pytest.approx(expected, abs=1e-15)
    assert out.rewards.tolist() == pytest.approx([0.5, -0.25, 0.5], abs=1e-15)
    apo = kto_loss(t(policy), t(ref), torch.tensor(labels), kl, beta, "apo_zero_unpaired", 2.0, 0.5)
    assert apo.losses.tolist() == pytest.approx([2 * (1 - sig(0.5)), 2 * (1 - sig(-0.25)), 0.5 * sig(0.5)], abs=1e-15)


def test_refuses_bad_settings() -> None:
    x = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="loss_type: unknown KTO loss 'sigmoid'"):
        kto_loss(x, x, torch.tensor([True, False]), 0.0, loss_type="sigmoid")
    with pytest.raises(ValueError, match="beta: must be positive"):
        kto_loss(x, x, torch.tensor([True, False]), 0.0, beta=0.0)
