"""DPO's loss types beyond the pair losses of tests/test_losses_trl.py, each held to TRL 1.16's
DPOTrainer._compute_loss on the same float64 batch (loss, gradient, reward metrics): EXO, AOT, DiscoPOP,
the length-normalised sigmoid, the chosen answers' NLL (`sft`), and TRL's weighted lists of several losses
(MPO's recipe among them); then the settings each takes, refused with the key where they do not fit."""

from __future__ import annotations

import pytest
import torch
from test_losses_trl import _dpo_batch, _trl_dpo, assert_dpo_equals_trl

from pagedrl.train.config import TrainConfigError, load_config
from pagedrl.train.dpo_losses import DPO_LOSS_TYPES, dpo_loss, trl_differences, trl_warnings
from pagedrl.train.offline_config import DPOConfig


@pytest.mark.parametrize(("loss_type", "extra"), [
    ("exo_pair", dict(label_smoothing=1e-3)),  # the EXO paper's ε
    ("exo_pair", dict(label_smoothing=0.3)),
    ("exo_pair", dict(label_smoothing=0.7)),  # TRL takes any ε in (0, 1)
    ("exo_pair", dict(label_smoothing=0.999)),
    ("robust", dict(label_smoothing=0.6)),  # TRL warns outside [0, 0.5) and trains as given
    ("robust", dict(label_smoothing=-0.2)),
    ("robust", dict(label_smoothing=1.5)),
    ("aot", {}),
    ("aot", dict(label_smoothing=0.1)),
    ("aot_unpaired", {}),
    ("aot_unpaired", dict(label_smoothing=0.25)),
    ("aot", dict(label_smoothing=0.8)),  # TRL takes any ε for aot, without a word
    ("aot_unpaired", dict(label_smoothing=-0.3)),
    ("discopop", {}),  # TRL's τ, 0.05
    ("discopop", dict(discopop_tau=0.4)),
    ("sigmoid_norm", {}),
    ("sft", {}),
])
@pytest.mark.parametrize("beta", [0.1, 0.7])
def test_dpo_loss_type_equals_trl_dpo_trainer(loss_type: str, extra: dict, beta: float) -> None:
    assert_dpo_equals_trl(dict(loss_type=loss_type, beta=beta, **extra), seed=int(beta * 10) + 1)


@pytest.mark.parametrize("settings", [
    dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),  # MPO
    dict(loss_type=["sigmoid", "sft"]),  # RPO's NLL term at weight 1 (TRL's default weights)
    dict(loss_type=["exo_pair", "aot", "discopop", "sigmoid_norm"], loss_weights=[0.5, 2.0, 0.25, 1.5],
         label_smoothing=0.05, discopop_tau=0.2),
    dict(loss_type=[t for t in DPO_LOSS_TYPES if t != "sigmoid"], label_smoothing=0.2,
         loss_weights=[0.1 * (k + 1) for k in range(len(DPO_LOSS_TYPES) - 1)]),  # every other loss at once
    dict(loss_type=["hinge", "hinge"], loss_weights=[0.25, 0.5]),  # a name twice counts twice, as in TRL
    dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, -0.5]),  # negative weights, as TRL takes them
    dict(loss_type=["exo_pair", "robust", "bco_pair"], loss_weights=[-1.0, 0.5, -0.25], label_smoothing=0.8),
])
def test_weighted_loss_lists_equal_trl_dpo_trainer(settings: dict) -> None:
    """TRL's loss is Σ_k w_k · mean over pairs of loss_k; ours sums each pair's weighted terms, whose mean
    is the same."""
    assert_dpo_equals_trl(dict(beta=0.3, **settings), seed=7)


def test_sft_is_the_chosen_answers_token_mean_and_aot_sorts_the_micro_batch() -> None:
    """The two terms that see the whole micro-batch, by hand: sft's NLL is one number on every pair
    (Σ -log p over the chosen tokens / their count, an empty answer's count taken as it is), and aot's i-th
    pair compares the i-th smallest policy margin with the i-th smallest reference one."""
    pc = torch.tensor([-4.0, -9.0, -1.0], dtype=torch.float64, requires_grad=True)
    pr, rc, rr = (torch.tensor(v, dtype=torch.float64) for v in ([-5.0, -3.0, -2.0], [-4.5, -8.0, -1.5],
                                                                   [-4.0, -3.5, -1.0]))
    lengths = torch.tensor([2, 6, 0])
    sft = dpo_loss(pc, pr, rc, rr, loss_type="sft", chosen_lengths=lengths, rejected_lengths=lengths).losses
    assert sft.tolist() == pytest.approx([14.0 / 8] * 3, rel=1e-15)
    (grad,) = torch.autograd.grad(sft.mean(), pc)
    assert grad.tolist() == pytest.approx([-1.0 / 8] * 3, rel=1e-15)  # every chosen token's NLL weighs 1/8
    beta = 0.5
    aot = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="aot").losses
    policy = sorted([1.0, -6.0, 1.0])  # π_c - π_r per pair
    ref = sorted([-0.5, -4.5, -0.5])
    expected = [-torch.nn.functional.logsigmoid(torch.tensor(beta * (p - r), dtype=torch.float64)).item()
                for p, r in zip(policy, ref, strict=True)]
    assert aot.tolist() == pytest.approx(expected, rel=1e-15)


@pytest.mark.parametrize(("fields", "key", "says"), [
    (dict(loss_type="exo_pair"), "label_smoothing", r"exo_pair loss needs label_smoothing in \(0, 1\).*refuses 0"),
    (dict(loss_type="exo_pair", label_smoothing=1.0), "label_smoothing", r"in \(0, 1\), got 1.0 \(EXO takes log"),
    (dict(loss_type="exo_pair", label_smoothing=-0.1), "label_smoothing", r"in \(0, 1\), got -0.1"),
    (dict(loss_type="robust", label_smoothing=0.5), "label_smoothing", r"divides by 1 - 2·label_smoothing"),
    (dict(loss_type="robust", label_smoothing=float("nan")), "label_smoothing", "must be finite"),
    (dict(loss_type="sigmoid", label_smoothing=0.6), "label_smoothing", r"sigmoid loss needs label_smoothing in "
                                                                         r"\[0, 0.5\]"),
    (dict(loss_type="aot", label_smoothing=float("inf")), "label_smoothing", "must be finite"),
    (dict(loss_type=["hinge", "bco_pair"], label_smoothing=0.1), "label_smoothing", "hinge\\+bco_pair loss does not"),
    (dict(loss_type=["sigmoid", "robust"], label_smoothing=0.1), "label_smoothing", "TRL 1.16's sigmoid ignores"),
    (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]), "loss_weights", "1 weights for 2 loss types"),
    (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, float("inf")]), "loss_weights", "must be finite"),
    (dict(loss_type=["sigmoid", "sft"], loss_weights=[float("nan"), 1.0]), "loss_weights", "must be finite"),
    (dict(loss_type=[]), "loss_type", "empty"),
    (dict(loss_type="sigmoid", discopop_tau=0.1), "discopop_tau", "only the discopop loss uses it"),
    (dict(loss_type="discopop", discopop_tau=0.0), "discopop_tau", "must be > 0"),
])
def test_dpo_settings_that_do_not_fit_are_refused_naming_the_key(fields: dict, key: str, says: str) -> None:
    with pytest.raises(TrainConfigError, match=rf"^{key}: .*{says}"):
        DPOConfig(**fields)
    x = torch.zeros(2)
    with pytest.raises(ValueError, match=rf"^{key}: .*{says}"):  # the loss itself checks the same way
        dpo_loss(x, x, x, x, loss_type=fields["loss_type"], label_smoothing=fields.get("label_smoothing", 0.0),
                 loss_weights=fields.get("loss_weights"), discopop_tau=fields.get("discopop_tau", 0.05),
                 chosen_lengths=x, rejected_lengths=x)


def test_a_loss_list_reads_from_yaml_and_the_command_line(tmp_path) -> None:
    """TRL's spelling of a list of losses, as pagedrl's other list fields take one: a YAML list, or
    `key=[a, b]` on the command line; a one-element list is that loss."""
    path = tmp_path / "mpo.yaml"
    path.write_text("loss_type:\n  - sigmoid\n  - bco_pair\n  - sft\nloss_weights: [0.8, 0.2, 1]\n")
    config = load_config(DPOConfig, path)
    assert (config.loss_type, config.loss_weights) == (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0])
    config = load_config(DPOConfig, None, ["loss_type=[exo_pair, discopop]", "label_smoothing=1e-3",
                                           "discopop_tau=0.1"])
    assert (config.loss_type, config.label_smoothing, config.discopop_tau) == (["exo_pair", "discopop"], 1e-3, 0.1)
    assert load_config(DPOConfig, None, ["loss_type=[aot_unpaired]"]).loss_type == "aot_unpaired"
    with pytest.raises(ValueError, match=r"loss_type: expected one of 'sigmoid', .* 'sigmoid_norm', or a list of "
                                         r"them, got \['sigmoid', 'kto'\]$"):
        load_config(DPOConfig, None, ["loss_type=[sigmoid, kto]"])


def test_sigmoid_with_label_smoothing_says_it_is_not_trl_s_loss() -> None:
    """TRL 1.16 takes label_smoothing beside sigmoid and ignores it; here it is conservative DPO, so a start-up
    line says the loss differs from TRL's. The losses that read it as TRL does (robust, exo_pair, aot) say
    nothing."""
    for loss_type in ("sigmoid", ["sigmoid", "bco_pair"]):
        (line,) = trl_differences(loss_type, 0.1)
        assert line.startswith("sigmoid with label_smoothing 0.1 trains conservative DPO") and "ignores" in line
    assert trl_differences("sigmoid", 0.0) == []
    for loss_type in ("robust", "exo_pair", "aot", "aot_unpaired"):
        assert trl_differences(loss_type, 0.1) == []


@pytest.mark.parametrize(("loss_type", "label_smoothing"), [("exo_pair", 1.0), ("exo_pair", 1.5), ("exo_pair", -0.1),
                                                           ("robust", 0.5)])
def test_the_smoothing_refused_is_where_trl_s_loss_is_not_finite(loss_type: str, label_smoothing: float) -> None:
    """The values TRL 1.16 takes but pagedrl refuses: TRL's loss or gradient there is infinite or NaN."""
    mask, token_logps, ref_logps = _dpo_batch(seed=3)
    loss, grad, _ = _trl_dpo(loss_type, 0.1, label_smoothing, mask, token_logps, ref_logps)
    assert not (torch.isfinite(loss) and torch.isfinite(grad).all())


def test_robust_smoothing_outside_its_range_warns_as_trl_does() -> None:
    """TRL 1.16 warns when robust's label_smoothing lies outside [0, 0.5) and trains with it: a start-up line
    says it here, only then."""
    for ls in (0.5 + 1e-9, 0.6, 1.5, -0.1):
        (line,) = trl_warnings(["sigmoid_norm", "robust"], ls)
        assert line.startswith("label_smoothing should lie in [0, 0.5) for the robust loss") and f"{ls:g}" in line
        DPOConfig(loss_type="robust", label_smoothing=ls)  # taken
    for ls in (0.0, 0.2, 0.5 - 1e-9):
        assert trl_warnings("robust", ls) == []
    assert trl_warnings("exo_pair", 0.7) == [] and trl_warnings("aot", 0.3) == []
