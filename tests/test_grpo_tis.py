"""The rollout's importance-sampling correction (`tis_mode`, TRL 1.16's `vllm_importance_sampling_mode`): each
mode's weights and metrics against TRL's own lines, run as they stand in `GRPOTrainer._generate_and_score_completions`
(lifted from its source, so a TRL that changes them fails here) and against a float64 hand computation; the
loss and gradient under each mode against TRL's `_compute_loss` (the stand-in trainer of
tests/test_losses_trl.py); TRL's keys in a config, and the settings refused by name."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import trl.trainer.grpo_trainer as trl_grpo
import yaml
from test_grpo import grpo, write_prompts
from test_grpo_loss_types import flat_gradient
from test_losses_trl import SAPO, VESPO, _grpo_batch, _ours_grpo, _trl_grpo

from pagedrl.train.algorithms.grpo import run_grpo, tis_metrics
from pagedrl.train.config import load_config
from pagedrl.train.losses import aggregate, clipped_surrogate
from pagedrl.train.rl.config import GRPOConfig, PPOConfig
from pagedrl.train.tis import TIS_MODES, is_sequence_mode, tis_ratio_values, tis_weight

_SOURCE = inspect.getsource(trl_grpo.GRPOTrainer._generate_and_score_completions)


def _trl_lines(anchor: str, end: str):
    """The `if self.use_vllm and self.vllm_importance_sampling_correction:` block of TRL's source that holds
    `anchor`, up to the line holding `end`, compiled."""
    at = _SOURCE.index(anchor)
    start = _SOURCE.rindex("\n", 0, _SOURCE.rindex("if self.use_vllm and self.vllm_importance_sampling_correction:",
                                                   0, at)) + 1
    stop = _SOURCE.rindex("\n", 0, _SOURCE.index(end, at)) + 1
    return compile(textwrap.dedent(_SOURCE[start:stop]), "trl-grpo-importance-sampling", "exec")


TRL_WEIGHTS = _trl_lines("per_token_logps_diff = (old_per_token_logps",
                         "# Compute the per-token log probabilities for the reference model")
TRL_METRICS = _trl_lines("delta = torch.abs(old_per_token_logps - sampling_per_token_logps)", "output = {")


def trl_weights(mode: str, cap: float | None, floor: float | None, mask, old, sampling):
    """TRL's importance-sampling ratio and its logged `sampling/*` metrics, from TRL's own lines, on one rank."""
    trainer = SimpleNamespace(
        use_vllm=True, vllm_importance_sampling_correction=True, vllm_importance_sampling_mode=mode,
        vllm_importance_sampling_clip_max=cap, vllm_importance_sampling_clip_min=floor,
        accelerator=SimpleNamespace(gather=lambda t: t.reshape(-1)), _metrics=defaultdict(lambda: defaultdict(list)))
    scope = dict(vars(trl_grpo), self=trainer, completion_mask=mask.long(), tool_mask=None, mode="train",
                 old_per_token_logps=old, sampling_per_token_logps=sampling, device=old.device)
    exec(TRL_WEIGHTS, scope)
    exec(TRL_METRICS, scope)
    return scope["vllm_importance_sampling_ratio"], {k: v[0] for k, v in trainer._metrics["train"].items()}


def hand_weights(mode: str, cap: float | None, floor: float | None, mask, old, sampling) -> list[list[float]]:
    """Each mode by hand in Python floats: ρ = exp(old - sampling) per completion token (a NaN difference
    counts 0), or exp of the sum over the completion's tokens; clamped, or 0 outside [floor, cap]."""
    lo, hi = (floor if floor is not None else -math.inf), (cap if cap is not None else math.inf)

    def bound(r: float) -> float:
        if mode.endswith("truncate"):
            return min(max(r, lo), hi)
        return 0.0 if r < lo or r > hi else r

    rows = []
    for m, o, s in zip(mask.tolist(), old.tolist(), sampling.tolist(), strict=True):
        diffs = [(a - b if not math.isnan(a - b) else 0.0) if k else 0.0 for k, a, b in zip(m, o, s, strict=True)]
        rows.append([bound(math.exp(sum(diffs)))] if is_sequence_mode(mode) else [bound(math.exp(d)) for d in diffs])
    return rows


BOUNDS = [(3.0, None), (1.5, 0.5), (None, 0.5), (None, None)]  # (C_max, C_min): TRL's default first


def batch(seed: int = 11):
    """Completions of different lengths, padding, an empty one (all masked out), NaN engine log-probs in the
    padding and at one completion token (TRL counts its difference 0); engine and trainer far apart, so
    that every bound bites."""
    mask, logp, old, ref, sampling, adv = _grpo_batch(rows=10, seq_len=7, seed=seed)
    mask[4] = 0
    sampling = old + 2 * (sampling - old)
    sampling = sampling.masked_fill(mask == 0, float("nan"))
    row = int(mask.sum(-1).argmax())
    sampling[row, 0] = float("nan")
    return mask, logp, old, ref, sampling, adv


@pytest.mark.parametrize("mode", TIS_MODES)
@pytest.mark.parametrize(("cap", "floor"), BOUNDS)
def test_each_mode_s_weights_and_metrics_are_trl_s(mode, cap, floor) -> None:
    mask, _, old, _, sampling, _ = batch()
    if mode.endswith("truncate") and cap is None and floor is None:
        with pytest.raises(ValueError, match="needs a bound"):
            tis_weight(old, sampling, cap, mode, mask, floor)
        return
    trl_w, trl_metrics = trl_weights(mode, cap, floor, mask, old, sampling)
    w = tis_weight(old, sampling, cap, mode, mask, floor)
    assert w.shape == ((10, 1) if is_sequence_mode(mode) else (10, 7)) == trl_w.shape
    torch.testing.assert_close(w, trl_w, rtol=1e-15, atol=0)  # the same float64 operations in the same order
    hand = torch.tensor(hand_weights(mode, cap, floor, mask, old, sampling), dtype=torch.float64)
    torch.testing.assert_close(w, hand, rtol=1e-14, atol=0)
    values = tis_ratio_values(w, mask, mode)
    assert values.numel() == (10 if is_sequence_mode(mode) else int(mask.sum()))
    ours = {name.rsplit("/", 1)[1]: m for name, m in tis_metrics(values).items()}
    for stat in ("min", "mean", "max"):
        m = ours[stat]
        value = float(m.total) / float(m.weight) if stat == "mean" else float(m.total)
        assert value == pytest.approx(trl_metrics[f"sampling/importance_sampling_ratio/{stat}"], rel=1e-12), stat
    if is_sequence_mode(mode):
        assert w[4].item() == 1.0  # the empty completion: no difference, weight 1, counted in the metrics
    # the bounds bite on this batch: some weights cut or masked, others not
    if cap is not None or floor is not None:
        bounded = (w == 0) if mode.endswith("mask") else ((w == cap) | (w == floor))
        assert 0 < int(bounded.sum()) < w.numel() - (0 if is_sequence_mode(mode) else int((mask == 0).sum()))
    assert not w.requires_grad


# vespo takes the token modes only: TRL's GRPOTrainer refuses it with a sequence mode, as pagedrl's config does
MODE_LOSSES = [(mode, loss) for mode in TIS_MODES for loss in ("grpo", "dapo", "luspo", "cispo", "sapo", "vespo")
               if not (loss == "vespo" and is_sequence_mode(mode))]


@pytest.mark.parametrize(("mode", "loss_type"), MODE_LOSSES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_loss_and_gradient_under_each_mode_equal_trl_grpo_trainer(mode, loss_type, level) -> None:
    """TRL multiplies the per-token loss by its ratio ([B, T], or [B, 1] under a sequence mode) before the KL
    is added, or for vespo takes it into the sequence weight (token modes only: TRL refuses the others)."""
    mask, logp, old, ref, sampling, adv = batch(seed=12)
    cap, floor = 2.0, 0.4
    trl_w, _ = trl_weights(mode, cap, floor, mask, old, sampling)
    trl_loss, trl_grad, _ = _trl_grpo(loss_type, 0.04, 0.2, 0.28, None, 10, mask, logp, old, ref, trl_w, adv,
                                      level=level)
    surrogate = {"epsilon_low": 0.2, "epsilon_high": 0.28, "level": level,
                 **({"cispo": True} if loss_type == "cispo" else {}), **({"sapo": SAPO} if loss_type == "sapo" else {})}
    w = tis_weight(old, sampling, cap, mode, mask, floor)
    loss, grad, _ = _ours_grpo(loss_type, 0.04, mask, logp, old, ref, w, adv, 10,
                               vespo=VESPO if loss_type == "vespo" else None, **surrogate)
    torch.testing.assert_close(loss, trl_loss, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad * mask, trl_grad * mask, rtol=1e-12, atol=1e-12)
    assert grad.abs().max() > 0


# --------------------------------------------------------------------------------------------- config

GRPO = ["reward_funcs=[accuracy]"]


def test_the_default_is_pagedrl_s_token_truncate_and_trl_s_keys_are_read(tmp_path) -> None:
    """pagedrl keeps token_truncate at 3 (TRL's default mode is sequence_mask, its clip_max 3); TRL's keys set
    pagedrl's fields, its deprecated `vllm_importance_sampling_cap` too."""
    c = GRPOConfig()
    assert (c.tis_correction, c.tis_mode, c.tis_cap, c.tis_min) == (True, "token_truncate", 3.0, None)
    path = tmp_path / "trl.yaml"
    path.write_text("vllm_importance_sampling_correction: true\nvllm_importance_sampling_mode: sequence_mask\n"
                    "vllm_importance_sampling_clip_max: 2.5\nvllm_importance_sampling_clip_min: 0.5\n"
                    "reward_funcs: [accuracy]\n")
    c = load_config(GRPOConfig, path)
    assert (c.tis_correction, c.tis_mode, c.tis_cap, c.tis_min) == (True, "sequence_mask", 2.5, 0.5)
    assert load_config(GRPOConfig, None, [*GRPO, "vllm_importance_sampling_cap=4"]).tis_cap == 4.0
    assert load_config(GRPOConfig, None, [*GRPO, "vllm_importance_sampling_correction=false"]).tis_correction is False
    # no upper bound: a mask mode masks below C_min alone, or takes the raw ratio; a truncating mode needs a bound
    c = load_config(GRPOConfig, None, [*GRPO, "vllm_importance_sampling_mode=token_mask", "tis_cap=null"])
    assert (c.tis_mode, c.tis_cap, c.tis_min) == ("token_mask", None, None)
    c = load_config(GRPOConfig, None, [*GRPO, "tis_cap=null", "tis_min=0.25"])
    assert (c.tis_mode, c.tis_cap, c.tis_min) == ("token_truncate", None, 0.25)
    # the correction off: TRL ignores the mode and bounds (it still checks the bounds' order)
    assert load_config(GRPOConfig, None, [*GRPO, "tis_correction=false", "tis_cap=null"]).tis_cap is None
    assert GRPOConfig(loss_type="vespo", tis_correction=False, tis_mode="sequence_mask").tis_mode == "sequence_mask"
    # a file's TRL key overridden on the command line by pagedrl's name: the later place wins, as for any key
    assert load_config(GRPOConfig, path, ["tis_cap=3"]).tis_cap == 3.0


def test_tis_cap_null_keeps_its_old_meaning_and_trl_s_null_cap_is_unset(tmp_path) -> None:
    """`tis_cap: null` with the default mode and no `tis_min` meant the correction off before the modes (and is in
    configs saved beside older checkpoints): it still does. TRL's deprecated `vllm_importance_sampling_cap: None`
    means "not given" in TRL (its `to_dict()` writes it beside `_clip_max`), so `_clip_max` stays in force."""
    for overrides in (["tis_cap=null"], ["vllm_importance_sampling_clip_max=null"]):
        c = load_config(GRPOConfig, None, [*GRPO, *overrides])
        assert (c.tis_correction, c.tis_mode, c.tis_cap, c.tis_min) == (False, "token_truncate", None, None)
    assert GRPOConfig(tis_cap=None).tis_correction is False
    c = load_config(GRPOConfig, None, [*GRPO, "vllm_importance_sampling_mode=sequence_mask",
                                       "vllm_importance_sampling_cap=null"])
    assert (c.tis_correction, c.tis_mode, c.tis_cap) == (True, "sequence_mask", 3.0)
    written = trl_grpo.GRPOConfig(output_dir=str(tmp_path), bf16=False, use_cpu=True).to_dict()
    keys = {k: v for k, v in written.items() if k.startswith("vllm_importance_sampling")}
    assert keys["vllm_importance_sampling_cap"] is None and keys["vllm_importance_sampling_clip_max"] == 3.0
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump({**keys, "reward_funcs": ["accuracy"]}))
    c = load_config(GRPOConfig, path)
    assert (c.tis_correction, c.tis_mode, c.tis_cap, c.tis_min) == (True, "sequence_mask", 3.0, None)


def test_two_spellings_of_one_setting_must_agree(tmp_path) -> None:
    path = tmp_path / "both.yaml"
    path.write_text("tis_cap: 2.0\nvllm_importance_sampling_clip_max: 3.0\nreward_funcs: [accuracy]\n")
    with pytest.raises(ValueError, match=r"tis_cap and vllm_importance_sampling_clip_max both set tis_cap, "
                                         r"to 2.0 and 3.0; keep one"):
        load_config(GRPOConfig, path)
    with pytest.raises(ValueError, match="vllm_importance_sampling_cap and vllm_importance_sampling_clip_max both"):
        load_config(GRPOConfig, None, ["vllm_importance_sampling_cap=2", "vllm_importance_sampling_clip_max=3"])
    with pytest.raises(ValueError, match="tis_mode and vllm_importance_sampling_mode both set tis_mode"):
        load_config(GRPOConfig, None, ["tis_mode=token_mask", "vllm_importance_sampling_mode=sequence_mask"])
    same = load_config(GRPOConfig, None, [*GRPO, "tis_cap=2", "vllm_importance_sampling_clip_max=2.0"])
    assert same.tis_cap == 2.0


@pytest.mark.parametrize(("overrides", "expected"), [
    (["vllm_importance_sampling_mode=sequence"],
     r"^command line: tis_mode \(as vllm_importance_sampling_mode\): expected one of"),
    (["tis_mode=token"], r"^command line: tis_mode: expected one of"),
    (["vllm_importance_sampling_correction=maybe"], r"tis_correction \(as vllm_importance_sampling_correction\)"),
    (["vllm_importance_sampling_clip_max=0.5"],
     r"^tis_cap: must be null or >= 1, got 0.5 \(from command line, as vllm_importance_sampling_clip_max\)"),
    (["vllm_importance_sampling_clip_min=1.5"], r"^tis_min: must be null or in \[0, 1\], got 1.5"),
    (["tis_min=1", "tis_cap=1"], r"^tis_min: must be less than tis_cap, got 1.0 and 1.0"),
    (["tis_cap=null", "tis_mode=sequence_truncate"], r"^tis_cap: sequence_truncate needs a bound"),
    (["loss_type=vespo", "vllm_importance_sampling_mode=sequence_mask"],
     r"^tis_mode: vespo weighs in the rollout's weights per token: token_truncate or token_mask, got sequence_mask"),
])
def test_bad_settings_are_refused_naming_the_key(overrides, expected) -> None:
    with pytest.raises(ValueError, match=expected):
        load_config(GRPOConfig, None, [*GRPO, *overrides])


def test_ppo_has_no_rollout_correction_and_says_so() -> None:
    """TRL 1.16 has no PPO trainer with such a correction (its GRPOTrainer's alone): PPO refuses the keys,
    naming pagedrl's field it lacks."""
    for key in ("vllm_importance_sampling_mode=token_mask", "tis_cap=2"):
        with pytest.raises(ValueError, match="PPOConfig"):
            load_config(PPOConfig, None, [key])
    with pytest.raises(ValueError, match="'vllm_importance_sampling_mode' is TRL's name for 'tis_mode', which "
                                         "PPOConfig does not have"):
        load_config(PPOConfig, None, ["vllm_importance_sampling_mode=token_mask"])


# --------------------------------------------------------------------------------------------- the trainer


@pytest.fixture
def prompts_file(tmp_path):
    return write_prompts(tmp_path)


def test_the_trainer_weighs_its_loss_as_trl_under_each_mode(tiny_train_model, prompts_file) -> None:
    """On a real rollout whose engine log-probs are moved ~0.3 per token off the trainer's (so that the bounds
    [0.6, 1.5] cut and mask), the trainer's gradient under each mode is the one composed from TRL's weights,
    and it logs TRL's `sampling/importance_sampling_ratio/*` of them."""
    algo = grpo(tiny_train_model, prompts_file)
    b = algo.step_batches(1)[0]
    noise = torch.randn(b.sampling_logps.shape, generator=torch.Generator().manual_seed(0))
    b.sampling_logps = b.sampling_logps + 0.3 * noise * b.mask
    total = torch.tensor(float(algo.count(b)))
    seen = []
    for mode in TIS_MODES:
        algo.config = c = dataclasses.replace(algo.config, tis_mode=mode, tis_cap=1.5, tis_min=0.6)
        grads = []
        for composed in (False, True):
            algo.model.zero_grad()
            if composed:
                logp = b.to_padded(algo.token_logps(algo.model, b).logps)
                w, trl_metrics = trl_weights(mode, 1.5, 0.6, b.mask, logp.detach(), b.sampling_logps)
                out = clipped_surrogate(logp, logp.detach(), b.advantages, b.mask, c.epsilon, c.epsilon_high)
                loss = aggregate(out.loss * w, b.mask, "dapo", normaliser=total)
            else:
                loss, metrics = algo.loss(algo.model, b, total)
            loss.backward()
            grads.append(flat_gradient(algo.model))
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-8, msg=mode)
        for name, expected in trl_metrics.items():
            m = metrics[name]
            logged = float(m.total) / float(m.weight) if m.reduce == "mean" else float(m.total)
            assert logged == pytest.approx(expected, rel=1e-5, abs=1e-7), (mode, name)
        cut = (w == 0) if mode.endswith("mask") else ((w == 1.5) | (w == 0.6))
        assert cut.any(), mode
        seen.append(grads[0])
    assert all((a - seen[0]).abs().max() > 0 for a in seen[1:])  # four different weightings
    assert any("rollout importance weights sequence_mask in [0.6, 1.5]" in line for line in algo.summary_lines())


def test_a_short_run_with_trl_s_sequence_mask(tiny_train_model, prompts_file) -> None:
    """TRL's keys as a TRL recipe writes them (its default mode, sequence_mask): one real step trains and logs
    the weights' min, mean and max, each completion's weight near 1 (engine and trainer agree in float32)."""
    out = prompts_file.parent / "run"
    path = prompts_file.parent / "grpo.yaml"
    path.write_text(
        f"model_name_or_path: {tiny_train_model}\ndataset_name: {prompts_file}\noutput_dir: {out}\n"
        f"reward_funcs: ['{prompts_file.parent}/rewards.py:has_three', '{prompts_file.parent}/rewards.py:token_sum']\n"
        "num_generations: 4\nper_device_train_batch_size: 8\nmax_completion_length: 8\nmax_steps: 1\n"
        "logging_steps: 1\nsave_steps: 100\nlearning_rate: 1e-3\nreport_to: [jsonl]\nloss_type: grpo\n"
        "vllm_importance_sampling_correction: true\nvllm_importance_sampling_mode: sequence_mask\n"
        "vllm_importance_sampling_clip_max: 3.0\nvllm_importance_sampling_clip_min: 0.5\n")
    config = load_config(GRPOConfig, path)
    assert (config.tis_mode, config.tis_cap, config.tis_min) == ("sequence_mask", 3.0, 0.5)
    assert (run_grpo(config, progress=False) / "config.json").is_file()
    row = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "reward" in line][0]
    low, mean, high = (row[f"sampling/importance_sampling_ratio/{s}"] for s in ("min", "mean", "max"))
    assert 0.99 < low <= mean <= high < 1.01
    assert math.isfinite(row["loss"]) and row["grad_norm"] > 0
