"""`pagedrl demo` end to end on the tiny model: every stage, a report whose numbers are the ones the
run logged, and a second call that finds every stage finished and only rewrites the report."""

from __future__ import annotations

import json
import re

import pytest

from pagedrl.cli import main
from pagedrl.demo.calibrate import MAX_STEPS, MIN_STEPS, measure, size_quick
from pagedrl.demo.cli import STAGES, run_demo
from pagedrl.demo.plan import DemoPlan
from pagedrl.demo.report import fmt
from pagedrl.train.logging import read_metrics
from pagedrl.train.significance import mcnemar_exact, wilson_interval


def parity(prompts, completions, completion_ids, **kwargs):
    """A verifier the tiny random model can satisfy: a completion starting with an even id is 'correct'."""
    return [float(len(ids) > 0 and ids[0] % 2 == 0) for ids in completion_ids]


def tiny_plan(model, out, **fields) -> DemoPlan:
    return DemoPlan.preset(True, model=str(model), output_dir=str(out), budget_minutes=0.03, num_requests=6,
                           scale=0.1, n_samples=4, long_prompt_tokens=40, n_sample_tokens=8, hf_batch_size=4,
                           task_low=1, task_high=9, num_eval=8, completion_tokens=6, pair_prompts=12,
                           grpo_eval_steps=2, dpo_eval_steps=2, ppo_eval_steps=2, grpo_learning_rate=1e-3,
                           dpo_learning_rate=1e-3, ppo_learning_rate=1e-3, **fields)


@pytest.fixture(scope="module")
def demo(tiny_train_model, tmp_path_factory):
    import pagedrl.train.rl.rewards as rewards

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rewards, "last_integer_match", parity)
        mp.setitem(rewards.BUILTINS, "last_integer_match", parity)
        plan = tiny_plan(tiny_train_model, tmp_path_factory.mktemp("demo") / "out")
        # As `pagedrl demo --quick` runs: measured, then each method's steps sized for 0.03 minutes.
        plan = size_quick(plan, measure(plan, eval_problems=8, train_batch=(2, 16)), budget_minutes=plan.budget_minutes)
        report = run_demo(plan, progress=False)
    return plan, report


def test_every_stage_finishes_and_the_report_is_self_contained(demo) -> None:
    plan, report = demo
    out = plan.out
    assert sorted(p.stem for p in (out / "stages").glob("*.json")) == sorted(STAGES)
    for name in ("grpo", "dpo", "rm", "ppo"):
        assert (out / name / "final" / "config.json").is_file()
    md = report.read_text()
    for heading in ("# pagedrl demo", "## Paged attention, measured", "## Alignment, side by side"):
        assert heading in md
    for png in ("accuracy.png", "kv_cache.png", "throughput.png"):
        assert f"]({png})" in md and (out / png).stat().st_size > 5000
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 3 and "<img" in page and "src=\"http" not in page
    assert "| models in memory | 1 | 2 | 4 |" in md  # GRPO (beta 0), DPO (policy + reference), RLHF's four
    assert "CPU class" in md and "Calibration: " in md and "Calibrated at start" in md


def test_report_numbers_are_the_logged_ones(demo) -> None:
    plan, report = demo
    out = plan.out
    data = json.loads((out / "report.json").read_text())
    md = report.read_text()
    stage = {s: json.loads((out / "stages" / f"{s}.json").read_text()) for s in STAGES}
    paged = stage["paged"]["result"]
    assert data["paged"] == paged
    assert f"| output tokens/s | {fmt(paged['transformers_output_tps'])} | {fmt(paged['pagedrl_output_tps'])} | " \
           f"{paged['throughput_ratio']:.2f}x |" in md
    assert paged["pagedrl_output_tps"] == pytest.approx(paged["output_tokens"] / paged["pagedrl_seconds"])
    s = paged["prefix"]
    assert s["shared"] < s["unshared"]  # the n samples shared the long prompt's blocks
    snap = paged["snapshot"]
    assert len({b for q in snap["seqs"] for b in q["blocks"]}) <= snap["blocks_used"] <= snap["num_blocks"]
    base = stage["pairs"]["result"]["base_accuracy"]
    for method, folder in (("GRPO", "grpo"), ("DPO", "dpo"), ("RLHF", "ppo")):
        evals = [r for r in read_metrics(out / folder / "metrics.jsonl") if "eval/accuracy" in r]
        assert evals, folder
        m = data["methods"][method]
        assert m["accuracy before"] == base and m["accuracy after"] == evals[-1]["eval/accuracy"]
        assert [y for _, y in data["curves"][method]] == [base] + [r["eval/accuracy"] for r in evals]
        row = re.search(r"^\| held-out accuracy \|(.*)\|$", md, re.M).group(1).split("|")
        assert row[("GRPO", "DPO", "RLHF").index(method)].strip() == f"{fmt(base)} -> {fmt(evals[-1]['eval/accuracy'])}"
    for folder, config in (("grpo", plan.grpo()), ("dpo", plan.dpo()), ("rm", plan.rm()), ("ppo", plan.ppo())):
        rows = read_metrics(out / folder / "metrics.jsonl")
        # Each method stopped on its budget, its steps (at least its minimum) unless the minutes cap came
        # first (eval_on_start off: the base model is evaluated once), and was evaluated at its last step.
        assert MIN_STEPS[folder] <= config.max_steps <= MAX_STEPS[folder]
        last = max(r["step"] for r in rows)
        assert last == config.max_steps or max(r["train_time"] for r in rows) >= 60 * config.max_train_minutes - 0.5
        assert all(r["step"] > 0 for r in rows if "eval/accuracy" in r)
        if folder != "rm":
            assert max(r["step"] for r in rows if "eval/accuracy" in r) == last
    grpo_rows = read_metrics(out / "grpo" / "metrics.jsonl")
    steps = max(r["step"] for r in grpo_rows)
    assert data["methods"]["GRPO"]["optimizer steps"] == steps >= 1
    assert data["methods"]["GRPO"]["KV blocks saved by prefix sharing"] == sum(
        r.get("rollout/prefix_blocks_shared", 0) for r in grpo_rows)
    assert data["methods"]["DPO"]["samples generated"] == stage["pairs"]["result"]["completions"]
    assert data["methods"]["RLHF"]["peak memory (GiB)"] == pytest.approx(
        max(stage["rm"]["peak_memory_bytes"], stage["ppo"]["peak_memory_bytes"]) / 2**30)
    pairs = [json.loads(line) for line in (out / "pairs" / "pairs.jsonl").read_text().splitlines()]
    assert stage["pairs"]["result"]["pairs"] == len(pairs) > 0


def test_intervals_and_tests_are_recomputed_from_the_logged_outcomes(demo) -> None:
    """report.json's per-problem outcomes are the ones the evaluations logged, and every interval
    and p-value in it and in report.md follows from them."""
    plan, report = demo
    out = plan.out
    data = json.loads((out / "report.json").read_text())
    md = report.read_text()
    base = json.loads((out / "stages" / "pairs.json").read_text())["result"]["base_outcomes"]
    assert len(base) == plan.num_eval
    for method, folder in (("GRPO", "grpo"), ("DPO", "dpo"), ("RLHF", "ppo")):
        logged = [json.loads(line) for line in (out / folder / "eval_outcomes.jsonl").read_text().splitlines()]
        evals = [r for r in read_metrics(out / folder / "metrics.jsonl") if "eval/accuracy" in r]
        assert [r["step"] for r in logged] == [r["step"] for r in evals]
        for record, row in zip(logged, evals, strict=True):  # each accuracy is its outcomes' mean
            assert sum(v >= 1 for v in record["outcomes"]) / len(record["outcomes"]) == row["eval/accuracy"]
        after = logged[-1]["outcomes"]
        assert data["outcomes"][method] == {"before": base, "after": after}
        sig = data["significance"][method]
        fixed = sum(1 for b, a in zip(base, after, strict=True) if a >= 1 > b)
        broken = sum(1 for b, a in zip(base, after, strict=True) if b >= 1 > a)
        assert (sig["fixed"], sig["broken"]) == (fixed, broken)
        assert sig["p_value"] == mcnemar_exact(fixed, broken)
        assert sig["interval_after"] == list(wilson_interval(sum(a >= 1 for a in after), len(after)))
        assert sig["verdict"] in ("significant", "not significant", "significantly worse")
        assert data["curve_intervals"][method][0] == list(wilson_interval(sum(b >= 1 for b in base), len(base)))
        assert f"p = {sig['p_value']:.2g}: {sig['verdict']}" in md
        assert f"{method}: " in "\n".join(data["verdict"])
    assert "## Verdict" in md and "What each needed" in md


def test_report_html_parses_and_every_image_decodes(demo) -> None:
    """The page is well formed, and each embedded PNG decodes to a real picture."""
    import base64
    import io
    from html.parser import HTMLParser

    from PIL import Image

    plan, _ = demo
    page = (plan.out / "report.html").read_text()

    class Page(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.stack: list[str] = []
            self.images: list[str] = []
            self.tables = 0

        def handle_starttag(self, tag, attrs) -> None:
            if tag == "img":
                self.images.append(dict(attrs)["src"])
            elif tag not in ("meta", "br"):
                self.stack.append(tag)
            self.tables += tag == "table"

        def handle_endtag(self, tag) -> None:
            assert self.stack and self.stack.pop() == tag, f"</{tag}> closes nothing open"

    parser = Page()
    parser.feed(page)
    parser.close()
    assert parser.stack == [] and parser.tables == 2 and len(parser.images) == 3
    for src in parser.images:
        assert src.startswith("data:image/png;base64,")
        image = Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1], validate=True)))
        image.load()
        assert image.width > 300 and image.height > 200


def test_report_html_renders_in_a_headless_browser(demo) -> None:
    """Opened offline in Chromium (skipped, with the reason, where Playwright or Chromium is missing):
    both tables are there, every image has decoded to a picture, nothing is fetched, nothing errs."""
    from browser import open_page

    plan, _ = demo
    url = (plan.out / "report.html").resolve().as_uri()
    with open_page(url) as (page, problems):
        page.goto(url)
        assert page.locator("table").count() == 2 and page.locator("h2").count() == 3
        sizes = page.evaluate("[...document.images].map(i => [i.complete, i.naturalWidth, i.naturalHeight])")
        assert len(sizes) == 3 and all(done and w > 300 and h > 200 for done, w, h in sizes)
        assert "McNemar" in page.locator("body").inner_text()
        page.screenshot(path=str(plan.out / "report-page.png"), full_page=True)
        assert problems == []


def test_a_second_call_resumes_after_the_last_finished_stage(demo, capsys) -> None:
    plan, report = demo
    (plan.out / "stages" / "ppo.json").unlink()  # as if Ctrl-C had stopped PPO
    before = {s: (plan.out / "stages" / f"{s}.json").stat().st_mtime_ns for s in STAGES if s != "ppo"}
    import pagedrl.train.rl.rewards as rewards

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(rewards.BUILTINS, "last_integer_match", parity)
        argv = ["demo", "--quick", "--output-dir", str(plan.out), "--budget-minutes", str(plan.budget_minutes),
                "--model", plan.model]
        # Another plan in the same folder is refused rather than mixed with it.
        assert main(argv) == 2
        assert "holds a demo run with other settings" in capsys.readouterr().err
        run_demo(plan, progress=False)
    assert {s: (plan.out / "stages" / f"{s}.json").stat().st_mtime_ns for s in before} == before
    assert (plan.out / "stages" / "ppo.json").is_file()


def test_ctrl_c_in_a_training_stage_resumes_from_its_checkpoint(demo, tmp_path) -> None:
    """SIGINT during GRPO: the step finishes and is saved, the demo stops; the same call again
    continues GRPO from that checkpoint (its budget counting the time already trained)."""
    import os
    import shutil
    import signal

    import pagedrl.train.rl.rewards as rewards

    plan, _ = demo
    out = tmp_path / "out"
    for part in ("plan.json", "stages/paged.json", "stages/pairs.json", "pairs"):  # the first two stages, done
        (out / part).parent.mkdir(parents=True, exist_ok=True)
        copy = shutil.copytree if (plan.out / part).is_dir() else shutil.copy
        copy(plan.out / part, out / part)
    fired = []

    def interrupting(prompts, completions, completion_ids, **kwargs):
        if not fired:
            fired.append(True)
            os.kill(os.getpid(), signal.SIGINT)  # as Ctrl-C during GRPO's first rollout
        return parity(prompts, completions, completion_ids)

    resumed = DemoPlan(**{**json.loads((plan.out / "plan.json").read_text()), "output_dir": str(out)})
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(rewards.BUILTINS, "last_integer_match", interrupting)
        with pytest.raises(KeyboardInterrupt):
            run_demo(resumed, progress=False)
        assert (out / "grpo" / "checkpoint-1").is_dir() and not (out / "stages" / "grpo.json").exists()
        mp.setitem(rewards.BUILTINS, "last_integer_match", parity)
        run_demo(resumed, progress=False)
    assert "resuming from" in (out / "logs" / "grpo.log").read_text()
    steps = [r["step"] for r in read_metrics(out / "grpo" / "metrics.jsonl") if "loss" in r]
    # step 1 once, then on from 2 for as long as the 1.8-second budget lasts (on a loaded machine step 1
    # can spend it all: how many steps follow is the machine's speed, not the resume's correctness)
    assert steps == list(range(1, len(steps) + 1))
    assert (out / "report.md").is_file()


def test_the_engine_stage_runs_quantized_and_says_so(tiny_train_model, tmp_path, monkeypatch, capsys) -> None:
    """`--quantization` reaches the plan (and so plan.json), the engine stage loads its weights as serve
    does, and the report's table names what ran on each side."""
    import torch

    import pagedrl.demo.cli as demo_cli
    from pagedrl.demo.engine_stage import measure_paged
    from pagedrl.demo.report import paged_table

    plans = []

    def stop_at_once(plan, progress=True):
        plans.append(plan)
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_cli, "run_demo", stop_at_once)
    assert main(["demo", "--quick", "--no-calibrate", "--model", str(tiny_train_model), "--quantization", "int4",
                 "--output-dir", str(tmp_path / "out")]) == 130
    assert plans[0].quantization == "int4" and json.loads(plans[0].to_json())["quantization"] == "int4"
    assert "the engine stage runs --quantization int4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--quantization", "nf4"])
    assert ("invalid choice: 'nf4' (choose from 'gguf', 'int8', 'int4', 'mxfp4', 'gptq', 'awq', "
            "'compressed-tensors')") in capsys.readouterr().err

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's small ops: a second thread of a shared machine only waits
    try:
        result = measure_paged(tiny_plan(tiny_train_model, tmp_path / "paged", quantization="int4"))
    finally:
        torch.set_num_threads(threads)
    assert result["quantization"] == "int4" and "int4 weight-only" in result["precision"]
    assert result["output_tokens"] > 0
    rows = {row[0]: row for row in paged_table(result)}
    assert "precision (both sides)" not in rows
    assert rows["weights"][1] == "float (not quantized)" and rows["weights"][2].startswith("--quantization int4: float32")
