"""GRPO step time and peak memory: pagedrl against TRL's GRPOTrainer, one run, both printed with
the ratio and each one's split between generation and training.

Same model (the default SmolLM2-135M-Instruct), same prompts (the built-in two-digit addition
task, in the same order), G = 8 completions for each of 8 prompts per step, 64-token completions,
temperature 1.0, learning rate 1e-5, beta 0, the same precision on both sides (`--bf16 true`:
float32 master weights under bf16 autocast; TRL `bf16=True`, `use_cpu=True`; it generates with
transformers, as it does on a machine without vLLM). `pagedrl-float32` in `--configs` is pagedrl
in float32 whatever `--bf16` says, for the bf16 / float32 ratio of one run; `pagedrl-plain` is
pagedrl without batch invariance (`batch_invariant=false`), for what the bit-exact rollouts of a
bf16 CPU run cost. Each trainer runs in its
own process, so its peak resident memory (`ru_maxrss`) is its own.

  .venv/bin/python bench/bench_grpo.py [--steps 3] [--configs pagedrl,pagedrl-plain,pagedrl-float32,trl] [--bf16 true]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

G, PROMPTS, LENGTH, LR = 8, 8, 64, 1e-5


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_pagedrl(steps: int, out: Path, bf16: bool, batch_invariant: bool | None = None) -> dict:
    from pagedrl.train.algorithms.grpo import run_grpo
    from pagedrl.train.rl.config import GRPOConfig

    config = GRPOConfig(dataset="arithmetic", output_dir=str(out), num_generations=G,
                        per_device_train_batch_size=16, gradient_accumulation_steps=PROMPTS * G // 16,
                        max_completion_length=LENGTH, temperature=1.0, learning_rate=LR, lr_scheduler_type="constant",
                        max_steps=steps, beta=0.0, logging_steps=1, save_steps=None, report_to=["jsonl"],
                        task_num_eval=256, bf16=bf16, batch_invariant=batch_invariant)
    run_grpo(config, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time" in r]
    return {"step": [r["step_time"] for r in rows], "generate": [r["rollout/seconds"] for r in rows],
            "reward": [r["reward"] for r in rows],
            "logp_difference": [r["sampling/sampling_logp_difference/mean"] for r in rows]}


def run_trl(steps: int, out: Path, bf16: bool) -> dict:
    import torch
    import transformers
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from pagedrl.model.resolve import resolve_model_path
    from pagedrl.train.rl.arithmetic import ArithmeticTask
    from pagedrl.train.rl.rewards import last_integer_match

    task = ArithmeticTask(num_eval=256, seed=42)  # pagedrl's GRPOConfig default seed is 42
    stream = task.train_rows()
    rows = [next(stream) for _ in range(steps * PROMPTS)]
    dataset = Dataset.from_list(rows)
    generate_seconds = []
    original = transformers.GenerationMixin.generate

    def timed_generate(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            generate_seconds.append(time.perf_counter() - t0)

    transformers.GenerationMixin.generate = timed_generate
    step_ends: list[float] = []

    class Timer(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            step_ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            step_ends.append(time.perf_counter())

    def correct(prompts, completions, completion_ids, answer, **kw):
        return last_integer_match(prompts, completions, completion_ids, answer=answer)

    config = GRPOConfig(output_dir=str(out), per_device_train_batch_size=16, gradient_accumulation_steps=4,
                        num_generations=G, max_completion_length=LENGTH, temperature=1.0, learning_rate=LR,
                        lr_scheduler_type="constant", beta=0.0, max_steps=steps, logging_steps=1, save_strategy="no",
                        report_to="none", bf16=bf16, use_cpu=True, shuffle_dataset=False, seed=42,
                        gradient_checkpointing=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(resolve_model_path(None))
    trainer = GRPOTrainer(model=model, reward_funcs=correct, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    trainer.train()
    spans = [b - a for a, b in zip(step_ends[0::2], step_ends[1::2], strict=True)]
    # TRL generates once per optimizer step here (steps_per_generation = gradient_accumulation_steps),
    # at the first micro-batch of the step.
    per_step_gen = [sum(generate_seconds[i::steps]) for i in range(steps)] if len(generate_seconds) == steps \
        else [sum(generate_seconds) / steps] * steps
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"step": spans, "generate": per_step_gen, "reward": rewards}


def worker(name: str, steps: int, result: Path, bf16: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        if name == "trl":
            data = run_trl(steps, Path(tmp) / "out", bf16)
        else:
            data = run_pagedrl(steps, Path(tmp) / "out", bf16 and name != "pagedrl-float32",
                               False if name == "pagedrl-plain" else None)
    data["peak_rss_mib"] = peak_rss_mib()
    result.write_text(json.dumps(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", default="pagedrl,trl")
    parser.add_argument("--worker", default=None)
    parser.add_argument("--result", default=None)
    parser.add_argument("--bf16", choices=("true", "false"), default="false",
                        help="both sides under bf16 autocast (float32 master weights)")
    args = parser.parse_args()
    bf16 = args.bf16 == "true"
    if args.worker:
        worker(args.worker, args.steps, Path(args.result), bf16)
        return
    results = {}
    for name in args.configs.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, __file__, "--worker", name, "--steps", str(args.steps),
                            "--result", f.name, "--bf16", args.bf16], check=True)
            results[name] = json.loads(Path(f.name).read_text())
    print(f"\nGRPO, SmolLM2-135M {'bf16 autocast' if bf16 else 'float32'}, {PROMPTS} prompts x G={G}, {LENGTH}-token completions, {args.steps} steps")
    print(f"{'':10} {'median step s':>14} {'generate s':>11} {'train s':>9} {'peak RSS MiB':>13}  rewards")
    for name, r in results.items():
        step, gen = statistics.median(r["step"]), statistics.median(r["generate"])
        print(f"{name:10} {step:14.1f} {gen:11.1f} {step - gen:9.1f} {r['peak_rss_mib']:13.0f}  "
              f"{[round(x, 3) for x in r['reward']]}")
        if "logp_difference" in r:
            print(f"{'':10} sampling/sampling_logp_difference/mean per step: "
                  f"{[f'{x:.1e}' for x in r['logp_difference']]}")
    if {"pagedrl", "pagedrl-plain"} <= results.keys():
        ratio = statistics.median(results["pagedrl"]["step"]) / statistics.median(results["pagedrl-plain"]["step"])
        print(f"pagedrl median step / pagedrl-plain median step (what batch invariance costs): {ratio:.2f}x")
    if {"pagedrl", "pagedrl-float32"} <= results.keys():
        ratio = statistics.median(results["pagedrl-float32"]["step"]) / statistics.median(results["pagedrl"]["step"])
        print(f"pagedrl float32 median step / pagedrl median step: {ratio:.2f}x")
    if {"pagedrl", "trl"} <= results.keys():
        ratio = statistics.median(results["trl"]["step"]) / statistics.median(results["pagedrl"]["step"])
        print(f"speed-up (TRL median step / pagedrl median step): {ratio:.2f}x (goal >= 3x)")
        mem = results["trl"]["peak_rss_mib"] / results["pagedrl"]["peak_rss_mib"]
        print(f"peak memory (TRL / pagedrl): {mem:.2f} (goal >= 1)")


if __name__ == "__main__":
    main()
