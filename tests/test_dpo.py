"""DPO on the trainer loop: the gradient does not depend on the micro-batch split, it learns a
held-out preference, it resumes exactly, and the command line names a bad row's file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from preference_data import dpo_trainer, preference_rows
from test_trainer_accumulation import assert_grads_close, step_grads
from test_trainer_resume import Interrupted, interrupt_at, metric_rows
from tiny_train import build_model_dir

from pagedrl.train.cli import train_main
from pagedrl.train.logging import read_metrics

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
DPO_METRICS = ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
               "logps/rejected", "logits/chosen", "logits/rejected")


@pytest.fixture(scope="module")
def other_model(tmp_path_factory) -> str:
    return str(build_model_dir(tmp_path_factory.mktemp("tiny-ref") / "model", seed=1))


@pytest.mark.parametrize("fields", [dict(loss_type="sigmoid", label_smoothing=0.1),
                                    dict(loss_type="ipo", precompute_ref_log_probs=True),
                                    # per-pair options: WPO's weights, f-DPO's scores, LD-DPO's sums
                                    dict(loss_type="sigmoid_norm", use_weighting=True,
                                         f_divergence_type="js_divergence", ld_alpha=0.5)])
def test_accumulated_gradient_equals_one_batch(tiny_train_model, other_model, tmp_path, fields) -> None:
    from pagedrl.model.loader import load_model

    rows = preference_rows(8, seed=5, chat_every=2)
    # A reference that differs from the policy, so every term of the loss counts.
    one = dpo_trainer(tiny_train_model, tmp_path / "one", rows, reference=load_model(other_model).model,
                      per_device_train_batch_size=8, **fields)
    four = dpo_trainer(tiny_train_model, tmp_path / "four", rows, reference=load_model(other_model).model,
                       per_device_train_batch_size=2, gradient_accumulation_steps=4, **fields)
    loss, grads, metrics = step_grads(one)
    loss4, grads4, metrics4 = step_grads(four)
    assert abs(loss - loss4) < 1e-5 and loss != pytest.approx(0.6931, abs=1e-3)
    assert_grads_close(grads, grads4)
    for name in DPO_METRICS:
        assert metrics4[name] == pytest.approx(metrics[name], abs=1e-5), name
    smoothed = any("trains conservative DPO (cDPO); TRL 1.16's sigmoid ignores" in line
                   for line in one.algorithm.summary_lines())
    assert smoothed == ("label_smoothing" in fields)  # the one loss that differs from TRL's says so at start-up


def test_dpo_learns_a_held_out_preference(tiny_train_model, tmp_path) -> None:
    trainer = dpo_trainer(tiny_train_model, tmp_path, preference_rows(64, seed=0, chat_every=3),
                          preference_rows(32, seed=1, chat_every=3), max_steps=16, eval_steps=16, warmup_steps=2)
    reference = {n: p.detach().clone() for n, p in trainer.algorithm.reference.named_parameters()}
    trainer.train()
    evals = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 16]
    assert evals[0]["eval/rewards/accuracies"] == 0.0  # policy = reference: every reward is 0
    assert evals[-1]["eval/rewards/accuracies"] >= 0.9, evals[-1]
    assert evals[-1]["eval/loss"] < evals[0]["eval/loss"]
    for name, p in trainer.algorithm.reference.named_parameters():  # the reference stayed frozen
        assert torch.equal(p, reference[name]) and p.grad is None, name


@pytest.mark.parametrize("extra", [dict(precompute_ref_log_probs=False), dict(precompute_ref_log_probs=True),
                                   dict(sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)])
def test_resume_equals_uninterrupted_run(tiny_train_model, tmp_path, extra) -> None:
    """The reference after a resume is still the starting policy, not the checkpoint's weights; with TR-DPO's
    sync_ref_model, the reference as mixed up to the checkpoint's step."""
    fields = dict(max_steps=4, save_steps=2, per_device_train_batch_size=4, **extra)
    rows = preference_rows(16, seed=2)
    dpo_trainer(tiny_train_model, tmp_path / "a", rows, **fields).train()
    first = dpo_trainer(tiny_train_model, tmp_path / "b", rows, **fields)
    interrupt_at(first, 3)
    with pytest.raises(Interrupted):
        first.train()
    dpo_trainer(tiny_train_model, tmp_path / "b", rows, resume_from_checkpoint=True, **fields).train()
    expected, got = metric_rows(tmp_path / "a"), metric_rows(tmp_path / "b")
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    assert got == expected


def test_command_line_names_the_bad_row(tiny_train_model, tmp_path, capsys) -> None:
    data = tmp_path / "prefs.jsonl"
    good = [json.dumps(r) for r in preference_rows(4)]
    data.write_text("\n".join(good[:2] + ['{"prompt": "hi", "chosen": " yes"}'] + good[2:]) + "\n")
    out = tmp_path / "run"
    args = [f"model={tiny_train_model}", f"dataset={data}", f"output_dir={out}", "max_steps=1",
            "per_device_train_batch_size=2"]
    assert train_main("dpo", args) == 1
    assert f"{data}:3: rejected: missing" in capsys.readouterr().err
    assert train_main("dpo", args + ["on_bad_row=skip"]) == 0
    assert f"skipped 1: missing 'rejected' (first at {data}:3)" in capsys.readouterr().out


def test_example_config_runs(tiny_train_model, tmp_path) -> None:
    """examples/dpo.yaml with its data, on the tiny model for speed."""
    out = tmp_path / "run"
    assert train_main("dpo", [str(EXAMPLES / "dpo.yaml"), f"model={tiny_train_model}", f"output_dir={out}",
                              f"dataset={EXAMPLES / 'data' / 'prefs.jsonl'}", "max_steps=2", "logging_steps=1"]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert set(DPO_METRICS) <= set(rows[-1])
    assert (out / "final" / "model.safetensors").is_file()


def test_padding_free_trains_as_padded_and_says_so(tiny_train_model, other_model, tmp_path) -> None:
    """TRL 1.16's DPOTrainer takes `padding_free: true`, warns, and pads as with false; here too the pair rows
    are padded either way, so the first step's loss and gradients are the same, and a start-up line says it."""
    from pagedrl.model.loader import load_model

    rows = preference_rows(8, seed=3, chat_every=2)
    runs = [dpo_trainer(tiny_train_model, tmp_path / str(flag), rows, reference=load_model(other_model).model,
                        padding_free=flag) for flag in (False, True)]
    (loss, grads, _), (loss_free, grads_free, _) = (step_grads(t) for t in runs)
    assert loss_free == loss and loss != pytest.approx(0.6931, abs=1e-3)
    assert_grads_close(grads, grads_free, atol=0.0)
    said = [[line for line in t.algorithm.summary_lines() if "padding_free" in line] for t in runs]
    assert said[0] == [] and len(said[1]) == 1
    assert "padded to the micro-batch's longest pair" in said[1][0] and "falls back to padding" in said[1][0]
