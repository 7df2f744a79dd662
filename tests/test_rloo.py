"""RLOO on GRPO's loop, on the tiny model: the example through the command line with TRL's metric names,
the on-policy gradient of REINFORCE with the leave-one-out baseline, a resume equal to the run it
interrupted, and the config's TRL names, defaults and refusals. Its numbers against TRL's RLOOTrainer:
tests/test_rloo_trl.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import trl
from test_grpo import grpo, write_prompts
from test_trainer_resume import Interrupted, interrupt_at, metric_rows

from pagedrl.model.loader import load_model
from pagedrl.train.algorithms.rloo import RLOO
from pagedrl.train.cli import train_main
from pagedrl.train.config import TrainConfigError, load_config
from pagedrl.train.distributed import DistInfo
from pagedrl.train.rl.config import RLOOConfig
from pagedrl.train.trainer import Trainer

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rloo_arithmetic.yaml"
TRL_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/last_integer_match/mean",
               "rewards/last_integer_match/std", "kl", "entropy", "clip_ratio/low_mean", "clip_ratio/low_min",
               "clip_ratio/high_mean", "clip_ratio/high_max", "clip_ratio/region_mean", "num_tokens",
               "completions/mean_length", "completions/min_length", "completions/max_length",
               "completions/clipped_ratio", "step_time")


@pytest.fixture()
def prompts_file(tmp_path):
    return write_prompts(tmp_path)


def rloo_trainer(model_dir: Path, prompts_file: Path, output_dir: Path, **fields) -> Trainer:
    folder = prompts_file.parent
    config = RLOOConfig(**{**dict(model=str(model_dir), dataset=str(prompts_file), eval_dataset=str(prompts_file),
                                  output_dir=str(output_dir), num_generations=4, per_device_train_batch_size=4,
                                  gradient_accumulation_steps=2, max_completion_length=8,
                                  reward_funcs=[f"{folder}/rewards.py:has_three", f"{folder}/rewards.py:token_sum"],
                                  learning_rate=1e-3, logging_steps=1, save_steps=100, max_steps=2, report_to=["jsonl"]),
                           **fields})
    loaded = load_model(model_dir)
    algo = RLOO(config, loaded.model.train(), loaded.tokenizer, DistInfo(), eos_token_ids=loaded.eos_token_ids)
    return Trainer(config, algo, DistInfo(), progress=False)


def test_the_example_trains_through_the_command_line_and_logs_trls_metrics(tiny_train_model, tmp_path) -> None:
    out = tmp_path / "run"
    assert train_main("rloo", [str(EXAMPLE), f"model={tiny_train_model}", f"output_dir={out}", "max_steps=2",
                               "num_generations=4", "per_device_train_batch_size=8", "gradient_accumulation_steps=1",
                               "max_completion_length=8", "task_num_eval=4", "report_to=[jsonl]"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "reward" in r]
    assert [r["step"] for r in train] == [1, 2]
    for name in TRL_METRICS:
        assert name in train[0], name
    assert (out / "final" / "config.json").is_file()


def test_on_policy_gradient_is_reinforce_with_the_leave_one_out_baseline(tiny_train_model, prompts_file) -> None:
    """At ratio 1 (one update per rollout) the loss's gradient is -Σ_i A_i ∇Σ_t log p_it / N, each
    completion's whole log-likelihood times its advantage (not a token mean), and A is not 0."""
    algo = rloo_trainer(tiny_train_model, prompts_file, prompts_file.parent / "out", beta=0.1).algorithm
    batches = algo.step_batches(1)
    total = torch.tensor(float(sum(algo.count(b) for b in batches)))
    b = batches[0]
    assert b.advantages is not None and b.advantages.abs().max() > 0
    algo.model.zero_grad()
    loss, metrics = algo.loss(algo.model, b, total)
    loss.backward()
    ours = [p.grad.clone() for p in algo.model.parameters()]
    algo.model.zero_grad()
    logp = b.to_padded(algo.token_logps(algo.model, b).logps).masked_fill(~b.mask, 0.0)
    (-(b.advantages * logp.sum(-1)).sum() / total).backward()
    for got, expected in zip(ours, (p.grad for p in algo.model.parameters()), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-8)
    assert metrics["clip_ratio/region_mean"].total == 0  # on-policy: nothing clipped


def test_a_resumed_run_equals_the_run_it_interrupted(tiny_train_model, prompts_file, tmp_path) -> None:
    fields = dict(max_steps=4, save_steps=2, num_iterations=2, normalize_advantages=True)
    straight = rloo_trainer(tiny_train_model, prompts_file, tmp_path / "a", **fields)
    straight.train()
    first = rloo_trainer(tiny_train_model, prompts_file, tmp_path / "b", **fields)
    interrupt_at(first, 3)
    with pytest.raises(Interrupted):
        first.train()
    resumed = rloo_trainer(tiny_train_model, prompts_file, tmp_path / "b", resume_from_checkpoint=True, **fields)
    resumed.train()
    skip = {"rollout/seconds", "rollout/tokens_per_second"}
    expected, got = ([{k: v for k, v in r.items() if k not in skip} for r in metric_rows(tmp_path / d)]
                     for d in ("a", "b"))
    assert [r["step"] for r in got] == [1, 2, 3, 4] and got == expected
    # the reference is the policy until its first update (μ = 2: steps 1 and 2 train on one rollout), after it not
    assert [r["kl"] == 0.0 for r in got] == [True, True, False, False]
    for (n, p), (_, q) in zip(straight.module.named_parameters(), resumed.module.named_parameters(), strict=True):
        assert torch.equal(p, q), n


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_a_resume_between_the_steps_of_one_rollout_makes_a_fresh_one(tiny_train_model, prompts_file, tmp_path,
                                                                      algorithm) -> None:
    """num_iterations 2, a checkpoint at step 1: the resumed step 2 would reuse a rollout the new process never
    made; it makes a fresh one (TRL's buffer is empty after a resume), and step 3 its own."""
    fields = dict(max_steps=3, save_steps=1, num_iterations=2)
    first = _trainer(algorithm, tiny_train_model, prompts_file, tmp_path, **fields)
    interrupt_at(first, 2)
    with pytest.raises(Interrupted):
        first.train()
    resumed = _trainer(algorithm, tiny_train_model, prompts_file, tmp_path, resume_from_checkpoint=True, **fields)
    made, collect = [], resumed.algorithm.collect
    resumed.algorithm.collect = lambda: made.append(1) or collect()  # type: ignore[method-assign]
    resumed.train()
    assert len(made) == 2 and [r["step"] for r in metric_rows(tmp_path) if "reward" in r] == [1, 2, 3]


def _trainer(algorithm: str, model_dir: Path, prompts_file: Path, output_dir: Path, **fields) -> Trainer:
    if algorithm == "rloo":
        return rloo_trainer(model_dir, prompts_file, output_dir, **fields)
    algo = grpo(model_dir, prompts_file, output_dir=str(output_dir), per_device_train_batch_size=4,
                max_completion_length=8, report_to=["jsonl"], **fields)
    return Trainer(algo.config, algo, DistInfo(), progress=False)


def test_config_has_trls_names_and_defaults_and_refuses_what_rloo_lacks() -> None:
    theirs, ours = trl.RLOOConfig(output_dir="x", use_cpu=True, bf16=False), RLOOConfig()
    for key in ("num_generations", "beta", "epsilon", "epsilon_high", "num_iterations", "normalize_advantages",
                "reward_clip_range", "max_completion_length", "temperature", "top_p", "top_k", "min_p",
                "mask_truncated_completions", "learning_rate", "reward_weights", "router_aux_loss_coef"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert (ours.num_generations, ours.beta) == (2, 0.05)
    with pytest.raises(TrainConfigError, match=r"^num_generations: a group needs >= 2 completions, got 1"):
        load_config(RLOOConfig, None, ["num_generations=1"])
    with pytest.raises(ValueError, match=r"^command line: unknown key 'loss_type' for RLOOConfig"):
        load_config(RLOOConfig, None, ["loss_type=dapo"])  # GRPO's, not TRL's RLOOConfig's
    with pytest.raises(ValueError, match=r"^command line: 'vllm_importance_sampling_correction' is TRL's name "
                                         r"for 'tis_correction', which RLOOConfig does not have"):
        load_config(RLOOConfig, None, ["vllm_importance_sampling_correction=true"])
    with pytest.raises(TrainConfigError, match=r"^reward_clip_range: expected null or \[min, max\]"):
        load_config(RLOOConfig, None, ["reward_clip_range=[1, 0]"])
    assert load_config(RLOOConfig, None, ["reward_clip_range=[-1, 1]"]).reward_clip_range == [-1.0, 1.0]
    assert {f.name for f in dataclasses.fields(RLOOConfig)} >= {"normalize_advantages", "reward_clip_range"}
