"""The quick demo's calibration: the sizing keeps every method's minimum steps on a slow CPU (giving
up smaller things first, in its stated order), fills its share on a fast one, evaluates each method
at its last step, and a resumed run finds the plan it started with; the measurement runs on the
tiny model; the warm-up whose first step already trains."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedrl.demo import calibrate
from pagedrl.demo.calibrate import (
    MAX_STEPS,
    MIN_STEPS,
    Measurement,
    calibrated,
    predict,
    size_quick,
)
from pagedrl.demo.cli import check_plan
from pagedrl.demo.plan import DemoPlan, stage_caps
from pagedrl.train.optim import lr_lambda


def machine(speed: float, **fields) -> Measurement:
    """A measurement of a machine `speed` times the AVX2-only CPU the quick demo ran 14 minutes on
    (float32: ~250 generated and ~150 training tokens/s, 32 problems evaluated in ~12 s)."""
    base = dict(cpu_class="avx2 (AVX2 + FMA, no AVX512)", precision="float32", load_seconds=4.0, eval_problems=32,
                eval_seconds=12.0 / speed, sampled_completions=16, sampled_tokens=480, sample_seconds=480 / 250 / speed,
                prompt_tokens=46.0, train_tokens=384, train_seconds=384 / 150 / speed, seconds=20.0 / speed,
                load_average=0.5)
    return Measurement(**{**base, **fields})


def steps(plan: DemoPlan) -> dict[str, int]:
    return {k: getattr(plan, f"{k}_max_steps") for k in MIN_STEPS}


def test_a_slow_cpu_keeps_every_methods_minimum_steps(tmp_path) -> None:
    quick = DemoPlan.preset(True, output_dir=str(tmp_path))
    sized = size_quick(quick, machine(0.25))  # four times slower than that AVX2 CPU: no plan fits 6.5 minutes
    assert all(n >= MIN_STEPS[k] for k, n in steps(sized).items())
    c = sized.calibration
    # Everything it may give up was given up, and it says so; the prediction is over the target, not cut.
    assert c["given up"] == ["dpo_batch_pairs", "grpo_along", "num_eval", "pair_prompts", "ppo_prompts_per_step"]
    assert (sized.dpo_batch_pairs, sized.ppo_prompts_per_step, sized.num_eval, sized.pair_prompts) == (4, 2, 96, 32)
    assert c["predicted_minutes"] > 6.5
    assert sized.grpo_eval_steps == sized.grpo_max_steps  # no evaluation along the way
    # Every stage's cap holds its predicted steps twice over: a run as fast as measured is never cut.
    caps = stage_caps(sized)
    for k, n in steps(sized).items():
        assert caps[k] * 60 >= 2 * n * c["step_seconds"][k] - 1e-6
        assert sized.stage_config(k).max_steps == n and sized.stage_config(k).max_train_minutes == caps[k]


def test_a_cpu_near_the_target_gives_up_only_what_it_must(tmp_path) -> None:
    """Half again and twice as fast as that AVX2 CPU, the plan fits 6.5 minutes after giving up the
    first things in the order, no others (the faster, fewer); four times as fast, nothing."""
    quick = DemoPlan.preset(True, output_dir=str(tmp_path))
    order = ["dpo_batch_pairs", "ppo_prompts_per_step", "grpo_along", "num_eval", "pair_prompts"]
    given = {speed: size_quick(quick, machine(speed)).calibration["given up"] for speed in (1.5, 2.0, 4.0)}
    for speed in (1.5, 2.0):
        assert 0 < len(given[speed]) < len(order) and sorted(given[speed]) == sorted(order[:len(given[speed])])
        assert size_quick(quick, machine(speed)).calibration["predicted_minutes"] <= 6.5 + 1 / 60
    assert len(given[2.0]) < len(given[1.5]) and given[4.0] == []
    sized = size_quick(quick, machine(1.5))
    c = sized.calibration
    assert c["predicted_stage_seconds"]["start"] == 10.0 + 20.0 / 1.5
    assert sum(c["predicted_stage_seconds"].values()) == pytest.approx(60 * c["predicted_minutes"])
    assert all(n >= MIN_STEPS[k] for k, n in steps(sized).items())
    assert sized.grpo_max_steps % sized.grpo_eval_steps == 0 and sized.dpo_eval_steps == sized.dpo_max_steps
    assert sized.ppo_eval_steps == sized.ppo_max_steps
    grpo = sized.stage_config("grpo")
    assert (grpo.warmup_steps, grpo.warmup_starts_at_zero) == (2, False)


def test_a_fast_cpu_fills_its_share_and_evaluates_grpo_along_the_way(tmp_path) -> None:
    quick = DemoPlan.preset(True, output_dir=str(tmp_path))
    sized = size_quick(quick, machine(8.0))
    assert sized.calibration["given up"] == []
    assert sized.budget_minutes == 1.5  # the share's upper end
    assert sized.calibration["predicted_minutes"] < 6.5
    assert all(MIN_STEPS[k] <= n <= MAX_STEPS[k] for k, n in steps(sized).items())
    assert sized.grpo_max_steps > MIN_STEPS["grpo"] and sized.grpo_eval_steps == sized.grpo_max_steps // 2
    slower = size_quick(quick, machine(4.0))
    assert steps(slower)["dpo"] < steps(sized)["dpo"]  # the steps follow the measured rates
    # The cost model: more steps, more predicted seconds; a method's steps cost what its step costs.
    more = dataclasses.replace(sized, grpo_max_steps=sized.grpo_max_steps + 2,
                               grpo_eval_steps=sized.grpo_max_steps // 2 + 1)  # still one evaluation along the way
    assert predict(more, machine(8.0))["grpo"] == pytest.approx(
        predict(sized, machine(8.0))["grpo"] + 2 * sized.calibration["step_seconds"]["grpo"])


def test_a_resumed_run_sizes_itself_from_the_saved_measurement(tmp_path, monkeypatch) -> None:
    quick = DemoPlan.preset(True, output_dir=str(tmp_path / "out"))
    monkeypatch.setattr(calibrate, "measure", lambda plan: machine(1.0))
    first = calibrated(quick)
    check_plan(first)  # writes plan.json with the calibration
    assert json.loads((first.out / "plan.json").read_text())["calibration"]["measured"]["eval_seconds"] == 12.0

    def no_measurement(plan):
        raise AssertionError("a resumed run measured the machine again")

    monkeypatch.setattr(calibrate, "measure", no_measurement)
    again = calibrated(quick)
    assert again == first
    check_plan(again)  # the same settings: not refused


def test_the_measurement_runs_on_the_tiny_model(tiny_train_model, tmp_path) -> None:
    plan = DemoPlan.preset(True, model=str(tiny_train_model), output_dir=str(tmp_path), task_low=1, task_high=9,
                           num_eval=8, completion_tokens=6)
    m = calibrate.measure(plan, eval_problems=8, sample_prompts=2, train_batch=(2, 16))
    assert m.eval_problems == 8 and m.sampled_completions == 2 * plan.num_generations
    assert 0 < m.sampled_length <= plan.completion_tokens and m.train_tokens == 32
    assert min(m.eval_seconds, m.sample_seconds, m.train_seconds, m.load_seconds) > 0
    assert m.seconds >= m.load_seconds + m.eval_seconds + m.sample_seconds + m.train_seconds
    assert m.cpu_class and m.precision == "float32"  # the suite runs as a CPU without native bf16
    sized = size_quick(plan, m, budget_minutes=0.0)
    assert steps(sized) == MIN_STEPS  # no training minutes at all: each method at its minimum, however fast
    # Whatever it gives up, it only ever makes smaller (8 problems stay 8, never 96).
    assert sized.num_eval == 8 and size_quick(plan, machine(0.01)).num_eval == 8
    assert "CPU class" in calibrate.describe(sized)


def test_warm_up_whose_first_step_trains() -> None:
    """transformers' warm-up spends its first step at learning rate 0; the demo's starts at 1/(w+1)."""
    assert [lr_lambda("constant_with_warmup", 2, 10)(s) for s in range(4)] == [0.0, 0.5, 1.0, 1.0]
    assert [lr_lambda("constant_with_warmup", 2, 10, from_zero=False)(s) for s in range(4)] == pytest.approx(
        [1 / 3, 2 / 3, 1, 1])
    assert lr_lambda("linear", 0, 10, from_zero=False)(0) == 1.0
