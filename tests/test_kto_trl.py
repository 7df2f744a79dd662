"""KTO's first two micro-batches against TRL 1.16's KTOTrainer on the same saved model, rows and settings: the
same prompt, completion and KL completion tokens (the block's completions shifted by one), the same loss and
metrics, for a mixed block and a block of one label only (all desirable, or all undesirable)."""

from __future__ import annotations

import pytest
import torch
from preference_data import dpo_trainer, preference_rows, unpaired_rows
from tiny_train import build_model_dir

from pagedrl.train.metrics import MetricTotals

PER = 4  # rows per micro-batch, TRL's and ours
# Float32 forwards in a different order (ours: one packed row per completion and its KL completion; TRL's:
# two padded batches) round differently: summed log-probs of ~30 agree to ~1e-5 of their size.
TOLERANCE = dict(rel=5e-5, abs=5e-6)


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    """A second random model with the same tokenizer, as a reference that differs from the policy."""
    return str(build_model_dir(tmp_path_factory.mktemp("tiny-ref") / "model", seed=1))


def trl_blocks(model_dir, ref_dir, rows, tmp_path, **settings) -> list[tuple[list[dict], float, dict]]:
    """Each block of PER rows as one TRL micro-batch: its features, loss and metrics."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    policy = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32) if ref_dir else None
    args = KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=PER, bf16=False, use_cpu=True,
                     report_to="none", seed=0, **{"max_length": None, **settings})
    trainer = KTOTrainer(model=policy, ref_model=ref, args=args, train_dataset=Dataset.from_list(rows),
                         processing_class=AutoTokenizer.from_pretrained(str(model_dir)))
    trainer.model.train()
    out = []
    for start in range(0, len(rows), PER):
        features = [trainer.train_dataset[i] for i in range(start, start + PER)]
        trainer._metrics["train"].clear()
        loss = trainer.compute_loss(trainer.model, trainer.data_collator(features))
        out.append((features, float(loss.detach()), {k: v[0] for k, v in trainer._metrics["train"].items()}))
    return out


@pytest.mark.parametrize(("settings", "precompute", "other_ref", "chat", "second"), [
    # paired rows, unpaired as TRL does: the chosen answers (a block of desirable rows), then the rejected ones
    (dict(loss_type="kto"), False, True, True, "paired"),
    (dict(loss_type="kto"), False, True, False, True),
    (dict(loss_type="kto", desirable_weight=1.5, undesirable_weight=0.7), True, True, True, False),
    (dict(loss_type="apo_zero_unpaired", desirable_weight=0.5), False, False, False, False),
    (dict(loss_type="kto", undesirable_weight=2.0), True, False, False, True),
    # sequences cut to max_length by TRL's collator, the KL ones too
    (dict(loss_type="kto", max_length=14), False, True, False, True),
])
def test_first_batches_equal_trl_kto_trainer(tiny_train_model, other_model, tmp_path, settings, precompute,
                                             other_ref, chat, second) -> None:
    if second == "paired":
        rows = preference_rows(PER, seed=6, chat_every=1 if chat else 0)
    else:
        rows = unpaired_rows(2 * PER, seed=5, chat_every=1 if chat else 0)
        for i, row in enumerate(rows):  # a mixed block, then one of `second`'s label only
            row["label"] = i % 2 == 0 if i < PER else second
    ref_dir = other_model if other_ref else None
    theirs = trl_blocks(tiny_train_model, ref_dir, rows, tmp_path, beta=0.3, precompute_ref_log_probs=precompute,
                        **settings)

    from pagedrl.model.loader import load_model

    reference = load_model(ref_dir).model if other_ref else None
    trainer = dpo_trainer(tiny_train_model, tmp_path / "ours", rows, reference=reference, kto=True, beta=0.3,
                          precompute_ref_log_probs=precompute, per_device_train_batch_size=PER, **settings)
    algorithm = trainer.algorithm
    assert (algorithm.reference is None) == precompute
    model = algorithm.model.train()
    tokens = 0.0  # num_tokens: since the start
    window = MetricTotals()  # both micro-batches logged as one step: TRL's log() averages their values
    truncated = 0
    for k, (features, trl_loss, trl_metrics) in enumerate(theirs):
        examples = algorithm.examples[k * PER:(k + 1) * PER]
        cut = settings.get("max_length")
        for row, feature in zip((getattr(e, "pair", e) for e in examples), features, strict=True):
            prompt = feature["prompt_ids"]
            assert (row.prompt_ids, row.prompt_ids + row.completion_ids, row.desirable) == (
                prompt, (prompt + feature["completion_ids"])[:cut], feature["label"])
            assert row.prompt_ids + row.kl_completion_ids == (prompt + feature.get("KL_completion_ids", []))[:cut]
            truncated += len(row.completion_ids) < len(feature["completion_ids"])
        loss, metrics = algorithm.loss(model, algorithm.collate(examples), torch.tensor(float(PER)))
        assert float(loss.detach()) == pytest.approx(trl_loss, **TOLERANCE)
        assert set(metrics) == set(trl_metrics), k
        tokens += float(metrics["num_tokens"].total)
        for name, m in metrics.items():
            got = float(m.total) / float(m.weight) if m.reduce == "mean" else tokens
            assert got == pytest.approx(trl_metrics[name], **TOLERANCE), (k, name)
            window.add(name, m)
        if other_ref and k == 0:
            assert abs(trl_metrics.get("rewards/chosen", 0.0)) > 1e-3  # a reference that differs: rewards count
    assert (truncated > 0) == ("max_length" in settings)
    logged = window.values()
    for name in set(logged) - {"num_tokens"}:
        values = [m[name] for _, _, m in theirs if name in m]
        assert logged[name] == pytest.approx(sum(values) / len(values), **TOLERANCE), name
