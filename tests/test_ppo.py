"""PPO end to end on a tiny model: every role, every TRL metric, the first mini-batch's ratio of
exactly 1, checkpoints of policy and critic, bit-exact resume mid-rollout, and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagedrl.model.heads import load_sequence_scorer, save_sequence_scorer
from pagedrl.model.loader import load_model
from pagedrl.model.tokenizer import Tokenizer
from pagedrl.train.algorithms.ppo import run_ppo
from pagedrl.train.logging import read_metrics
from pagedrl.train.rl.config import PPOConfig

TIME_KEYS = {"wall_time", "train_time", "step_time", "rollout/seconds", "rollout/tokens_per_second"}
TRL_METRICS = ("objective/scores", "objective/kl", "objective/entropy", "objective/non_score_reward",
               "objective/rlhf_reward", "policy/approxkl_avg", "policy/clipfrac_avg", "policy/entropy_avg",
               "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "val/ratio", "val/num_eos_tokens",
               "critic/vf_explained_var", "completions/mean_length", "sampling/sampling_logp_difference/mean",
               "sampling/sampling_logp_difference/max", "step_time", "wall_time", "train_time")
REWARDS = """
calls = []

def has_three(completions, **kwargs):
    return [float("three" in (c[0]["content"] if isinstance(c, list) else c)) for c in completions]

def nan_on_second_rollout(completions, **kwargs):
    calls.append(1)
    return [None if len(calls) > 1 else 1.0 for _ in completions]  # None: not applicable
"""


@pytest.fixture(scope="module")
def reward_model_dir(tiny_train_model, tmp_path_factory) -> Path:
    """A one-label sequence classifier on the tiny model's backbone and tokenizer (a fresh head)."""
    folder = tmp_path_factory.mktemp("tiny-rm") / "rm"
    scorer = load_sequence_scorer(tiny_train_model, generator=torch.Generator().manual_seed(3))
    save_sequence_scorer(scorer, folder)
    Tokenizer.from_folder(tiny_train_model).save(folder)
    return folder


def ppo_config(model_dir: Path, out: Path, **fields) -> PPOConfig:
    (out.parent / "rewards.py").write_text(REWARDS)
    defaults = dict(model=str(model_dir), dataset="arithmetic", task_num_eval=4, task_low=1, task_high=9,
                    output_dir=str(out), num_generations=2, per_device_train_batch_size=4,
                    gradient_accumulation_steps=2, num_mini_batches=2, num_ppo_epochs=1, max_completion_length=8,
                    max_steps=2, logging_steps=1, save_steps=100, learning_rate=1e-3, report_to=["jsonl"],
                    kl_coef=0.1, eval_steps=2)
    return PPOConfig(**{**defaults, **fields})


def rows_of(out: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in read_metrics(out / "metrics.jsonl")]


def test_a_two_step_run_with_a_reward_model_logs_every_metric(tiny_train_model, reward_model_dir, tmp_path) -> None:
    out = tmp_path / "run"
    final = run_ppo(ppo_config(tiny_train_model, out, reward_model_path=str(reward_model_dir)), progress=False)
    rows = read_metrics(out / "metrics.jsonl")
    train = [r for r in rows if "loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for name in TRL_METRICS:
        assert name in train[0] and name in train[1], name
    assert [r["step"] for r in rows if "eval/accuracy" in r] == [0, 2]
    # The first mini-batch of the first epoch is the same computation as the fixed pass.
    assert train[0]["val/ratio"] == 1.0 and train[0]["policy/clipfrac_avg"] == 0.0
    assert train[0]["policy/approxkl_avg"] == 0.0 and train[0]["objective/kl"] == 0.0  # policy == reference
    # engine and trainer agree: two float32 forwards of the same weights at temperature 1, nothing cut,
    # each within `decoder_bound`'s ~3e-5 of the exact log-probs on this model
    assert train[0]["sampling/sampling_logp_difference/max"] < 1e-4
    assert train[1]["val/ratio"] != 1.0  # the second mini-batch sees the first update
    # final/: the policy ready to serve, the critic beside it; both load.
    policy = load_model(final).model
    critic = load_sequence_scorer(final / "critic", new_head=False)
    assert policy.config.architecture.endswith("ForCausalLM")
    assert critic.config.architecture.endswith("ForSequenceClassification")
    start = load_sequence_scorer(reward_model_dir, new_head=False)
    assert not torch.equal(critic.score.weight, start.score.weight)  # trained from the reward model
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert {"prompt", "completion", "score", "step"} <= set(samples[0])


@pytest.mark.parametrize("batch_invariant", [None, False])
def test_bf16_rollouts_carry_the_policys_own_log_probs(wide_train_model, tmp_path, batch_invariant) -> None:
    """Under bf16 autocast on a CPU the rollout engine and the policy's fixed pass are batch-invariant
    by default: every sampled log-prob is the policy's own, bit for bit; without it, bf16's
    roundings put them apart."""
    out = tmp_path / "run"
    fields = dict(critic="shared", reward_funcs=[f"{tmp_path}/rewards.py:has_three"], num_mini_batches=1,
                  max_steps=1, eval_steps=None, bf16=True, temperature=0.7, max_completion_length=12,
                  num_generations=4, per_device_train_batch_size=8, batch_invariant=batch_invariant)
    run_ppo(ppo_config(wide_train_model, out, **fields), progress=False)
    gap = read_metrics(out / "metrics.jsonl")[-1]["sampling/sampling_logp_difference/max"]
    assert gap == 0.0 if batch_invariant is None else gap > 1e-3


def test_resume_mid_rollout_equals_the_uninterrupted_run(tiny_train_model, tmp_path) -> None:
    """Shared critic, a verifier for the reward, the adaptive KL controller: two steps per rollout,
    resumed from the checkpoint between them."""
    fields = dict(critic="shared", reward_funcs=[f"{tmp_path}/rewards.py:has_three"], kl_target=0.01,
                  num_mini_batches=1, num_ppo_epochs=2, max_steps=4, save_steps=1, eval_steps=None)
    run_ppo(ppo_config(tiny_train_model, tmp_path / "a", **fields), progress=False)
    expected = rows_of(tmp_path / "a")
    shutil.copytree(tmp_path / "a" / "checkpoint-3", tmp_path / "b" / "checkpoint-3")
    final = run_ppo(ppo_config(tiny_train_model, tmp_path / "b", resume_from_checkpoint=True, **fields),
                    progress=False)
    got = rows_of(tmp_path / "b")
    assert [r["step"] for r in got] == [4] and got == expected[3:]
    a = load_model(tmp_path / "a" / "final").model.state_dict()
    b = load_model(final).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    head = load_sequence_scorer(final / "critic", new_head=False).score.weight
    assert torch.equal(head, load_sequence_scorer(tmp_path / "a" / "final" / "critic", new_head=False).score.weight)
    assert expected[0]["objective/kl_coef"] != expected[2]["objective/kl_coef"]  # adapted after rollout 1


def test_a_reward_model_with_another_tokenizer_is_refused(tiny_train_model, reward_model_dir, tmp_path) -> None:
    other = tmp_path / "other-rm"
    shutil.copytree(reward_model_dir, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    token = next(t for t, i in vocab.items() if i == 100)
    vocab["zzzz"] = vocab.pop(token)
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match=rf"reward_model_path: the tokenizer of {other} differs from the policy's "
                                         rf"\({tiny_train_model}\)"):
        run_ppo(ppo_config(tiny_train_model, tmp_path / "run", reward_model_path=str(other)), progress=False)


def test_a_nan_reward_stops_the_run_and_keeps_the_last_checkpoint(tiny_train_model, tmp_path) -> None:
    out = tmp_path / "run"
    config = ppo_config(tiny_train_model, out, reward_funcs=[f"{tmp_path}/rewards.py:nan_on_second_rollout"],
                        num_mini_batches=1, max_steps=3, save_steps=1, eval_steps=None)
    with pytest.raises(ValueError, match="step 2: 8 reward score\\(s\\) are NaN or infinite"):
        run_ppo(config, progress=False)
    assert (out / "checkpoint-1" / "config.json").is_file() and not (out / "checkpoint-2").exists()
    load_model(out / "checkpoint-1")
    load_sequence_scorer(out / "checkpoint-1" / "critic", new_head=False)


def test_the_reward_model_reads_where_it_was_trained_to() -> None:
    """The read position comes from each completion's length; only its last token is compared with the
    reward model's pad id (= EOS for SmolLM2): a completion ending in it is read one token earlier,
    as transformers' rule (and `pagedrl rm`) read it; others at their last token."""
    from pagedrl.train.algorithms.ppo_rollout import reward_rows
    from pagedrl.train.examples import PromptOnly
    from pagedrl.train.rl.packing import pack, split_units
    from pagedrl.train.rl.rollout import Rollout

    EOS = 2
    comps = [[5, 6, EOS], [7, 8], [EOS], [9, EOS, 4]]  # ends in EOS; no EOS; only EOS; EOS inside
    rollout = Rollout([PromptOnly([1, 3, 3], "", ""), PromptOnly([1, 4], "", "")], 2, comps, [""] * 4,
                      [[0.0] * len(c) for c in comps], torch.zeros(4, dtype=torch.bool))
    (units,) = split_units(rollout, 1)
    b = pack(rollout, units, torch.device("cpu"))
    ids = b.input_ids[0]
    rows = reward_rows(b, pad_token_id=EOS)
    assert [int(ids[r]) for r in rows] == [6, 8, EOS, 4]
    assert torch.equal(reward_rows(b, pad_token_id=None), b.last_at)
    assert [int(ids[r]) for r in b.last_at] == [EOS, 8, EOS, 4]
