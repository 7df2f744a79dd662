"""GRPO with LoRA against full fine-tuning, one run: step time, peak memory and held-out accuracy by
training minute, each printed with the ratio.

Same model (the default SmolLM2-135M-Instruct, float32), same task and prompts (the built-in
two-digit addition, seed 0, in the same order), 8 prompts x G = 8 completions per step, 64-token
completions, temperature 1.0, beta 0, loss dapo, constant learning rate; each run stops after the
same budget of training minutes (`max_train_minutes`, evaluations excluded) and is evaluated greedily
on the same held-out problems every `--eval-steps` steps and at the end.

- full fine-tuning: every weight trained, learning rate 1e-5 (examples/grpo_arithmetic.yaml).
- LoRA: `use_peft`, r 16, alpha 32, dropout 0.05 (TRL's defaults) on all seven projections of every
  layer, learning rate 1e-4 (LoRA's usual ~10x the full fine-tuning rate).

The two runs go one after the other (full fine-tuning first), each in its own process with one
torch thread, so each peak resident memory (`ru_maxrss`) is its own and neither competes with the
other for a core.

  OMP_NUM_THREADS=1 .venv/bin/python bench/bench_lora_grpo.py [--minutes 4.5] [--configs full,lora]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

G, PROMPTS, LENGTH = 8, 8, 64
CONFIGS = {
    "full": dict(learning_rate=1e-5),
    "lora": dict(learning_rate=1e-4, use_peft=True, lora_r=16, lora_alpha=32, lora_dropout=0.05,
                 lora_target_modules=["all-linear"]),
}


def run(name: str, minutes: float, eval_steps: int, num_eval: int, out: Path) -> dict:
    import torch

    from pagedrl.train.algorithms.grpo import run_grpo
    from pagedrl.train.rl.config import GRPOConfig

    torch.set_num_threads(1)
    config = GRPOConfig(dataset="arithmetic", output_dir=str(out), num_generations=G,
                        per_device_train_batch_size=16, gradient_accumulation_steps=PROMPTS * G // 16,
                        max_completion_length=LENGTH, temperature=1.0, lr_scheduler_type="constant",
                        max_steps=1000, max_train_minutes=minutes, beta=0.0, logging_steps=1, eval_steps=eval_steps,
                        save_steps=100_000, report_to=["jsonl"], task_num_eval=num_eval, seed=0, **CONFIGS[name])
    final = run_grpo(config, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time" in r]
    evals = [(r["train_time"] / 60, r["eval/accuracy"], r["step"]) for r in rows if "eval/accuracy" in r]
    saved = sum(f.stat().st_size for f in final.iterdir() if f.suffix == ".safetensors")
    trained = {"full": "every weight", "lora": "adapters only"}[name]
    return {"step": [r["step_time"] for r in steps], "generate": [r["rollout/seconds"] for r in steps],
            "reward": [r["reward"] for r in steps], "evals": evals, "saved_mib": saved / 2**20, "trained": trained}


def worker(name: str, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = run(name, args.minutes, args.eval_steps, args.num_eval, Path(tmp) / "out")
    data["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.result).write_text(json.dumps(data))


def accuracy_at(evals: list[list[float]], minute: float) -> float | None:
    """The last held-out accuracy measured at or before `minute` of training."""
    seen = [acc for m, acc, _ in evals if m <= minute + 1e-9]
    return seen[-1] if seen else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=4.5, help="training minutes per run (evaluations excluded)")
    parser.add_argument("--eval-steps", type=int, default=3)
    parser.add_argument("--num-eval", type=int, default=128, help="held-out problems")
    parser.add_argument("--configs", default="full,lora")
    parser.add_argument("--worker", default=None)
    parser.add_argument("--result", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    results = {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name in args.configs.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, __file__, "--worker", name, "--minutes", str(args.minutes),
                            "--eval-steps", str(args.eval_steps), "--num-eval", str(args.num_eval),
                            "--result", f.name], check=True, env=env)
            results[name] = json.loads(Path(f.name).read_text())
    print(f"\nGRPO, SmolLM2-135M float32, {PROMPTS} prompts x G={G}, {LENGTH}-token completions, one thread, "
          f"{args.minutes:g} training minutes each")
    print(f"{'':6} {'trained':>14} {'steps':>6} {'median step s':>14} {'generate s':>11} {'train s':>9} "
          f"{'peak RSS MiB':>13} {'final/ MiB':>11}")
    for name, r in results.items():
        step, gen = statistics.median(r["step"]), statistics.median(r["generate"])
        print(f"{name:6} {r['trained']:>14} {len(r['step']):6d} {step:14.1f} {gen:11.1f} {step - gen:9.1f} "
              f"{r['peak_rss_mib']:13.0f} {r['saved_mib']:11.1f}")
    print("\nheld-out accuracy (training minute, accuracy, step):")
    for name, r in results.items():
        print(f"  {name:6} " + ", ".join(f"({m:.2f}, {a:.3f}, {s})" for m, a, s in r["evals"]))
    minutes = [float(m) for m in range(int(args.minutes) + 1)] + [args.minutes]
    print("\nby training minute (last evaluation at or before it):")
    print("  minute  " + "  ".join(f"{m:6.2f}" for m in minutes))
    for name, r in results.items():
        cells = [accuracy_at(r["evals"], m) for m in minutes]
        print(f"  {name:6}  " + "  ".join("     -" if c is None else f"{c:6.3f}" for c in cells))
    if {"full", "lora"} <= results.keys():
        full, lora = results["full"], results["lora"]
        print(f"\nmedian step (full / LoRA): {statistics.median(full['step']) / statistics.median(lora['step']):.2f}x "
              "(goal > 1)")
        train_full = statistics.median(full["step"]) - statistics.median(full["generate"])
        train_lora = statistics.median(lora["step"]) - statistics.median(lora["generate"])
        print(f"training part of the step (full / LoRA): {train_full / train_lora:.2f}x")
        print(f"peak memory (LoRA / full): {lora['peak_rss_mib'] / full['peak_rss_mib']:.2f} (goal clearly < 1)")
        gap = 100 * (full["evals"][-1][1] - lora["evals"][-1][1])
        print(f"final held-out accuracy: full {full['evals'][-1][1]:.3f}, LoRA {lora['evals'][-1][1]:.3f}; "
              f"full - LoRA = {gap:+.1f} points (goal: within 5)")


if __name__ == "__main__":
    main()
