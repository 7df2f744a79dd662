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
- QLoRA: the same adapters on a base held in 4 bits (`load_in_4bit`): the default model's GGUF keeps
  its own Q4_1 blocks; `qlora_nf4` the same in NF4 (`bnb_4bit_quant_type: nf4`, every weight rounded a
  second time). `--configs lora,qlora` compares it with LoRA (goal: peak memory at least 250 MB lower).

Each run is its own process with one torch thread, so each peak resident memory (`ru_maxrss`) is
its own. The two processes alternate, one optimizer step (or evaluation) at a time, passing a turn
token through a file: neither competes with the other for a core, and a machine whose load drifts
during the benchmark slows both alike. The time a run spends waiting for its turn is taken off its
clock (the trainer's start moves forward by it), so `max_train_minutes` and `train_time` count its
own work only.

  OMP_NUM_THREADS=1 .venv/bin/python bench/bench_lora_grpo.py [--minutes 4] [--eval-steps 2] [--num-eval 128]
      [--lora-learning-rate 1e-4] [--max-steps N] [--configs full,lora | lora,qlora]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

G, PROMPTS, LENGTH = 8, 8, 64
CONFIGS = {
    "full": dict(learning_rate=1e-5),
    "lora": dict(learning_rate=1e-4, use_peft=True, lora_r=16, lora_alpha=32, lora_dropout=0.05,
                 lora_target_modules=["all-linear"]),
    # QLoRA: the same adapters on a base whose projections are held in 4 bits (`load_in_4bit`): the GGUF's
    # own blocks, or NF4
    "qlora": dict(learning_rate=1e-4, use_peft=True, lora_r=16, lora_alpha=32, lora_dropout=0.05,
                  lora_target_modules=["all-linear"], load_in_4bit=True),
    "qlora_nf4": dict(learning_rate=1e-4, use_peft=True, lora_r=16, lora_alpha=32, lora_dropout=0.05,
                      lora_target_modules=["all-linear"], load_in_4bit=True, bnb_4bit_quant_type="nf4"),
}


class Turns:
    """Two processes taking turns: `turn` holds the name of the one that may run; a process that
    has finished leaves `done-<name>`, and the other then no longer waits for it."""

    def __init__(self, folder: Path, me: str, other: str | None) -> None:
        self.folder, self.me, self.other = folder, me, other
        self.holding = False

    def wait(self) -> float:
        t0 = time.perf_counter()
        while self.other is not None and not (self.folder / f"done-{self.other}").exists():
            if (self.folder / "turn").read_text() == self.me:
                break
            time.sleep(0.02)
        self.holding = True
        return time.perf_counter() - t0

    def give(self) -> None:
        self.holding = False
        if self.other is not None:
            (self.folder / "turn.tmp").write_text(self.other)
            os.replace(self.folder / "turn.tmp", self.folder / "turn")

    def finish(self) -> None:
        (self.folder / f"done-{self.me}").touch()
        self.give()


def taking_turns(trainer: Any, turns: Turns) -> None:
    """Wrap the trainer's step and evaluation so each runs in this process's turn, with the wait
    taken off the trainer's clock."""
    for name in ("run_step", "evaluate"):
        original = getattr(trainer, name)

        def in_turn(original: Any = original) -> None:
            if turns.holding:  # an evaluation inside this process's step
                return original()
            trainer._start += turns.wait()
            try:
                return original()
            finally:
                turns.give()

        setattr(trainer, name, in_turn)


def run(name: str, minutes: float, eval_steps: int, num_eval: int, out: Path, turns: Turns,
        max_steps: int = 1000) -> dict:
    import torch

    from pagedrl.train.algorithms.grpo import GRPO
    from pagedrl.train.rl.config import GRPOConfig
    from pagedrl.train.start import start_run
    from pagedrl.train.trainer import Trainer

    torch.set_num_threads(1)
    config = GRPOConfig(dataset="arithmetic", output_dir=str(out), num_generations=G,
                        per_device_train_batch_size=16, gradient_accumulation_steps=PROMPTS * G // 16,
                        max_completion_length=LENGTH, temperature=1.0, lr_scheduler_type="constant",
                        max_steps=max_steps, max_train_minutes=minutes, beta=0.0, logging_steps=1, eval_steps=eval_steps,
                        save_steps=None, report_to=["jsonl"], task_num_eval=num_eval, seed=0, bf16=False,
                        **CONFIGS[name])
    dist, loaded = start_run(config, "GRPO needs")  # as run_grpo, with the trainer in reach
    algorithm = GRPO(config, loaded.model, loaded.tokenizer, dist, eos_token_ids=loaded.eos_token_ids,
                     generation_config=loaded.generation_config or None)
    trainer = Trainer(config, algorithm, dist, progress=False)
    taking_turns(trainer, turns)
    try:
        final = trainer.train()
    finally:
        turns.finish()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "step_time" in r]
    evals = [(r["train_time"] / 60, r["eval/accuracy"], r["step"]) for r in rows if "eval/accuracy" in r]
    saved = sum(f.stat().st_size for f in final.iterdir() if f.suffix == ".safetensors")
    trained = {"full": "every weight", "lora": "adapters only", "qlora": "adapters, 4-bit",
               "qlora_nf4": "adapters, NF4"}[name]
    return {"step": [r["step_time"] for r in steps], "generate": [r["rollout/seconds"] for r in steps],
            "reward": [r["reward"] for r in steps], "evals": evals, "saved_mib": saved / 2**20, "trained": trained}


def worker(name: str, args: argparse.Namespace) -> None:
    for adapted in ("lora", "qlora", "qlora_nf4"):
        CONFIGS[adapted]["learning_rate"] = args.lora_learning_rate
    others = [c for c in args.configs.split(",") if c != name]
    turns = Turns(Path(args.turns), name, others[0] if others else None)
    with tempfile.TemporaryDirectory() as tmp:
        data = run(name, args.minutes, args.eval_steps, args.num_eval, Path(tmp) / "out", turns, args.max_steps)
    data["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    Path(args.result).write_text(json.dumps(data))


def accuracy_at(evals: list[list[float]], minute: float) -> float | None:
    """The last held-out accuracy measured by `minute` of training (a second's slack: the start's
    evaluation is logged a moment after minute 0)."""
    seen = [acc for m, acc, _ in evals if m <= minute + 1 / 60]
    return seen[-1] if seen else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=4, help="training minutes per run (evaluations excluded)")
    parser.add_argument("--eval-steps", type=int, default=2)
    parser.add_argument("--num-eval", type=int, default=128, help="held-out problems")
    parser.add_argument("--lora-learning-rate", type=float, default=CONFIGS["lora"]["learning_rate"])
    parser.add_argument("--max-steps", type=int, default=1000, help="also stop after this many steps "
                        "(the same step count for both runs)")
    parser.add_argument("--configs", default="full,lora")
    parser.add_argument("--worker", default=None)
    parser.add_argument("--result", default=None)
    parser.add_argument("--turns", default=None)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args)
        return
    names = args.configs.split(",")
    if not 1 <= len(names) <= 2 or any(n not in CONFIGS for n in names):
        raise SystemExit(f"--configs: one or two of {', '.join(CONFIGS)}, got {args.configs!r}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "turn").write_text(names[0])  # full fine-tuning goes first
        procs = {name: subprocess.Popen([sys.executable, __file__, "--worker", name, "--configs", args.configs,
                                         "--minutes", str(args.minutes), "--eval-steps", str(args.eval_steps),
                                         "--num-eval", str(args.num_eval), "--turns", tmp,
                                         "--max-steps", str(args.max_steps),
                                         "--lora-learning-rate", str(args.lora_learning_rate),
                                         "--result", f"{tmp}/{name}.json"], env=env)
                 for name in names}
        for name, proc in procs.items():
            if proc.wait() != 0:
                raise SystemExit(f"the {name} run failed with status {proc.returncode}")
        results = {name: json.loads((Path(tmp) / f"{name}.json").read_text()) for name in names}
    print(f"\nGRPO, SmolLM2-135M float32, {PROMPTS} prompts x G={G}, {LENGTH}-token completions, one thread, "
          f"{args.minutes:g} training minutes each; learning rate full {CONFIGS['full']['learning_rate']:g}, "
          f"LoRA {args.lora_learning_rate:g}")
    print(f"{'':6} {'trained':>14} {'steps':>6} {'median step s':>14} {'generate s':>11} {'train s':>9} "
          f"{'peak RSS MiB':>13} {'final/ MiB':>11}")
    for name, r in results.items():
        step, gen = statistics.median(r["step"]), statistics.median(r["generate"])
        print(f"{name:6} {r['trained']:>14} {len(r['step']):6d} {step:14.1f} {gen:11.1f} {step - gen:9.1f} "
              f"{r['peak_rss_mib']:13.0f} {r['saved_mib']:11.1f}")
    print("\nheld-out accuracy (training minute, accuracy, step):")
    for name, r in results.items():
        print(f"  {name:6} " + ", ".join(f"({m:.2f}, {a:.3f}, {s})" for m, a, s in r["evals"]))
    last = max(r["evals"][-1][0] for r in results.values())
    minutes = [float(m) for m in range(math.ceil(last) + 1)]
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
    if {"lora", "qlora"} <= results.keys():
        lora, qlora = results["lora"], results["qlora"]
        saved = (lora["peak_rss_mib"] - qlora["peak_rss_mib"]) * 2**20 / 1e6
        print(f"\npeak memory: LoRA {lora['peak_rss_mib']:.0f} MiB, QLoRA {qlora['peak_rss_mib']:.0f} MiB, "
              f"QLoRA / LoRA {qlora['peak_rss_mib'] / lora['peak_rss_mib']:.2f}, {saved:.0f} MB lower (goal >= 250)")
        print(f"median step (QLoRA / LoRA): {statistics.median(qlora['step']) / statistics.median(lora['step']):.2f}x")
        print(f"final held-out accuracy: LoRA {lora['evals'][-1][1]:.3f} at step {lora['evals'][-1][2]}, "
              f"QLoRA {qlora['evals'][-1][1]:.3f} at step {qlora['evals'][-1][2]}")


if __name__ == "__main__":
    main()
