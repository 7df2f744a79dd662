"""The reward model: split-independent gradients, learning a held-out preference, a checkpoint
that transformers loads as `LlamaForSequenceClassification` with the same scores, and batched
scoring of (prompt, response) pairs."""

from __future__ import annotations

import json
from pathlib import Path

import decoder_bound
import pytest
import torch
from float_bounds import EXP_ERROR, U, gamma
from preference_data import preference_rows, rm_trainer
from test_trainer_accumulation import assert_grads_close, step_grads
from tiny import BASE, hf_model

from pagedrl.model.checkpoint import CheckpointError
from pagedrl.model.heads import load_sequence_scorer, score_index
from pagedrl.train.algorithms.rm import answer_scores
from pagedrl.train.cli import train_main
from pagedrl.train.logging import read_metrics
from pagedrl.train.rl.reward_model import RewardModel

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
RM_METRICS = ("accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens")


def with_margins(rows: list[dict]) -> list[dict]:
    return [{**r, "margin": 0.25 * (i % 3)} for i, r in enumerate(rows)]


@pytest.mark.parametrize("fields", [dict(), dict(center_rewards_coefficient=0.05)])
def test_accumulated_gradient_equals_one_batch(tiny_train_model, tmp_path, fields) -> None:
    rows = with_margins(preference_rows(8, seed=6, chat_every=2))
    one = rm_trainer(tiny_train_model, tmp_path / "one", rows, per_device_train_batch_size=8, **fields)
    four = rm_trainer(tiny_train_model, tmp_path / "four", rows, per_device_train_batch_size=2,
                      gradient_accumulation_steps=4, **fields)
    loss, grads, metrics = step_grads(one)
    loss4, grads4, metrics4 = step_grads(four)
    assert abs(loss - loss4) < 1e-5
    assert_grads_close(grads, grads4)
    assert grads["score.weight"].abs().sum() > 0
    for name in RM_METRICS:
        assert metrics4[name] == pytest.approx(metrics[name], abs=1e-5), name


def test_step_loss_equals_trl_formula_on_transformers_scores(tiny_train_model, tmp_path) -> None:
    """Reference: the fresh head saved, loaded in transformers, TRL's RewardTrainer.compute_loss
    formula on its scores of prompt+chosen and prompt+rejected as separate padded rows."""
    from transformers import AutoModelForSequenceClassification

    rows = with_margins(preference_rows(6, seed=7, chat_every=2))
    trainer = rm_trainer(tiny_train_model, tmp_path, rows, per_device_train_batch_size=6,
                         center_rewards_coefficient=0.1)
    algorithm = trainer.algorithm
    pairs = algorithm.examples
    batch = algorithm.collate(pairs)
    loss, metrics = algorithm.loss(trainer.handle, batch, torch.tensor(6.0))
    algorithm.save_model(tmp_path / "saved")
    hf = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "saved"), dtype=torch.float32)
    seqs = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    exact = exact_scores(algorithm.model, seqs, algorithm.pad_id, hf)
    margin = torch.tensor([p.margin for p in pairs], dtype=torch.float64)

    def formula(scores: torch.Tensor) -> torch.Tensor:
        chosen, rejected = scores.chunk(2)
        return -torch.nn.functional.logsigmoid(chosen - rejected - margin).mean() + 0.1 * torch.mean((chosen + rejected) ** 2)

    # The loss's own float32 roundings on top of its scores' errors: the differences, logsigmoid (an
    # exp and a log), the squares, the sums over 6 pairs and the divisions.
    chosen, rejected = exact.exact.chunk(2)
    terms = torch.nn.functional.logsigmoid(chosen - rejected - margin).abs() + 0.1 * (chosen + rejected) ** 2
    own = (2 * EXP_ERROR + gamma(8)) * terms.mean() + 2 * U * (chosen.abs() + rejected.abs() + margin).mean()
    expected = exact.map(formula)
    assert abs(float(loss.detach()) - float(expected.exact)) <= float(expected.bound()) + float(own)
    for got in (answer_scores(algorithm.model, batch).detach(), hf_scores(hf, seqs, algorithm.pad_id)):
        assert ((got.double() - exact.exact).abs() <= exact.bound()).all()
    bound = exact.bound()
    assert ((chosen - rejected).abs() > bound[:6] + bound[6:]).all()  # each comparison decided in float32
    assert float(metrics["accuracy"].total) / 6 == pytest.approx(float((chosen > rejected).double().mean()))


def hf_scores(hf, seqs: list[list[int]], pad_id: int) -> torch.Tensor:
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        return hf(input_ids=ids, attention_mask=mask).logits.squeeze(-1)


def exact_scores(model, seqs: list[list[int]], pad_id: int, hf) -> decoder_bound.Probed:
    """The scores [N] of a `SequenceScorer` at each sequence's last token that is not the pad token,
    exact and on `decoder_bound`'s perturbed forwards: what any float32 forward of them is within
    the bound of (~5e-6 of scores of ~0.1 here), transformers' (`hf`, whose rotary frequencies are
    its own float32 ones) included."""
    width = max(map(len, seqs))
    ids = torch.tensor([s + [pad_id] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    at = torch.tensor([score_index(s, pad_id) for s in seqs])
    freq_error = (hf.model.rotary_emb.inv_freq.double() - model.model.inv_freq.double()).abs()
    probed = decoder_bound.logits(model, ids, mask, freq_error=freq_error, head=model.score)
    return probed.map(lambda v: v[torch.arange(len(seqs)), at, 0])


def test_reward_model_learns_a_held_out_preference(tiny_train_model, tmp_path) -> None:
    trainer = rm_trainer(tiny_train_model, tmp_path, preference_rows(64, seed=0, chat_every=3),
                         preference_rows(32, seed=1, chat_every=3), max_steps=16, eval_steps=16, warmup_steps=2)
    trainer.train()
    evals = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 16]
    assert evals[-1]["eval/accuracy"] >= 0.9, evals[-1]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    train_rows = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "accuracy" in r]
    assert set(RM_METRICS) <= set(train_rows[-1])
    assert train_rows[-1]["min_reward"] <= train_rows[-1]["mean_reward"] <= train_rows[-1]["max_reward"]


@pytest.fixture(scope="module")
def trained_rm(tiny_train_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("rm-run")
    trainer = rm_trainer(tiny_train_model, out, preference_rows(16, seed=0, chat_every=2), max_steps=3)
    return trainer.train()


def test_checkpoint_loads_in_transformers_with_the_same_scores(trained_rm) -> None:
    from transformers import AutoModelForSequenceClassification

    config = json.loads((trained_rm / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    hf = AutoModelForSequenceClassification.from_pretrained(str(trained_rm), dtype=torch.float32)
    assert type(hf).__name__ == "LlamaForSequenceClassification" and hf.config.num_labels == 1
    rm = RewardModel.from_pretrained(trained_rm, device="cpu")
    rows = preference_rows(7, seed=9, chat_every=2)
    pairs = [(r["prompt"], r["chosen"]) for r in rows] + [(r["prompt"], r["rejected"]) for r in rows]
    ours = torch.tensor(rm.score(pairs, batch_size=3))
    seqs = [rm.encode(*p) for p in pairs]
    exact = exact_scores(rm.network, seqs, rm.pad_token_id, hf)
    for got in (ours, hf_scores(hf, seqs, rm.pad_token_id), torch.tensor(rm.score(pairs, batch_size=len(pairs)))):
        assert ((got.double() - exact.exact).abs() <= exact.bound()).all()
    assert ours.std() > 1e-3  # trained scores that differ, so equality means something


def test_pad_token_equal_to_eos_is_skipped_as_transformers_does(tmp_path) -> None:
    """A Qwen2 classifier made by transformers, pad id = a token the sequences end with: both
    read the score at the last token that is not the pad token."""
    raw = dict(BASE, architectures=["Qwen2ForSequenceClassification"], model_type="qwen2", num_key_value_heads=2,
               num_labels=1, pad_token_id=2)
    hf = hf_model(raw)
    hf.save_pretrained(str(tmp_path / "hf"))
    ours = load_sequence_scorer(tmp_path / "hf", new_head=False)
    seqs = [[5, 6, 7, 2], [8, 9, 2, 10, 11], [12, 2, 2]]
    assert [score_index(s, 2) for s in seqs] == [2, 4, 0]
    exact = exact_scores(ours, seqs, 2, hf)
    with torch.no_grad():
        got = torch.stack([ours.scores(ours(torch.tensor([s]))[0, score_index(s, 2)]) for s in seqs])
    for scores in (got, hf_scores(hf, seqs, pad_id=2)):
        assert ((scores.double() - exact.exact).abs() <= exact.bound()).all()


def test_bad_arguments_are_named(trained_rm, tiny_train_model) -> None:
    rm = RewardModel.from_pretrained(trained_rm, device="cpu")
    with pytest.raises(ValueError, match="batch_size: must be a positive integer"):
        rm.score([("a", "b")], batch_size=0)
    with pytest.raises(ValueError, match=r"pairs\[1\]: expected a \(prompt, response\) pair"):
        rm.score([("a", "b"), "just text"])
    with pytest.raises(ValueError, match=r"pairs\[0\]: prompt and response must both be strings"):
        rm.score([("a", [{"role": "assistant", "content": "b"}])])
    with pytest.raises(CheckpointError, match="causal LM, not a trained reward model"):
        RewardModel.from_pretrained(tiny_train_model, device="cpu")


def test_example_config_runs_and_scores(tiny_train_model, tmp_path) -> None:
    """`pagedrl rm examples/rm.yaml` (on the tiny model for speed), then scoring with the result."""
    out = tmp_path / "run"
    assert train_main("rm", [str(EXAMPLES / "rm.yaml"), f"model={tiny_train_model}", f"output_dir={out}",
                             f"dataset={EXAMPLES / 'data' / 'prefs.jsonl'}", "max_steps=2"]) == 0
    assert set(RM_METRICS) <= set(read_metrics(out / "metrics.jsonl")[-1])
    scores = RewardModel.from_pretrained(out / "final", device="cpu").score(
        [("What is 2 + 2?", " 4"), ([{"role": "user", "content": "Hi"}], [{"role": "assistant", "content": "Hello"}])])
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)
