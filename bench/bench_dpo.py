"""DPO step time and peak memory: pagedrl against TRL's DPOTrainer, one run, both printed with the ratio.

Same model (the default SmolLM2-135M-Instruct folder), same rows (synthetic plain-text pairs of
about 45 prompt and 40 answer tokens), same batch (8 pairs, no accumulation), same precision
(float32 on CPU; `bf16=False` for TRL), no activation checkpointing on either side (TRL turns it
on by default; it trades time for memory, and our loop has it too, off). A step is the policy's
forward and backward, the reference's forward (unless precomputed), clipping and AdamW; TRL's
timer (its on_step_begin/on_step_end callbacks) leaves out fetching and collating the batch, ours
includes it (milliseconds). The reference pass of `precompute_ref_log_probs` runs before the first
step in both trainers and is reported as set-up time, not step time.

Each configuration runs in its own process, so its peak resident memory (`ru_maxrss`, which counts
the Python libraries each trainer imports) is its own. The machine may be shared, so the two
processes of a comparison are started side by side and take turns, one step each (the first to go
alternating), under the same background load; each step's process CPU seconds are reported too.
Each process computes with `--threads` threads (default 1): on a small shared machine two OpenMP
threads that must meet at every barrier stall whenever another job holds one of the cores, which
swamps the difference being measured; one thread each is time-sliced, not stalled.

  trl                 TRL, reference = a second copy of the model
  trl-precompute      TRL, precompute_ref_log_probs=True
  pagedrl             pagedrl, reference = a frozen copy
  pagedrl-precompute  pagedrl, precompute_ref_log_probs: true (one model in memory)

  .venv/bin/python bench/bench_dpo.py [--steps 3] [--warmup 1] [--rows 32] [--batch 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAIRS = (("pagedrl", "trl"), ("pagedrl-precompute", "trl-precompute"))
CONFIGS = tuple(name for pair in PAIRS for name in pair)
WORDS = ("the model answers a question about numbers and words while the reader checks each step of "
         "its reasoning carefully before writing down a short final result for every small example here").split()


def make_rows(n: int, seed: int = 0, prompt_words: int = 40, answer_words: int = 40) -> list[dict]:
    rng = random.Random(seed)

    def text(k: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k))

    return [{"prompt": "Question: " + text(prompt_words) + "\nAnswer:", "chosen": " " + text(answer_words),
             "rejected": " " + text(answer_words)} for _ in range(n)]


class Turns:
    """The worker's side of taking turns: wait for the parent's go, time the step, report it."""

    def __init__(self) -> None:
        self.wall = self.cpu = 0.0

    def begin(self) -> None:
        if sys.stdin.readline().strip() != "STEP":
            sys.exit("bench worker: expected STEP")
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def end(self) -> None:
        wall, cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu
        print("TIME " + json.dumps({"wall": wall, "cpu": cpu}), flush=True)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def ready(setup_s: float, **info: float) -> None:
    print("READY " + json.dumps({"setup_s": setup_s, **info}), flush=True)


def run_pagedrl(args: argparse.Namespace, precompute: bool, out: Path) -> None:
    import torch

    from pagedrl.model.loader import load_model
    from pagedrl.model.resolve import resolve_model_path
    from pagedrl.train.algorithms.dpo import DPO
    from pagedrl.train.checkpointing import seed_everything
    from pagedrl.train.distributed import DistInfo
    from pagedrl.train.offline_config import DPOConfig
    from pagedrl.train.trainer import Trainer

    t0 = time.perf_counter()
    config = DPOConfig(model=str(resolve_model_path(None)), output_dir=str(out), per_device_train_batch_size=args.batch,
                       max_steps=args.warmup + args.steps, learning_rate=1e-6, precompute_ref_log_probs=precompute,
                       use_cpu=True, seed=0, report_to=["none"])
    seed_everything(0)
    loaded = load_model(config.model, device="cpu", dtype=torch.float32)
    dist = DistInfo()
    algorithm = DPO(config, loaded.model, loaded.tokenizer, dist, make_rows(args.rows))
    trainer = Trainer(config, algorithm, dist, progress=False)
    pairs = [getattr(e, "pair", e) for e in algorithm.examples]
    ready(time.perf_counter() - t0, prompt_tokens=statistics.mean(len(p.prompt_ids) for p in pairs),
          answer_tokens=statistics.mean(len(p.chosen_ids) + len(p.rejected_ids) for p in pairs) / 2)
    turns = Turns()
    for step in range(1, args.warmup + args.steps + 1):
        turns.begin()
        trainer.accumulate(step)
        trainer.optimizer_step()
        turns.end()


def run_trl(args: argparse.Namespace, precompute: bool, out: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import DPOConfig, DPOTrainer

    from pagedrl.model.resolve import resolve_model_path

    turns = Turns()

    class TakeTurns(TrainerCallback):
        def on_step_begin(self, *a, **k) -> None:
            turns.begin()

        def on_step_end(self, *a, **k) -> None:
            turns.end()

    t0 = time.perf_counter()
    path = str(resolve_model_path(None))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = DPOConfig(output_dir=str(out), per_device_train_batch_size=args.batch, max_steps=args.warmup + args.steps,
                       learning_rate=1e-6, precompute_ref_log_probs=precompute, bf16=False, use_cpu=True,
                       gradient_checkpointing=False, report_to="none", logging_steps=1000, save_strategy="no",
                       disable_tqdm=True, seed=0)
    trainer = DPOTrainer(model=model, args=config, train_dataset=Dataset.from_list(make_rows(args.rows)),
                         processing_class=AutoTokenizer.from_pretrained(path), callbacks=[TakeTurns()])
    ready(time.perf_counter() - t0)
    trainer.train()


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run = run_trl if args.worker.startswith("trl") else run_pagedrl
        run(args, args.worker.endswith("-precompute"), Path(tmp))
    if sys.stdin.readline().strip() == "DONE":
        print("RESULT " + json.dumps({"peak_rss_mib": peak_rss_mib()}), flush=True)


class Worker:
    """The parent's handle on one configuration's process."""

    def __init__(self, name: str, args: argparse.Namespace, log_dir: Path) -> None:
        self.name = name
        cmd = [sys.executable, __file__, "--worker", name, "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--rows", str(args.rows), "--batch", str(args.batch), "--threads", str(args.threads)]
        threads = str(args.threads)
        env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "TOKENIZERS_PARALLELISM": "false"}
        self.log = log_dir / f"{name}.stderr"
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log.open("w"),
                                     text=True, bufsize=1, env=env)
        self.info = self.expect("READY")
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def expect(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag + " "):
                return json.loads(line[len(tag) + 1:])
        self.proc.wait()
        sys.exit(f"{self.name} failed (exit {self.proc.returncode}):\n{self.log.read_text()[-4000:]}")

    def step(self) -> None:
        self.proc.stdin.write("STEP\n")
        self.proc.stdin.flush()
        t = self.expect("TIME")
        self.wall.append(t["wall"])
        self.cpu.append(t["cpu"])

    def finish(self) -> dict:
        self.proc.stdin.write("DONE\n")
        self.proc.stdin.flush()
        result = self.expect("RESULT")
        self.proc.wait()
        return result


def compare(ours_name: str, peer_name: str, args: argparse.Namespace, log_dir: Path) -> dict[str, dict]:
    """Start both (one after the other, so set-up times are their own), then alternate steps."""
    peer = Worker(peer_name, args, log_dir)
    ours = Worker(ours_name, args, log_dir)
    for k in range(args.warmup + args.steps):
        for w in ((peer, ours) if k % 2 == 0 else (ours, peer)):
            w.step()
    out = {}
    for w in (ours, peer):
        result = w.finish()
        out[w.name] = {**w.info, **result, "wall": w.wall[args.warmup:], "cpu": w.cpu[args.warmup:]}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8, help="pairs per step")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    import torch

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as log_dir:
        for ours, peer in PAIRS:
            results.update(compare(ours, peer, args, Path(log_dir)))
    info = results["pagedrl"]
    print(f"DPO on SmolLM2-135M-Instruct, CPU float32, torch {torch.__version__}, {args.threads} thread(s) per process; "
          f"{args.rows} rows, {args.batch} pairs per step, ~{info['prompt_tokens']:.0f} prompt + "
          f"~{info['answer_tokens']:.0f} answer tokens; medians of {args.steps} steps after {args.warmup} warm-up")
    print(f"{'config':<20} {'step s (wall)':>14} {'step s (CPU)':>13} {'set-up s':>9} {'peak RSS MiB':>13}")
    for name in CONFIGS:
        r = results[name]
        print(f"{name:<20} {statistics.median(r['wall']):>14.2f} {statistics.median(r['cpu']):>13.2f} "
              f"{r['setup_s']:>9.1f} {r['peak_rss_mib']:>13.0f}")
    for ours, peer in PAIRS + (("pagedrl-precompute", "trl"),):
        a, b = results[ours], results[peer]
        wall = statistics.median(b["wall"]) / statistics.median(a["wall"])
        cpu = statistics.median(b["cpu"]) / statistics.median(a["cpu"])
        print(f"{ours} vs {peer}: {wall:.2f}x faster per step ({cpu:.2f}x in CPU seconds), peak memory "
              f"{a['peak_rss_mib']:.0f} vs {b['peak_rss_mib']:.0f} MiB ({a['peak_rss_mib'] / b['peak_rss_mib']:.2f}x)")


if __name__ == "__main__":
    main()
