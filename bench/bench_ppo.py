"""PPO step time, peak memory and forward passes per role: pagedrl against TRL 1.12's
`trl.experimental.ppo.PPOTrainer` (the last TRL release that ships it), one run, both printed with
the ratios.

Same models: the policy is the default SmolLM2-135M-Instruct; the reward model is a one-label
`LlamaForSequenceClassification` on the policy's backbone with a fresh head (drawn once, saved as a
Hugging Face folder that both load), and the critic (TRL: `value_model`) starts from it, as does
pagedrl's by default; the reference is a frozen copy of the policy on both sides. Same batch and
settings: the built-in two-digit addition task's first 8 prompts at every update (one completion
each, TRL has no groups), completions of up to 64 tokens stopped at EOS, temperature 0.7,
num_ppo_epochs 4, num_mini_batches 1, no gradient accumulation (one optimizer step = the whole
rollout), kl_coef 0.05, the same precision on both sides (float32 by default; `--bf16 true`: float32
master weights under bf16 autocast, TRL `bf16=True`), `use_cpu=True` for TRL (it generates with
transformers' `generate`, as it does without vLLM). One PPO update = one rollout + its 4 optimizer steps.
Wall seconds and CPU seconds of the process (`time.process_time`) are both reported: on a machine
shared with other jobs only the latter compares the two fairly.

Each trainer runs in its own process, one after the other, each with ONE thread
(`torch.set_num_threads(1)`; on this shared 2-core machine two OpenMP threads per process collapse
whenever another job holds a core), so its peak resident memory (`ru_maxrss`) is its own. Forward
passes are counted with forward hooks on each role's module, split into generation (one per decode
step and one per prefill) and the rest. `--configs` may add `pagedrl-shared`: pagedrl with
`critic: shared` (the value head on the policy's backbone), which TRL does not offer, and
`pagedrl-plain`: pagedrl with `batch_invariant: false` (what bit-exact bf16 rollouts cost).

TRL runs in its own environment (bench/trl112_env.sh):

  bash bench/trl112_env.sh                        # once: /work/.trl112
  .venv/bin/python bench/bench_ppo.py [--updates 2] [--epochs 4] [--configs pagedrl,trl,pagedrl-shared,pagedrl-plain]
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
import time
from collections import Counter
from pathlib import Path

PROMPTS, LENGTH, TEMPERATURE, LR, KL = 8, 64, 0.7, 3e-6, 0.05


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prepare(work: Path) -> dict:
    """The reward model folder (policy backbone + a fresh one-label head) and the prompts: the
    arithmetic task's first 8, written as a dataset that both sides take whole at every update
    (TRL's dataloader shuffles, so this is how both see the same prompts each update)."""
    import torch

    from pagedrl.model.heads import load_sequence_scorer, save_sequence_scorer
    from pagedrl.model.loader import load_model
    from pagedrl.model.resolve import resolve_model_path
    from pagedrl.train.distributed import DistInfo
    from pagedrl.train.rl.config import PPOConfig
    from pagedrl.train.rl.prompts import PromptSource

    policy = resolve_model_path(None)
    rm = work / "reward_model"
    scorer = load_sequence_scorer(policy, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    save_sequence_scorer(scorer, rm)
    loaded = load_model(policy, device="cpu", dtype=torch.float32)
    loaded.tokenizer.save(rm)
    config = PPOConfig(output_dir=str(work / "unused"), reward_model_path=str(rm))
    rows = PromptSource(config, loaded.tokenizer, DistInfo()).take(PROMPTS)
    dataset = work / "prompts.jsonl"
    dataset.write_text("".join(json.dumps({"prompt": r.prompt, **r.columns}) + "\n" for r in rows))
    config.dataset = str(dataset)
    prompts = [r.prompt_ids for r in rows]
    assert sorted(r.prompt_ids for r in PromptSource(config, loaded.tokenizer, DistInfo()).take(PROMPTS)) == sorted(prompts)
    return {"policy": str(policy), "reward_model": str(rm), "dataset": str(dataset), "prompts": prompts}


def count_forwards(modules: dict, counts: Counter, generating: list[bool]) -> None:
    for role, module in modules.items():
        if module is None:
            continue

        def hook(mod, args, out, role=role):
            counts[f"{role} (generation)" if generating[0] else role] += 1

        module.register_forward_hook(hook)


def run_pagedrl(setup: dict, updates: int, epochs: int, out: Path, critic: str | None = None,
                batch_invariant: bool | None = None) -> dict:
    import pagedrl.train.algorithms.ppo as ppo_module
    from pagedrl.train.algorithms.ppo import PPO, run_ppo
    from pagedrl.train.rl.config import PPOConfig
    from pagedrl.train.trainer import Trainer

    counts: Counter = Counter()
    generating = [False]
    step_cpu: list[float] = []
    generate_cpu: list[float] = []
    real_init, real_sample, real_step = PPO.__init__, ppo_module.sample, Trainer.run_step

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        count_forwards({"policy": self.policy, "reference": self.ref_model, "reward model": self.reward_model,
                        "critic": self.model.critic}, counts, generating)
        cast = self.llm.engine.runner.cast  # under bf16 the engine runs a twin holding bf16 copies
        if cast is not None:
            count_forwards({"policy": cast.twin}, counts, generating)

    def sample(*args, **kwargs):
        generating[0] = True
        t0 = time.process_time()
        try:
            return real_sample(*args, **kwargs)
        finally:
            generate_cpu.append(time.process_time() - t0)
            generating[0] = False

    def run_step(self):
        t0 = time.process_time()
        real_step(self)
        step_cpu.append(time.process_time() - t0)

    PPO.__init__, ppo_module.sample, Trainer.run_step = init, sample, run_step
    config = PPOConfig(dataset=setup["dataset"], output_dir=str(out), reward_model_path=setup["reward_model"],
                       critic=critic,
                       per_device_train_batch_size=PROMPTS, gradient_accumulation_steps=1, num_generations=1,
                       num_mini_batches=1, num_ppo_epochs=epochs, max_completion_length=LENGTH,
                       temperature=TEMPERATURE, learning_rate=LR, lr_scheduler_type="constant", kl_coef=KL,
                       max_steps=updates * epochs, logging_steps=1, save_steps=None, report_to=["jsonl"],
                       eval_steps=None, bf16=os.environ.get("BENCH_BF16") == "1", batch_invariant=batch_invariant)
    run_ppo(config, progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time" in r]
    per_update = [sum(r["step_time"] for r in rows[u * epochs:(u + 1) * epochs]) for u in range(updates)]
    generate = [rows[u * epochs]["rollout/seconds"] for u in range(updates)]
    lengths = [rows[u * epochs]["completions/mean_length"] for u in range(updates)]
    update_cpu = [sum(step_cpu[u * epochs:(u + 1) * epochs]) for u in range(updates)]
    return {"update": per_update, "generate": generate, "update_cpu": update_cpu, "generate_cpu": generate_cpu,
            "mean_length": lengths, "forwards": {k: v / updates for k, v in counts.items()}}


def run_trl(setup: dict, updates: int, epochs: int, out: Path) -> dict:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    counts: Counter = Counter()
    generating = [False]
    generate_seconds: list[float] = []
    generate_cpu: list[float] = []
    lengths: list[float] = []
    real_generate = transformers.GenerationMixin.generate

    def timed_generate(self, *args, **kwargs):
        generating[0] = True
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            output = real_generate(self, *args, **kwargs)
        finally:
            generate_seconds.append(time.perf_counter() - t0)
            generate_cpu.append(time.process_time() - c0)
            generating[0] = False
        new = output.sequences[:, kwargs["input_ids"].shape[1]:]
        ended = (new == tokenizer.eos_token_id).int()
        lengths.append(float(torch.where(ended.any(1), ended.argmax(1) + 1, new.shape[1]).float().mean()))
        return output

    transformers.GenerationMixin.generate = timed_generate
    marks: list[tuple[float, float]] = []

    class Timer(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            marks.append((time.perf_counter(), time.process_time()))

        def on_step_end(self, args, state, control, **kw):
            marks.append((time.perf_counter(), time.process_time()))

    tokenizer = AutoTokenizer.from_pretrained(setup["policy"], padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(setup["policy"], dtype=torch.float32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(setup["reward_model"], dtype=torch.float32)
    value_model = AutoModelForSequenceClassification.from_pretrained(setup["reward_model"], dtype=torch.float32)
    config = PPOConfig(output_dir=str(out), per_device_train_batch_size=PROMPTS, gradient_accumulation_steps=1,
                       num_mini_batches=1, num_ppo_epochs=epochs, total_episodes=updates * PROMPTS,
                       response_length=LENGTH, temperature=TEMPERATURE, stop_token="eos", learning_rate=LR,
                       lr_scheduler_type="constant", kl_coef=KL, bf16=os.environ.get("BENCH_BF16") == "1",
                       use_cpu=True, report_to="none",
                       save_strategy="no", num_sample_generations=0, seed=42, logging_steps=1)
    dataset = Dataset.from_dict({"input_ids": setup["prompts"]})
    trainer = PPOTrainer(args=config, processing_class=tokenizer, model=policy, ref_model=None,
                         reward_model=reward_model, train_dataset=dataset, value_model=value_model,
                         eval_dataset=dataset, callbacks=[Timer()])
    # get_reward runs the reward and value models' backbones directly, not their forward.
    count_forwards({"policy": trainer.model.policy, "reference": trainer.ref_model,
                    "reward model": trainer.reward_model.model, "critic": trainer.model.value_model.model},
                   counts, generating)
    trainer.train()
    per_update = [b[0] - a[0] for a, b in zip(marks, marks[1:], strict=False)]
    update_cpu = [b[1] - a[1] for a, b in zip(marks, marks[1:], strict=False)]
    return {"update": per_update, "generate": generate_seconds, "update_cpu": update_cpu, "generate_cpu": generate_cpu,
            "mean_length": lengths, "forwards": {k: v / updates for k, v in counts.items()},
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__}}


def worker(name: str, setup_file: Path, updates: int, epochs: int, result: Path) -> None:
    import torch

    torch.set_num_threads(1)
    setup = json.loads(setup_file.read_text())
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        if name == "trl":
            data = run_trl(setup, updates, epochs, out)
        else:  # pagedrl, pagedrl-shared (the critic on the policy's backbone), pagedrl-plain (no batch invariance)
            data = run_pagedrl(setup, updates, epochs, out, critic="shared" if name == "pagedrl-shared" else None,
                               batch_invariant=False if name == "pagedrl-plain" else None)
    data["peak_rss_mib"] = peak_rss_mib()
    result.write_text(json.dumps(data))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4, help="num_ppo_epochs")
    parser.add_argument("--configs", default="pagedrl,trl", help="any of pagedrl, trl, pagedrl-shared, pagedrl-plain")
    parser.add_argument("--trl-python", default=os.environ.get("TRL112_PYTHON", "/work/.trl112/bin/python"))
    parser.add_argument("--worker", default=None)
    parser.add_argument("--setup", default=None)
    parser.add_argument("--result", default=None)
    parser.add_argument("--save", default=None, help="also write the raw figures to this JSON file")
    parser.add_argument("--report", default=None, help="print the report of a --save file and exit")
    parser.add_argument("--bf16", choices=("true", "false"), default="false",
                        help="both sides under bf16 autocast on float32 master weights")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, Path(args.setup), args.updates, args.epochs, Path(args.result))
        return
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        report(saved["results"], saved["updates"], saved["epochs"], saved.get("precision", "float32"))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "BENCH_BF16": "1" if args.bf16 == "true" else "0"}
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        setup = work / "setup.json"
        setup.write_text(json.dumps(prepare(work)))
        for name in args.configs.split(","):
            python, run_env = sys.executable, env
            if name == "trl":  # TRL 1.12's environment sees neither pagedrl's sources nor its packages
                python, run_env = args.trl_python, {k: v for k, v in env.items() if k != "PYTHONPATH"}
            result = work / f"{name}.json"
            t0 = time.perf_counter()
            subprocess.run([python, __file__, "--worker", name, "--setup", str(setup), "--updates", str(args.updates),
                            "--epochs", str(args.epochs), "--result", str(result)], check=True, env=run_env)
            results[name] = json.loads(result.read_text())
            results[name]["process_s"] = time.perf_counter() - t0
    precision = "bf16 autocast" if args.bf16 == "true" else "float32"
    if args.save:
        Path(args.save).write_text(json.dumps({"results": results, "updates": args.updates, "epochs": args.epochs,
                                               "precision": precision}))
    report(results, args.updates, args.epochs, precision)


def report(results: dict, updates: int, epochs: int, precision: str = "float32") -> None:
    versions = results.get("trl", {}).get("versions", {})
    print(f"\nPPO, SmolLM2-135M {precision}, 1 thread per process, {PROMPTS} prompts x 1 completion of <= {LENGTH} "
          f"tokens, num_ppo_epochs {epochs}, num_mini_batches 1, {updates} updates; TRL {versions}")
    med = statistics.median
    print(f"{'':14} {'update s':>9} {'generate s':>11} {'rest s':>7} {'CPU s':>7} {'generate':>9} {'rest':>6} "
          f"{'peak RSS MiB':>13} {'process s':>10}  wall s of each update; mean completion length")
    for name, r in results.items():
        update, gen, cpu, gen_cpu = (med(r[k]) for k in ("update", "generate", "update_cpu", "generate_cpu"))
        print(f"{name:14} {update:9.1f} {gen:11.1f} {update - gen:7.1f} {cpu:7.1f} {gen_cpu:9.1f} {cpu - gen_cpu:6.1f} "
              f"{r['peak_rss_mib']:13.0f} {r['process_s']:10.0f}  {[round(x, 1) for x in r['update']]}; "
              f"{[round(x, 1) for x in r['mean_length']]}")
    print("forward passes per update (no-grad and with grad together; generation: one per decode step):")
    roles = sorted({k for r in results.values() for k in r["forwards"]})
    for role in roles:
        print(f"  {role:20} " + "  ".join(f"{n} {r['forwards'].get(role, 0):g}" for n, r in results.items()))
    for name in (n for n in results if n.startswith("pagedrl") and "trl" in results):
        p, t = results[name], results["trl"]
        for unit, u, g in (("wall", "update", "generate"), ("CPU", "update_cpu", "generate_cpu")):
            ratio = med(t[u]) / med(p[u])
            gen, rest = med(t[g]) / med(p[g]), (med(t[u]) - med(t[g])) / (med(p[u]) - med(p[g]))
            print(f"{name}: speed-up, {unit} seconds (TRL median update / {name}'s): {ratio:.2f}x (goal >= 3x); "
                  f"generation {gen:.2f}x, the rest {rest:.2f}x")
        print(f"{name}: peak memory ({name} / TRL): {p['peak_rss_mib'] / t['peak_rss_mib']:.2f}x (goal <= 1x)")

if __name__ == "__main__":
    main()
