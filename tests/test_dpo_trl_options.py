"""TRL 1.16 DPOConfig options beyond the loss type, each held to TRL's own DPOTrainer code on the same
batch: f-DPO's `f_divergence_type` (loss, gradient and reward metrics to 1e-12 in float64; alpha_divergence,
whose TRL code runs in float32 only, in float32), LD-DPO's `ld_alpha` (pagedrl's packed pair rows summed as
the trainer sums them, against TRL's two padded rows, the reference's sums by TRL's code too), WPO's
`use_weighting` (the weights from the same per-token numbers, log Σ_v p_v² against TRL's kernel), TR-DPO's
`sync_ref_model` (the reference mixed as TRL's SyncRefModelCallback mixes it), and the settings refused, naming the key, where they do not fit."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from float_bounds import U, gamma
from test_losses_trl import _dpo_batch, _ours_dpo, _trl_dpo

from pagedrl.train.algorithms.dpo import answer_sums, scored_tokens, wpo_weights
from pagedrl.train.algorithms.pair_batch import collate_pairs
from pagedrl.train.config import TrainConfigError, load_config
from pagedrl.train.dpo_losses import dpo_loss
from pagedrl.train.examples import Preference
from pagedrl.train.offline_config import DPOConfig, RewardConfig


def assert_options_equal_trl(settings: dict, options: dict, seed: int, dtype=torch.float64, tol: float = 1e-12) -> None:
    """pagedrl's DPO loss with `options` (TRL's trainer attributes, pagedrl's `dpo_loss` arguments of the same
    names) against TRL's `_compute_loss`: loss, gradient in the per-token log-probs, reward metrics."""
    completion_mask, token_logps, ref_logps = _dpo_batch(seed=seed)
    token_logps, ref_logps = token_logps.to(dtype), ref_logps.to(dtype)
    trl_loss, trl_grad, metrics = _trl_dpo(settings["loss_type"], settings["beta"],
                                           settings.get("label_smoothing", 0.0), completion_mask, token_logps,
                                           ref_logps, settings.get("loss_weights"), dtype=dtype, **options)
    loss, grad, out = _ours_dpo(completion_mask, token_logps, ref_logps, **settings, **options)
    torch.testing.assert_close(loss, trl_loss, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, trl_grad * completion_mask[:, 1:], rtol=tol, atol=tol)
    for name, ours in (("rewards/chosen", out.chosen_rewards.mean()), ("rewards/rejected", out.rejected_rewards.mean()),
                       ("rewards/margins", (out.chosen_rewards - out.rejected_rewards).mean())):
        assert metrics[name][0] == pytest.approx(ours.item(), rel=tol, abs=tol), name


@pytest.mark.parametrize("f_divergence_type", ["forward_kl", "js_divergence"])
@pytest.mark.parametrize(("loss_type", "extra"), [
    ("sigmoid", {}), ("hinge", {}), ("ipo", {}), ("sigmoid_norm", {}), ("robust", dict(label_smoothing=0.2)),
    ("exo_pair", dict(label_smoothing=1e-3)), ("discopop", {}), ("sft", {}),
    (["sigmoid", "sft"], dict(loss_weights=[1.0, 0.5])),
])
def test_f_divergence_equals_trl_dpo_trainer(f_divergence_type: str, loss_type, extra: dict) -> None:
    """f-DPO: each answer's f'(π/π_ref) in place of its log-ratio, for every loss TRL allows it with."""
    assert_options_equal_trl(dict(loss_type=loss_type, beta=0.3, **extra),
                             dict(f_divergence_type=f_divergence_type), seed=11)


def test_alpha_divergence_at_one_is_reverse_kl_as_in_trl() -> None:
    """α within 1e-6 of 1, the limit where (t^(α-1) - 1)/(α-1) → log t: DPO's own log-ratios (float64, TRL takes
    this branch before its float32-only clamp)."""
    options = dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=1.0 + 1e-7)
    assert_options_equal_trl(dict(loss_type="sigmoid", beta=0.2), options, seed=12)


@pytest.mark.parametrize(("loss_type", "alpha"), [("sigmoid", 0.5), ("ipo", 0.3), ("hinge", -40.0),
                                                  ("discopop", 1.5)])
def test_alpha_divergence_equals_trl_dpo_trainer_in_float32(loss_type: str, alpha: float) -> None:
    """TRL's alpha_divergence clamps the exponent by dtype and knows float16, bfloat16 and float32 only (a
    float64 batch is a KeyError there), so both run in float32, the trainer's loss precision: the same
    operations in the same order, within a few dozen roundings. α = -40 puts exponents past the clamp at 80."""
    options = dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=alpha)
    assert_options_equal_trl(dict(loss_type=loss_type, beta=0.25), options, seed=13, dtype=torch.float32,
                             tol=gamma(64))
    if alpha == -40.0:
        _, token_logps, ref_logps = _dpo_batch(seed=13)
        assert ((alpha - 1) * (token_logps.sum(1) - ref_logps)).max() > 80  # the clamp is exercised


def pairs_in_both_layouts(seed: int, num_pairs: int = 6):
    """Pairs with a shared prompt (one empty: its first answer token has no prediction, in TRL as here) and
    answers of 1 to 6 tokens (some pairs of equal lengths), as TRL's [chosen; rejected] padded rows (completion
    mask, per-token policy and reference log-probs of the shifted labels, 0 outside the answers) and as
    pagedrl's packed batch, whose answer tokens read the same numbers: answer a is TRL's row a, and a rejected
    token after the first sits the chosen answer's length further along than in TRL's row."""
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    pairs = []
    for b in range(num_pairs):
        n_chosen = rng.randint(1, 6)
        n_rejected = n_chosen if b % 3 == 0 else rng.randint(1, 6)
        pairs.append(Preference([5] * (0 if b == 1 else rng.randint(1, 3)), [6] * n_chosen, [7] * n_rejected, ""))
    rows = [(p.prompt_ids, p.chosen_ids) for p in pairs] + [(p.prompt_ids, p.rejected_ids) for p in pairs]
    width = max(len(q) + len(a) for q, a in rows)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for r, (q, a) in enumerate(rows):
        mask[r, len(q):len(q) + len(a)] = 1
    shift = mask[:, 1:].double()
    policy = -torch.rand(shift.shape, generator=g, dtype=torch.float64) * 3 * shift
    reference = -torch.rand(shift.shape, generator=g, dtype=torch.float64) * 3 * shift
    batch = collate_pairs(pairs, 0, torch.device("cpu"), answer_tokens=True)
    ours_width = batch.input_ids.shape[1]
    a = batch.answer_of
    b = a % num_pairs
    column = batch.predict_at - b * ours_width
    prompt, chosen = (torch.tensor([len(getattr(p, k)) for p in pairs])[b] for k in ("prompt_ids", "chosen_ids"))
    column -= ((a >= num_pairs) & (column >= prompt)) * chosen  # all but the one the prompt's last token predicts
    return pairs, batch, mask, policy, reference, (a, column)


@pytest.mark.parametrize(("loss_type", "ld_alpha"), [("sigmoid", 0.5), ("sigmoid", 0.0), ("sigmoid", 1.0),
                                                     ("ipo", 0.3), (["sigmoid", "sft"], 0.25),
                                                     (["sigmoid", "sft"], None)])
def test_ld_alpha_equals_trl_dpo_trainer(loss_type, ld_alpha: float | None) -> None:
    """LD-DPO: the policy's and the reference's sums weigh the verbose tokens α times (`answer_sums`, as the
    trainer calls it), the sft term's NLL keeps every token whole and counts the scored ones (None: the plain
    sums, where the empty prompt's pair has one chosen token fewer in sft's mean); loss, gradient and the reward and log-prob
    metrics against TRL's `_compute_loss` with its reference forward (not precomputed) in float64."""
    pairs, batch, mask, policy, reference, at = pairs_in_both_layouts(seed=21)
    n = len(pairs)
    model = torch.nn.Module()  # TRL asks whether the policy is a PEFT model: a module that is not
    model.is_gradient_checkpointing = False
    options = dict(ld_alpha=ld_alpha, precompute_ref_logps=False, model=model, ref_model=lambda **kw: SimpleNamespace(
        log_probs=reference), args=SimpleNamespace(discopop_tau=0.05, gradient_checkpointing_kwargs=None))
    trl_loss, trl_grad, metrics = _trl_dpo(loss_type, 0.3, 0.0, mask, policy, torch.zeros(2 * n), **options)

    leaf = policy.clone().requires_grad_(True)
    logps, full = answer_sums(leaf[at], batch, ld_alpha), answer_sums(leaf[at], batch)
    ref = answer_sums(reference[at], batch, ld_alpha)
    lengths = batch.answer_lengths
    out = dpo_loss(*logps.chunk(2), *ref.chunk(2), beta=0.3, loss_type=loss_type, chosen_lengths=lengths[:n],
                   rejected_lengths=lengths[n:], sft_chosen_logps=full[:n], sft_chosen_tokens=scored_tokens(batch)[:n])
    loss = out.losses.mean()
    (grad,) = torch.autograd.grad(loss, leaf)
    torch.testing.assert_close(loss.detach(), trl_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, trl_grad * mask[:, 1:], rtol=1e-12, atol=1e-12)
    for name, ours in (("rewards/chosen", out.chosen_rewards.mean()), ("rewards/margins",
                       (out.chosen_rewards - out.rejected_rewards).mean()), ("logps/chosen", logps[:n].mean()),
                       ("logps/rejected", logps[n:].mean())):
        assert metrics[name][0] == pytest.approx(ours.item(), rel=1e-12, abs=1e-12), name
    if ld_alpha is not None and 0 < ld_alpha < 1:  # the verbose tokens are weighed: the sums are not the plain ones
        assert (logps != full).any()


@pytest.mark.parametrize(("loss_type", "ld_alpha", "loss_weights"), [
    ("sigmoid", None, None), ("ipo", None, None), ("sigmoid_norm", 0.5, None), (["sigmoid", "bco_pair"], None, [0.8, 0.2]),
    (["robust", "discopop", "apo_down"], 0.3, [1.0, 0.5, 2.0]),
])
def test_wpo_weights_equal_trl_dpo_trainer(loss_type, ld_alpha: float | None, loss_weights) -> None:
    """WPO: each pair's every loss term times exp(mean log p - log Σ_v p_v²) of both its answers (the plain
    token log-probs, under ld_alpha too), without gradient through the weights; loss, gradient and metrics
    against TRL's `_compute_loss` in float64, from the same per-token log-probs and log Σ_v p_v²."""
    pairs, batch, mask, policy, reference, at = pairs_in_both_layouts(seed=31)
    n = len(pairs)
    g = torch.Generator().manual_seed(32)
    # log Σ_v p_v², the expected log-probability's kin: of the tokens' own size, some above them, some below
    log_sum_sq = -torch.rand(policy.shape, generator=g, dtype=torch.float64) * 3
    ref_sums = (reference * mask[:, 1:]).sum(1)  # precomputed in TRL's inputs, ld_alpha's weighting aside
    trl_loss, trl_grad, metrics = _trl_dpo(loss_type, 0.2, 0.1 if "robust" in loss_type else 0.0, mask, policy,
                                           ref_sums, loss_weights, ld_alpha=ld_alpha, use_weighting=True,
                                           log_sum_sq_probs=log_sum_sq)
    leaf = policy.clone().requires_grad_(True)
    logps = answer_sums(leaf[at], batch, ld_alpha)
    weights = wpo_weights(leaf[at], log_sum_sq[at], batch)
    assert not weights.requires_grad and weights.min() < 0.9 and weights.max() > 1.1
    out = dpo_loss(*logps.chunk(2), *ref_sums.chunk(2), beta=0.2, loss_type=loss_type,
                   label_smoothing=0.1 if "robust" in loss_type else 0.0, loss_weights=loss_weights,
                   chosen_lengths=batch.answer_lengths[:n], rejected_lengths=batch.answer_lengths[n:],
                   pair_weights=weights[:n] * weights[n:])
    loss = out.losses.mean()
    (grad,) = torch.autograd.grad(loss, leaf)
    torch.testing.assert_close(loss.detach(), trl_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, trl_grad * mask[:, 1:], rtol=1e-12, atol=1e-12)
    assert metrics["rewards/margins"][0] == pytest.approx((out.chosen_rewards - out.rejected_rewards).mean().item(),
                                                          rel=1e-12, abs=1e-12)


def test_log_sum_sq_probs_equal_trl_kernel() -> None:
    """WPO's log Σ_v p_v² from pagedrl's LM-head pass (`target_logprobs`' chunks) against TRL's chunked log-prob
    kernel on the same float32 hidden rows and head, both within float32's bounds of the float64 value: two
    log-sum-exps over V logits of size |z|, each within gamma(V) of Σ|terms| relative to the sum, plus the
    subtraction and the logs (U each)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    from pagedrl.train.logprobs import logprobs_from_hidden

    g = torch.Generator().manual_seed(33)
    hidden, weight = torch.randn(2, 7, 16, generator=g), torch.randn(300, 16, generator=g) / 2
    predict_at, targets = torch.tensor([0, 3, 5, 8, 13]), torch.randint(0, 300, (5,), generator=g)
    ours = logprobs_from_hidden(lambda h: h @ weight.T, hidden, predict_at, targets, log_sum_sq=True,
                                chunk_rows=2).log_sum_sq
    rows = hidden.reshape(-1, 16)[predict_at]
    trl = ChunkedLogProbFunction.apply(rows, weight, None, targets, 1.0, 64, None, 1.0, ("log_sum_sq_probs",))[2]
    z = rows.double() @ weight.double().T
    exact = (2 * z).logsumexp(-1) - 2 * z.logsumexp(-1)
    bound = 4 * (gamma(300) + 4 * U) * (1 + 2 * z.abs().max(-1).values)
    assert ours is not None and ((ours.double() - exact).abs() <= bound).all()
    assert ((trl.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize(("fields", "key", "says"), [
    (dict(f_divergence_type="forward_kl", loss_type="bco_pair"), "f_divergence_type", "bco_pair takes only reverse_kl"),
    (dict(f_divergence_type="js_divergence", loss_type=["sigmoid", "aot", "nca_pair"]), "f_divergence_type",
     "aot, nca_pair takes only"),
    (dict(f_alpha_divergence_coef=0.3), "f_alpha_divergence_coef", "only f_divergence_type alpha_divergence"),
    (dict(f_divergence_type="alpha_divergence", f_alpha_divergence_coef=float("nan")), "f_alpha_divergence_coef",
     "must be .*finite"),
    (dict(f_divergence_type="chi2"), "f_divergence_type", "unknown 'chi2'"),
    (dict(ld_alpha=1.5), "ld_alpha", r"must be null or in \[0, 1\]"),
    (dict(use_weighting=True, loss_type=["sigmoid", "aot"]), "use_weighting", "do not apply to aot"),
    (dict(use_weighting=True, loss_type=["sigmoid", "sft"]), "use_weighting", "do not apply to sft"),
    (dict(use_weighting=True, loss_type="hinge"), "use_weighting", "do not apply to hinge: TRL 1.16's"),
])
def test_options_that_do_not_fit_are_refused_naming_the_key(fields: dict, key: str, says: str) -> None:
    with pytest.raises(TrainConfigError, match=rf"^{key}: .*{says}"):
        DPOConfig(**fields)
    if key == "ld_alpha":  # the trainer's sums, not the loss, read it
        return
    x = torch.zeros(2)
    if fields.pop("use_weighting", False):  # the loss sees WPO as its pair weights
        fields["pair_weights"] = x
    with pytest.raises(ValueError, match=rf"^{key}: .*{says}"):  # the loss itself checks the same way
        dpo_loss(x, x, x, x, chosen_lengths=x, rejected_lengths=x, **fields)


def test_trl_dpo_keys_taken_at_what_pagedrl_does_and_refused_otherwise() -> None:
    """TRL 1.16's DPOConfig keys: `padding_free` true or false (TRL's DPOTrainer pads either way: so do the pair
    rows here, `test_dpo.py` holds the two to one loss); the older DPO keys TRL 1.16 has dropped are refused
    saying what bounds the lengths here, never with a guess at a near name (max_prompt_length -> max_length).
    A trainer TRL gives no padding_free refuses true naming the key."""
    config = load_config(DPOConfig, None, ["padding_free=false", "precompute_ref_log_probs=true",
                                           "precompute_ref_batch_size=16"])
    assert config.precompute_ref_batch_size == 16 and not config.padding_free
    assert load_config(DPOConfig, None, ["padding_free=true"]).padding_free
    load_config(RewardConfig, None, ["padding_free=false"])  # what it does
    with pytest.raises(ValueError, match=r"^command line: padding_free: only false \(pagedrl's behaviour\), got True: "
                                         r"rows are padded .* only SFT and DPO take padding_free"):
        load_config(RewardConfig, None, ["padding_free=true"])
    for key in ("max_prompt_length", "max_completion_length"):
        with pytest.raises(ValueError, match=rf"'{key}' is a TRL / transformers option DPOConfig does not have: "
                                             "max_length bounds each prompt \\+ answer"):
            load_config(DPOConfig, None, [f"{key}=128"])
    with pytest.raises(TrainConfigError, match=r"^precompute_ref_batch_size: sizes the precompute_ref_log_probs "
                                               r"pass, which is off"):
        DPOConfig(precompute_ref_batch_size=4)
    with pytest.raises(TrainConfigError, match=r"^precompute_ref_batch_size: must be >= 1"):
        DPOConfig(precompute_ref_batch_size=0, precompute_ref_log_probs=True)


def test_precompute_ref_batch_size_batches_the_reference_pass_only(tiny_train_model, tmp_path) -> None:
    """The reference's log-probs precomputed 3 pairs at a time are those of training's batches of 8: each
    pair is its own row, so the batch changes only the padding (masked) and the sums' order."""
    from preference_data import dpo_trainer, preference_rows

    rows = preference_rows(8, seed=4)
    tables = []
    for size in (None, 3):
        algorithm = dpo_trainer(tiny_train_model, tmp_path / str(size), rows, precompute_ref_log_probs=True,
                                precompute_ref_batch_size=size).algorithm
        tables.append(torch.tensor([(e.ref_chosen, e.ref_rejected) for e in algorithm.examples]))
        assert (algorithm.config.precompute_ref_batch_size or 8) == (size or 8)
    torch.testing.assert_close(tables[1], tables[0], rtol=1e-5, atol=0.0)


def test_sync_ref_model_mixes_the_reference_as_trl(tiny_train_model, tmp_path) -> None:
    """TR-DPO over 5 steps, mixing every 2: the reference is TRL's `SyncRefModelCallback._sync_target_model`
    applied to the starting reference with the policy after steps 2 and 4 (the same in-place operations:
    equal to the bit), and the start-up line says so."""
    import copy

    from preference_data import dpo_trainer, preference_rows
    from trl.trainer.callbacks import SyncRefModelCallback

    rows = preference_rows(16, seed=6)
    fields = dict(max_steps=5, per_device_train_batch_size=4, sync_ref_model=True, ref_model_sync_steps=2,
                  ref_model_mixup_alpha=0.3)
    trainer = dpo_trainer(tiny_train_model, tmp_path / "sync", rows, **fields)
    algorithm = trainer.algorithm
    expected = copy.deepcopy(algorithm.reference)
    policies = {}
    mix = algorithm.after_optimizer_step

    def record(step: int) -> None:
        policies[step] = copy.deepcopy(algorithm.model)
        mix(step)

    algorithm.after_optimizer_step = record
    trainer.train()
    for step in (2, 4):
        SyncRefModelCallback._sync_target_model(policies[step], expected, 0.3)
    for (name, got), want in zip(algorithm.reference.named_parameters(), expected.parameters(), strict=True):
        assert torch.equal(got, want), name
    assert not torch.equal(next(algorithm.reference.parameters()), next(policies[5].parameters()))
    assert any("mixed toward the policy (alpha 0.3) every 2 steps" in line for line in algorithm.summary_lines())


@pytest.mark.parametrize(("fields", "key", "says"), [
    (dict(sync_ref_model=True, precompute_ref_log_probs=True), "sync_ref_model", "set precompute_ref_log_probs"),
    (dict(sync_ref_model=True, use_peft=True), "sync_ref_model", "with LoRA the reference is the base model"),
    (dict(sync_ref_model=True, fsdp="full_shard"), "sync_ref_model", "not built with FSDP2"),
    (dict(ref_model_mixup_alpha=0.9), "ref_model_mixup_alpha", "only sync_ref_model uses it"),
    (dict(ref_model_sync_steps=64), "ref_model_sync_steps", "only sync_ref_model uses it"),
    (dict(sync_ref_model=True, ref_model_mixup_alpha=1.5), "ref_model_mixup_alpha", r"must be in \[0, 1\]"),
    (dict(sync_ref_model=True, ref_model_sync_steps=0), "ref_model_sync_steps", "must be >= 1"),
])
def test_sync_ref_model_refused_where_no_reference_can_be_mixed(fields: dict, key: str, says: str) -> None:
    with pytest.raises(TrainConfigError, match=rf"^{key}: .*{says}"):
        DPOConfig(**fields)


def test_sync_ref_model_refuses_a_ref_model_of_other_parameters(tiny_train_model, tmp_path) -> None:
    from preference_data import dpo_trainer, preference_rows
    from tiny_train import build_model_dir

    from pagedrl.model.loader import load_model

    other = load_model(str(build_model_dir(tmp_path / "wide", intermediate_size=128))).model
    with pytest.raises(ValueError, match=r"^sync_ref_model: the reference model does not have the policy's "
                                         r"parameters"):
        dpo_trainer(tiny_train_model, tmp_path / "run", preference_rows(4), reference=other, sync_ref_model=True)
