"""DPO's first batch against TRL 1.16's DPOTrainer on the same saved model, rows and settings:
the same tokens, the same per-answer log-probs (ours packed as [prompt, chosen, rejected] rows,
TRL's as two padded rows), the same loss and metrics."""

from __future__ import annotations

import pytest
import torch
from preference_data import dpo_trainer, preference_rows
from tiny_train import build_model_dir

from pagedrl.train.algorithms.dpo import answer_logps

PAIRS = 4  # one TRL micro-batch, one of ours
METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
           "logps/rejected", "logits/chosen", "logits/rejected")


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    """A second random model with the same tokenizer, as a reference that differs from the policy."""
    return str(build_model_dir(tmp_path_factory.mktemp("tiny-ref") / "model", seed=1))


def trl_first_batch(model_dir, ref_dir, rows, tmp_path, **settings):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32) if ref_dir else None
    args = DPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=PAIRS, bf16=False, use_cpu=True,
                     report_to="none", max_length=None, seed=0, **settings)
    trainer = DPOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(str(model_dir)))
    features = [trainer.train_dataset[i] for i in range(PAIRS)]
    batch = trainer.data_collator(features)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch)
    with torch.no_grad():
        chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)  # the policy's own log-probs
    metrics = {k: v[0] for k, v in trainer._metrics["train"].items()}
    return features, float(loss.detach()), torch.cat([chosen, rejected]), metrics


@pytest.mark.parametrize(("loss_type", "precompute", "other_ref", "chat"), [
    ("sigmoid", False, True, False),
    ("ipo", True, True, True),
    ("robust", False, False, True),
    ("hinge", True, False, False),
])
def test_first_batch_equals_trl_dpo_trainer(tiny_train_model, other_model, tmp_path, loss_type, precompute,
                                            other_ref, chat) -> None:
    rows = preference_rows(8, seed=3, chat_every=1 if chat else 0)
    ref_dir = other_model if other_ref else None
    smoothing = 0.2 if loss_type == "robust" else 0.0
    features, trl_loss, trl_logps, trl_metrics = trl_first_batch(
        tiny_train_model, ref_dir, rows, tmp_path, beta=0.3, loss_type=[loss_type], label_smoothing=smoothing,
        precompute_ref_log_probs=precompute)

    from pagedrl.model.loader import load_model

    # The same reference TRL got (run_dpo loads `ref_model` the same way), or a copy of the policy.
    reference = load_model(ref_dir).model if other_ref else None
    trainer = dpo_trainer(tiny_train_model, tmp_path / "ours", rows, reference=reference, beta=0.3,
                          loss_type=loss_type, label_smoothing=smoothing, precompute_ref_log_probs=precompute,
                          per_device_train_batch_size=PAIRS)
    algorithm = trainer.algorithm
    assert (algorithm.reference is None) == precompute  # precomputed: the reference is gone
    examples = algorithm.examples[:PAIRS]
    pairs = [getattr(e, "pair", e) for e in examples]
    for pair, feature in zip(pairs, features, strict=True):  # the same tokens, cut at the same place
        assert (pair.prompt_ids, pair.chosen_ids, pair.rejected_ids) == (
            feature["prompt_ids"], feature["chosen_ids"], feature["rejected_ids"])

    batch = algorithm.collate(examples)
    with torch.no_grad():
        ours_logps = answer_logps(algorithm.model, batch).logps
    torch.testing.assert_close(ours_logps, trl_logps, atol=1e-4, rtol=0)
    loss, metrics = algorithm.loss(trainer.handle, batch, torch.tensor(float(PAIRS)))
    assert float(loss.detach()) == pytest.approx(trl_loss, abs=1e-4)
    for name in METRICS:
        m = metrics[name]
        assert float(m.total) / float(m.weight) == pytest.approx(trl_metrics[name], abs=1e-4), name
    if other_ref:
        assert abs(trl_metrics["rewards/margins"]) > 1e-3  # a reference that differs, so the rewards count
    else:
        assert trl_metrics["rewards/margins"] == 0.0  # the reference is the starting policy
