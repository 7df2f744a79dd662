"""`pagedrl kto` end to end on the tiny model: the example config runs and logs TRL's metric names, KTO moves the
policy's rewards the labels' way, a run resumes exactly, KL completions follow TRL's blocks, and bad rows and
settings are refused naming the file and row or the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from preference_data import dpo_trainer, unpaired_rows
from test_trainer_resume import Interrupted, interrupt_at, metric_rows

from pagedrl.train.cli import train_main
from pagedrl.train.logging import read_metrics
from pagedrl.train.unpaired import UNPAIR_BLOCK, Unpaired, pair_kl, unpair

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
KTO_METRICS = ("loss", "kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
               "logits/chosen", "logits/rejected", "entropy", "num_tokens")


def test_example_config_runs(tiny_train_model, tmp_path) -> None:
    """examples/kto.yaml with its data, on the tiny model for speed: TRL's metric names, and a model saved."""
    out = tmp_path / "run"
    assert train_main("kto", [str(EXAMPLES / "kto.yaml"), f"model={tiny_train_model}", f"output_dir={out}",
                              f"dataset={EXAMPLES / 'data' / 'feedback.jsonl'}", "max_steps=2"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert set(KTO_METRICS) <= set(rows[-1])
    assert (out / "final" / "model.safetensors").is_file()


def test_kto_raises_the_desirable_rewards_over_the_undesirable(tiny_train_model, tmp_path) -> None:
    trainer = dpo_trainer(tiny_train_model, tmp_path, unpaired_rows(32, seed=0, chat_every=3),
                          unpaired_rows(32, seed=1, chat_every=3), kto=True, max_steps=12, eval_steps=12,
                          per_device_train_batch_size=8, warmup_steps=2)
    reference = {n: p.detach().clone() for n, p in trainer.algorithm.reference.named_parameters()}
    trainer.train()
    evals = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 12]
    assert evals[0]["eval/rewards/margins"] == 0.0  # policy = reference: every reward is 0
    assert evals[-1]["eval/rewards/margins"] > 0.25, evals[-1]  # β·4.7 nats here
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    for name, p in trainer.algorithm.reference.named_parameters():  # the reference stayed frozen
        assert torch.equal(p, reference[name]) and p.grad is None, name


@pytest.mark.parametrize("extra", [dict(precompute_ref_log_probs=False), dict(precompute_ref_log_probs=True),
                                   dict(loss_type="apo_zero_unpaired", train_sampling_strategy="random")])
def test_resume_equals_uninterrupted_run(tiny_train_model, tmp_path, extra) -> None:
    fields = dict(max_steps=4, save_steps=2, per_device_train_batch_size=4, kto=True, **extra)
    rows = unpaired_rows(10, seed=2)  # blocks of 4, 4, 2 rows: step 3 ends the epoch on its short block
    dpo_trainer(tiny_train_model, tmp_path / "a", rows, **fields).train()
    first = dpo_trainer(tiny_train_model, tmp_path / "b", rows, **fields)
    interrupt_at(first, 3)
    with pytest.raises(Interrupted):
        first.train()
    dpo_trainer(tiny_train_model, tmp_path / "b", rows, resume_from_checkpoint=True, **fields).train()
    expected, got = metric_rows(tmp_path / "a"), metric_rows(tmp_path / "b")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert got == expected


def test_kl_completions_are_the_blocks_completions_shifted_by_one() -> None:
    """TRL's (x₁, y_n), (x₂, y₁), …, (x_n, y_{n-1}) in each block of rows, a short last block too; the KL
    completion cut so that its prompt and it fit max_length."""
    rows = [Unpaired([i] * (i + 1), [10 + i], i % 2 == 0, f"r{i}", [10 + i] * 3) for i in range(5)]
    pair_kl(rows, 3, None)
    assert [r.kl_completion_ids for r in rows] == [[12] * 3, [10] * 3, [11] * 3, [14] * 3, [13] * 3]
    pair_kl(rows, 2, 5)  # prompts of 1 to 5 tokens: room for 4, 3, 2, 1, 0 KL tokens
    assert [r.kl_completion_ids for r in rows] == [[11] * 3, [10] * 3, [13] * 2, [12], []]


def test_paired_rows_are_unpaired_in_trls_order() -> None:
    """TRL's unpair_preference_dataset maps blocks of 1000 pairs: each block's chosen answers, then its rejected."""
    def row(i: int, good: bool) -> Unpaired:
        return Unpaired([1], [2], good, f"{i}{'+' if good else '-'}", [2])
    out = unpair([(row(i, True), row(i, False)) for i in range(UNPAIR_BLOCK + 2)], "dataset")
    expected = [f"{i}+" for i in range(UNPAIR_BLOCK)] + [f"{i}-" for i in range(UNPAIR_BLOCK)] + \
        ["1000+", "1001+", "1000-", "1001-"]
    assert [r.where for r in out] == expected


@pytest.mark.parametrize(("row", "says"), [
    ({"prompt": "hi", "completion": " yes"}, "label: missing"),
    ({"prompt": "hi", "completion": " yes", "label": "true"}, "label: expected true or false, got a string 'true'"),
    ({"prompt": "hi", "completion": " yes", "label": 1}, "label: expected true or false, got a number 1"),
    ({"prompt": "hi", "completion": "", "label": True}, "completion: empty string"),
    ({"prompt": "hi", "chosen": " a", "rejected": " b"},
     "a paired {prompt, chosen, rejected} row in a dataset of {prompt, completion, label} rows"),
    ({"prompt": "hi", "chosen": " a", "rejected": " b", "label": True}, "label: a paired row's answers"),
])
def test_command_line_names_the_bad_row(tiny_train_model, tmp_path, capsys, row, says) -> None:
    data = tmp_path / "feedback.jsonl"
    good = [json.dumps(r) for r in unpaired_rows(4)]
    data.write_text("\n".join(good[:2] + [json.dumps(row)] + good[2:]) + "\n")
    args = [f"model={tiny_train_model}", f"dataset={data}", f"output_dir={tmp_path / 'run'}", "max_steps=1",
            "per_device_train_batch_size=2"]
    assert train_main("kto", args) == 1
    assert f"{data}:3: {says}" in capsys.readouterr().err


@pytest.mark.parametrize(("setting", "says"), [
    ("loss_type=sigmoid", "loss_type: expected one of 'kto', 'apo_zero_unpaired'"),
    ("train_sampling_strategy=random", "train_sampling_strategy: the kto loss estimates its KL term"),
    ("train_sampling_strategy=group_by_length", "train_sampling_strategy: expected one of 'sequential', 'random'"),
    ("per_device_train_batch_size=1", "per_device_train_batch_size: the kto loss estimates its KL term"),
    ("undesirable_weight=-1", "undesirable_weight: must be a finite number >= 0"),
    ("label_smoothing=0.1", "label_smoothing"),  # DPO's, not KTO's
    ("activation_offloading=true", "activation_offloading: only false"),
    ("beta=0", "beta: must be > 0"),
])
def test_settings_trl_refuses_or_pagedrl_lacks_are_refused_naming_the_key(tmp_path, capsys, setting, says) -> None:
    assert train_main("kto", [f"output_dir={tmp_path}", "dataset=x.jsonl", setting]) == 2
    err = capsys.readouterr().err
    assert says in err and err.count("\n") == 1, err


def test_lora_takes_the_base_as_reference(tiny_train_model, tmp_path) -> None:
    """With LoRA the reference is the base model (the adapters off, no copy): at the first step the adapters
    are zero, so the policy is the reference and the loss is the full model's, β·0 rewards and KL 0."""
    data = tmp_path / "feedback.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in unpaired_rows(8, seed=4)))
    runs = {}
    for name, extra in (("full", []), ("lora", ["use_peft=true", "lora_target_modules=[all-linear]", "lora_r=4"])):
        out = tmp_path / name
        assert train_main("kto", [f"model={tiny_train_model}", f"dataset={data}", f"output_dir={out}", "max_steps=2",
                                  "per_device_train_batch_size=4", "learning_rate=1e-3", "logging_steps=1",
                                  *extra]) == 0
        runs[name] = [r for r in read_metrics(out / "metrics.jsonl") if "loss" in r]
    first = runs["lora"][0]
    assert first["loss"] == pytest.approx(runs["full"][0]["loss"], abs=1e-6)
    assert (first["kl"], first["rewards/chosen"], first["rewards/rejected"]) == (0.0, 0.0, 0.0)
    assert runs["lora"][1]["rewards/margins"] != 0.0  # the adapters moved the policy off the base
    assert (tmp_path / "lora" / "final" / "adapter_model.safetensors").is_file()
