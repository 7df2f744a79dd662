"""On-policy distillation end to end on a tiny student and a tiny teacher of the same vocabulary: the first
batch's loss and gradient are TRL's DistillationTrainer's on the same completions, a run logs TRL's metrics and resumes to
the same result, the example config runs, and bad input is refused naming what."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from test_grpo import write_prompts
from tiny_train import build_model_dir

from pagedrl.model.loader import load_model
from pagedrl.train.algorithms.distill import Distillation, DistillationConfig, run_distill, teacher_dtype
from pagedrl.train.cli import train_main
from pagedrl.train.config import load_config
from pagedrl.train.distributed import DistInfo
from pagedrl.train.logging import read_metrics
from pagedrl.train.metrics import MetricTotals

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TIME_KEYS = {"wall_time", "train_time", "step_time"}
TRL_METRICS = ("loss", "entropy", "num_tokens", "completions/mean_length", "completions/min_length",
               "completions/max_length", "completions/clipped_ratio", "completions/mean_terminated_length",
               "completions/min_terminated_length", "completions/max_terminated_length", "step_time")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """Another random model on the student's tokenizer (so the same vocabulary)."""
    return build_model_dir(tmp_path_factory.mktemp("tiny-teacher") / "model", seed=1, std=0.1)


@pytest.fixture()
def prompts(tmp_path) -> Path:
    return write_prompts(tmp_path)


def fields(student: Path, teacher: Path, prompts: Path, out: Path, **extra) -> dict:
    return dict(model=str(student), teacher_model_name_or_path=str(teacher), dataset=str(prompts),
                output_dir=str(out), per_device_train_batch_size=3, gradient_accumulation_steps=2,
                max_completion_length=8, temperature=0.9, beta=0.5, learning_rate=1e-3, logging_steps=1,
                save_steps=100, report_to=["jsonl"]) | extra


def test_first_batch_loss_and_gradient_are_trls_on_the_same_completions(tiny_train_model, teacher, prompts) -> None:
    from datasets import Dataset
    from trl import DistillationConfig as TRLConfig
    from trl import DistillationTrainer

    config = DistillationConfig(**fields(tiny_train_model, teacher, prompts, prompts.parent / "ours"))
    loaded = load_model(tiny_train_model)
    algo = Distillation(config, loaded.model.train(), loaded.tokenizer, DistInfo(), load_model(teacher).model,
                        eos_token_ids=loaded.eos_token_ids)
    batches = algo.step_batches(1)
    count = torch.tensor(sum(algo.count(b) for b in batches))
    ours = [algo.loss(algo.model, b, count) for b in batches]
    loss = sum(float(lo) for lo, _ in ours)
    sum(lo for lo, _ in ours).backward()
    totals = MetricTotals()
    for _, m in ours:
        totals.add("entropy", m["entropy"])
    rollout = algo.rollout
    assert rollout is not None and len(rollout) == 6 and int(count) == rollout.generated_tokens

    args = TRLConfig(output_dir=str(prompts.parent / "trl"), use_cpu=True, bf16=False, report_to=[],
                     gradient_checkpointing=False, temperature=0.9, beta=0.5)
    trl = DistillationTrainer(model=str(tiny_train_model), teacher_model=str(teacher), args=args,
                              train_dataset=Dataset.from_list([{"prompt": "unused"}]))
    theirs, entropy_of, tokens_of = 0.0, {}, {}
    for i in range(len(rollout)):  # one completion at a time: no padding, the step's token count as TRL's divisor
        p, c = torch.tensor([rollout.prompt_of(i).prompt_ids]), torch.tensor([rollout.completion_ids[i]])
        inputs = dict(prompt_ids=p, prompt_mask=torch.ones_like(p), completion_ids=c, completion_mask=torch.ones_like(c))
        part, ent, _ = trl._compute_loss(trl.model, inputs, count)
        part.backward()
        theirs += float(part)
        entropy_of[i], tokens_of[i] = float(ent), c.numel()
    # two float32 forwards of each model (transformers' and pagedrl's) and TRL's float32 kernel
    assert loss == pytest.approx(theirs, rel=1e-5) and loss > 1e-3
    # TRL's `entropy`: each micro-batch's token mean, averaged over the micro-batches (of unequal token counts)
    means = [sum(entropy_of[int(i)] for i in b.completion_index) / sum(tokens_of[int(i)] for i in b.completion_index)
             for b in batches]
    assert len({int(b.mask.sum()) for b in batches}) == 2
    assert totals.values()["entropy"] == pytest.approx(sum(means) / len(means), rel=1e-5)
    # the gradients too, tensor by tensor (the same names): ~5e-7 of each tensor's largest entry here
    trl_grads = {n: p.grad for n, p in trl.model.named_parameters()}
    for name, p in algo.model.named_parameters():
        assert float((p.grad - trl_grads[name]).abs().max()) <= 1e-5 * float(p.grad.abs().max()), name


def test_a_run_logs_trls_metrics_and_resumes_to_the_same_result(tiny_train_model, teacher, prompts) -> None:
    root = prompts.parent
    run_distill(DistillationConfig(**fields(tiny_train_model, teacher, prompts, root / "a", max_steps=3,
                                            save_steps=2, log_completions=True, num_completions_to_print=2)),
                progress=False)
    expected = [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in read_metrics(root / "a" / "metrics.jsonl")]
    rows = read_metrics(root / "a" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for name in TRL_METRICS:
        assert name in rows[0], name
    assert rows[0]["loss"] > rows[-1]["loss"]  # the student moves toward the teacher
    assert rows[1]["num_tokens"] > rows[0]["num_tokens"]
    assert (root / "a" / "completions.jsonl").read_text().count("\n") == 6
    shutil.copytree(root / "a" / "checkpoint-2", root / "b" / "checkpoint-2")
    final = run_distill(DistillationConfig(**fields(tiny_train_model, teacher, prompts, root / "b", max_steps=3,
                                                    save_steps=2, log_completions=True, num_completions_to_print=2,
                                                    resume_from_checkpoint=True)), progress=False)
    got = [{k: v for k, v in r.items() if k not in TIME_KEYS} for r in read_metrics(root / "b" / "metrics.jsonl")]
    assert [r["step"] for r in got] == [3] and got == expected[2:]
    a, b = load_model(root / "a" / "final").model.state_dict(), load_model(final).model.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_example_config_runs(tiny_train_model, teacher, tmp_path, monkeypatch, capsys) -> None:
    """examples/distill_arithmetic.yaml as shipped, its teacher the folder `pagedrl grpo
    examples/grpo_arithmetic.yaml` writes (a tiny model in its place, and the tiny student, for speed): refused
    naming that command while the folder is missing, then run with its held-out evaluation."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "examples").symlink_to(EXAMPLES)
    args = ["examples/distill_arithmetic.yaml", f"model={tiny_train_model}", "max_steps=1",
            "per_device_train_batch_size=2", "gradient_accumulation_steps=1", "max_completion_length=4",
            "task_num_eval=2", "eval_steps=1"]
    assert train_main("distill", args) == 1
    assert capsys.readouterr().err == ("pagedrl distill: error: teacher_model_name_or_path: runs/grpo_arithmetic/final "
                                       "is not a folder or file; `pagedrl grpo examples/grpo_arithmetic.yaml` writes it\n")
    shutil.copytree(teacher, tmp_path / "runs" / "grpo_arithmetic" / "final")
    assert train_main("distill", args) == 0
    rows = read_metrics(tmp_path / "runs" / "distill_arithmetic" / "metrics.jsonl")
    assert any("eval/accuracy" in r for r in rows) and any(r.get("loss", 0) > 0 for r in rows)


def test_a_teacher_of_another_vocabulary_is_refused(tiny_train_model, prompts, tmp_path) -> None:
    vocab = load_model(tiny_train_model).model.config.vocab_size
    other = build_model_dir(tmp_path / "other" / "model", vocab_size=vocab + 8)
    with pytest.raises(ValueError, match=rf"teacher_model_name_or_path: the teacher's vocabulary has {vocab + 8} "
                                         rf"tokens, the student's {vocab}"):
        run_distill(DistillationConfig(**fields(tiny_train_model, other, prompts, tmp_path / "run")), progress=False)
    with pytest.raises(ValueError, match="teacher_model_name_or_path: distillation needs a teacher"):
        run_distill(DistillationConfig(**fields(tiny_train_model, other, prompts, tmp_path / "run",
                                                teacher_model_name_or_path=None)), progress=False)


@pytest.mark.parametrize(("overrides", "message"), [
    (["teacher_model_name_or_path=t", "beta=1.5"], r"beta: must be in \[0.0, 1.0\], got 1.5"),
    (["teacher_model_name_or_path=t", "num_generations=4"], "num_generations: TRL's DistillationTrainer samples "
                                                            "one completion per prompt"),
    (["teacher_model_name_or_path=t", "teacher_model_init_kwargs={device_map: auto}"],
     "teacher_model_init_kwargs: only `dtype` is read"),
    (["teacher_model_name_or_path=t", "teacher_model_init_kwargs={dtype: auto}"],
     r"teacher_model_init_kwargs: dtype must be one of \['bfloat16', 'float16', 'float32'\] or unset"),
    (["teacher_model_name_or_path=t", "use_vllm=true"], "use_vllm: only false"),
])
def test_config_refusals_name_the_key(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_config(DistillationConfig, None, overrides)


def test_trls_names_and_defaults() -> None:
    from trl import DistillationConfig as TRLConfig

    theirs, ours = TRLConfig(output_dir="x", use_cpu=True, bf16=False), DistillationConfig()
    for key in ("beta", "temperature", "top_p", "top_k", "min_p", "max_completion_length", "learning_rate",
                "log_completions", "num_completions_to_print", "teacher_model_name_or_path",
                "teacher_model_revision"):
        assert getattr(ours, key) == getattr(theirs, key), key


@pytest.mark.parametrize(("overrides", "dtype"), [
    (["bf16=true"], torch.bfloat16), (["bf16=false"], torch.float32),
    (["bf16=false", "teacher_model_init_kwargs={dtype: bfloat16}"], torch.bfloat16),
    (["bf16=true", "teacher_model_init_kwargs={dtype: float16}"], torch.float16),
])
def test_the_teacher_loads_in_the_runs_precision_or_the_named_dtype(overrides, dtype) -> None:
    config = load_config(DistillationConfig, None, ["teacher_model_name_or_path=t", *overrides])
    assert teacher_dtype(config, torch.device("cpu")) == dtype
