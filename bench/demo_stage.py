"""One stage of a `pagedrl demo` plan, with any plan field overridden: how the demo's budgets,
learning rates and batch settings were chosen (bench/RESULTS.md, "Demo"). Stages read what earlier
ones wrote in the same folder, as in the demo (dpo and rm need pairs, ppo needs rm).

    .venv/bin/python bench/demo_stage.py runs/tune pairs num_eval=256 pair_prompts=128
    .venv/bin/python bench/demo_stage.py runs/tune grpo num_eval=256 budget_minutes=3 grpo_eval_steps=3 --eval-on-start
    .venv/bin/python bench/demo_stage.py runs/tune dpo num_eval=256 budget_minutes=2 dpo_eval_steps=8

It prints the stage's held-out accuracy at each evaluation (training minutes, accuracy, 95%
interval) and, for pairs, what sampling found.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

from pagedrl.demo.alignment import baseline_and_pairs, run_method
from pagedrl.demo.plan import DemoPlan
from pagedrl.train.logging import read_metrics
from pagedrl.train.significance import wilson_interval


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output_dir")
    parser.add_argument("stage", choices=("pairs", "grpo", "dpo", "rm", "ppo"))
    parser.add_argument("fields", nargs="*", help="plan fields as name=value (see src/pagedrl/demo/plan.py)")
    parser.add_argument("--full", action="store_true", help="start from the full plan (default: the quick one)")
    parser.add_argument("--eval-on-start", action="store_true", help="evaluate the starting model as step 0")
    args = parser.parse_args()
    types = {f.name: f.type for f in dataclasses.fields(DemoPlan)}
    fields = {}
    for item in args.fields:
        name, _, value = item.partition("=")
        if name not in types:
            parser.error(f"{item}: no plan field {name!r}")
        parse = {"int": int, "float": float, "str": str, "bool": lambda v: v.lower() in ("1", "true")}
        fields[name] = parse.get(str(types[name]), float)(value)
    plan = DemoPlan.preset(not args.full, output_dir=args.output_dir, **fields)
    start = time.perf_counter()
    if args.stage == "pairs":
        result = baseline_and_pairs(plan)
        print(json.dumps({k: v for k, v in result.items() if k != "base_outcomes"}))
    else:
        config = plan.stage_config(args.stage)
        config.eval_on_start = args.eval_on_start
        run = {"grpo": "pagedrl.train.algorithms.grpo:run_grpo", "rm": "pagedrl.train.algorithms.rm:run_rm",
               "ppo": "pagedrl.train.algorithms.ppo:run_ppo"}.get(args.stage)
        if run is None:
            run_method(args.stage, plan)  # DPO with held-out accuracy, as the demo runs it
        else:
            module, _, name = run.partition(":")
            getattr(__import__(module, fromlist=[name]), name)(config, progress=False)
        for row in read_metrics(plan.out / args.stage / "metrics.jsonl"):
            if row.get("eval/accuracy") is not None:
                low, high = wilson_interval(round(row["eval/accuracy"] * plan.num_eval), plan.num_eval)
                print(f"step {row['step']:4d}  {row['train_time'] / 60:5.2f} min  accuracy {row['eval/accuracy']:.3f} "
                      f"[{low:.3f}, {high:.3f}]")
    print(f"{args.stage}: {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
