"""`pagedrl demo [--quick] [--output-dir D] [--budget-minutes M] [--model M] [--quantization Q] [--seed S]`: paged attention measured
live, then GRPO vs DPO vs RLHF from the same model with the same training budget, and a report.

Stages run in order; each one's numbers land in `stages/<name>.json` only when it has finished, so
Ctrl-C leaves every finished stage's checkpoints and results usable, and the same command run again
resumes at the first unfinished stage (which starts over). Each stage's own output goes to
`logs/<name>.log`; the terminal shows one progress line, then the summary table and the report's path.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedrl.demo.plan import DemoPlan
from pagedrl.model.precision import QUANTIZATIONS

STAGES = ("paged", "pairs", "grpo", "dpo", "rm", "ppo")
TRAINED = ("grpo", "dpo", "rm", "ppo")


def stage_estimates(plan: DemoPlan) -> dict[str, float]:
    """Seconds each stage is expected to take on an idle 2-core CPU: only the progress line's ETA
    uses them (it is corrected as stages finish)."""
    if plan.calibration is not None:
        return dict(plan.calibration["predicted_stage_seconds"])
    budget = 60 * plan.budget_minutes
    evals = plan.num_eval * plan.completion_tokens / 800  # one held-out evaluation at ~800 tokens/s
    along = 1 if plan.quick else 4  # evaluations per method
    pairs = plan.pair_prompts * plan.pair_generations * plan.completion_tokens / 800
    return {"paged": 45 if plan.quick else 120, "pairs": 10 + evals + pairs,
            "grpo": 15 + budget + along * evals, "dpo": 15 + budget + along * evals, "rm": 15 + budget * plan.rm_share,
            "ppo": 25 + budget * (1 - plan.rm_share) + along * evals}


def check_plan(plan: DemoPlan) -> None:
    """An output folder holds one plan: resuming with another would mix incomparable stages."""
    path = plan.out / "plan.json"
    settings = json.loads(plan.to_json())
    if path.is_file() and {**json.loads(path.read_text()), "output_dir": plan.output_dir} != settings:
        raise ValueError(f"--output-dir {plan.out} holds a demo run with other settings ({path}); "
                         "use another --output-dir, or delete that folder to start over")
    plan.out.mkdir(parents=True, exist_ok=True)
    path.write_text(plan.to_json() + "\n")


def stage_work(name: str, plan: DemoPlan) -> Callable[[], Any]:
    """What running stage `name` does. A training stage stopped by Ctrl-C after a step has a
    checkpoint (the trainer saves one on SIGINT): it continues from there; any other leftover of an
    unfinished stage is removed and the stage starts over."""
    from pagedrl.train.checkpointing import latest_checkpoint

    if name == "paged":
        from pagedrl.demo.engine_stage import measure_paged

        return lambda: measure_paged(plan)
    folder = plan.out / name
    resume = name in TRAINED and latest_checkpoint(folder) is not None
    if folder.exists() and not resume:
        shutil.rmtree(folder)
    if name == "pairs":
        from pagedrl.demo.alignment import baseline_and_pairs

        return lambda: baseline_and_pairs(plan)
    from pagedrl.demo.alignment import run_method

    return lambda: str(run_method(name, plan, resume))


def run_demo(plan: DemoPlan, progress: bool = True) -> Path:
    """Run every unfinished stage, then write the report; returns report.md's path."""
    from pagedrl.demo.monitor import Monitor
    from pagedrl.demo.report import write_report
    from pagedrl.kernels.memory import keep_freed_memory

    check_plan(plan)
    # A training process from its first stage: what the engine stages free serves the trainers' blocks.
    keep_freed_memory(every_block=True)
    done_dir, logs = plan.out / "stages", plan.out / "logs"
    done_dir.mkdir(exist_ok=True)
    logs.mkdir(exist_ok=True)
    estimates = stage_estimates(plan)
    todo = [s for s in STAGES if not (done_dir / f"{s}.json").is_file()]
    monitor = Monitor(sum(estimates[s] for s in todo), enabled=progress)
    try:
        for name in todo:
            index = STAGES.index(name) + 1
            config = plan.stage_config(name) if name in TRAINED else None
            steps = getattr(plan, f"{name}_max_steps") if config is not None else 0
            monitor.begin(name, index, len(STAGES), plan.out / name / "metrics.jsonl" if config else None,
                          None if config is None or steps else 60 * config.max_train_minutes, steps or None)
            start = time.perf_counter()
            with open(logs / f"{name}.log", "a", encoding="utf-8") as log, contextlib.redirect_stdout(log):
                result = stage_work(name, plan)()
            seconds = time.perf_counter() - start
            remaining = sum(estimates[s] for s in todo[todo.index(name) + 1:])
            record = {"seconds": seconds, "peak_memory_bytes": monitor.end(remaining), "result": result}
            tmp = done_dir / f"{name}.json.tmp"
            tmp.write_text(json.dumps(record, indent=2) + "\n")
            tmp.replace(done_dir / f"{name}.json")
            gc.collect()
    finally:
        monitor.close()
    return write_report(plan)


def demo_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagedrl demo", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the short form (about 7 minutes on a "
                        "2-core CPU): fewer requests and problems, each method's steps sized to this machine")
    parser.add_argument("--output-dir", default=None, help="where everything goes (default runs/demo or "
                        "runs/demo-quick, with -seedS for another --seed); run again to resume")
    parser.add_argument("--budget-minutes", type=float, default=None,
                        help="training minutes per method, evaluations excluded (default 10, quick 1)")
    parser.add_argument("--model", default=None, help="a known model name or a Hugging Face folder")
    parser.add_argument("--no-calibrate", action="store_true", help="quick form: skip the measurement at start "
                        "and train each method for its minutes, whatever steps they hold")
    parser.add_argument("--target-minutes", type=float, default=6.5, help="quick form: the whole demo's minutes the "
                        "calibration sizes the plan for (default 6.5); a slow machine still gets each method's "
                        "minimum steps, in more minutes")
    parser.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                        help="the engine stage's weights, as serve --quantization loads them (gguf: a GGUF model's "
                        "own blocks; int8, int4: made at load); the training stages train the float model")
    parser.add_argument("--seed", type=int, default=None, help="seeds sampling, training and the task's problems "
                        "(default 0); another seed is another draw of everything the verdict rests on")
    args = parser.parse_args(argv)
    if args.budget_minutes is not None and args.budget_minutes <= 0:
        print(f"pagedrl demo: error: --budget-minutes must be > 0, got {args.budget_minutes}", file=sys.stderr)
        return 2
    default_dir = ("runs/demo-quick" if args.quick else "runs/demo") + (f"-seed{args.seed}" if args.seed else "")
    plan = DemoPlan.preset(args.quick, output_dir=args.output_dir or default_dir,
                           budget_minutes=args.budget_minutes, model=args.model, seed=args.seed,
                           quantization=args.quantization)
    import torch

    from pagedrl.model.precision import FORCE_ENV, choose_precision

    chosen = choose_precision("cuda" if torch.cuda.is_available() else "cpu")
    print(f"pagedrl demo: precision {chosen.describe()}; {FORCE_ENV}=0 forces float32", file=sys.stderr)
    if plan.quantization is not None:
        print(f"pagedrl demo: the engine stage runs --quantization {plan.quantization} (in float32 on a CPU); "
              "the training stages train the float model", file=sys.stderr)
    start = time.perf_counter()
    if args.quick and not args.no_calibrate:
        from pagedrl.demo.calibrate import calibrated, summary_line

        print("pagedrl demo: calibrating (a few seconds: one evaluation group, one rollout round, one training "
              "pass)", file=sys.stderr)
        plan = calibrated(plan, args.target_minutes, args.budget_minutes)
        print(f"pagedrl demo: {summary_line(plan)}", file=sys.stderr)
    try:
        report = run_demo(plan, progress=True)
    except KeyboardInterrupt:
        print(f"\npagedrl demo: interrupted; finished stages are kept in {plan.out}/stages. Run the same command "
              "again to resume from the first unfinished stage.", file=sys.stderr)
        return 130
    except ValueError as e:
        print(f"pagedrl demo: error: {e}", file=sys.stderr)
        return 2
    from pagedrl.demo.report import markdown_table, method_table, paged_table

    data = json.loads((plan.out / "report.json").read_text())
    print(markdown_table(paged_table(data["paged"])))
    print()
    print(markdown_table(method_table(data)))
    print()
    print("\n".join(f"- {line}" for line in data["verdict"]))
    print(f"\npagedrl demo: done in {(time.perf_counter() - start) / 60:.1f} min (this call). Report: "
          f"{report} and {report.with_suffix('.html')} (self-contained: open it in a browser)")
    return 0
