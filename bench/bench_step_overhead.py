"""The engine's own work per step: everything a decode step does but the model's forward.

256 sequences decode together on a 1-layer tiny model (the tests' SmolLM2-like family: hidden 64,
4 heads, 1 KV head, a 211-token vocabulary) on one CPU thread, so the model's arithmetic is small
and what is left is the engine: scheduling, block tables and slot mappings, attention metadata,
sampling, appending tokens, stop checks and outputs. Each step is timed whole, and the model's
forward (decoder layers, attention included) and the vocabulary projection are timed inside it;
the overhead is the difference. Only steps where all sequences decode (one new token each) count.

    PYTHONPATH=src python3 bench/bench_step_overhead.py [--num-seqs 256] [--steps 64] [--vocab 211]
    git worktree add /tmp/pagedrl-before addc16c    # the engine before its persistent batch
    PYTHONPATH=src python3 bench/bench_step_overhead.py --baseline /tmp/pagedrl-before/src

Requests ask for FINAL_ONLY outputs, as `LLM.generate` and every trainer's rollouts do, for DELTA
outputs, as the server's streams do, and for CUMULATIVE ones (SamplingParams' default, and the only
kind before output kinds existed: `--kinds CUMULATIVE` against such a checkout). Alone, the peer figure is the model's own forward (how
many forwards the engine's work costs per step). With `--baseline`, the peer is another checkout's
engine on the same work: each configuration runs in fresh processes, one thread each, the two
checkouts taking turns (`--rounds` each), and the medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def build_llm(vocab: int, num_seqs: int):
    from tiny import FAMILIES

    from pagedrl.engine.llm import LLM
    from pagedrl.model.config import ModelConfig
    from pagedrl.model.decoder import CausalLM

    torch.manual_seed(0)
    config = ModelConfig.from_dict(dict(FAMILIES["smollm2-like"], num_hidden_layers=1, vocab_size=vocab,
                                        max_position_embeddings=4096))
    model = CausalLM(config).eval()
    return LLM.from_module(model, kv_cache_tokens=num_seqs * 512, max_num_seqs=num_seqs,
                           max_num_batched_tokens=8192)


def measure(num_seqs: int, steps: int, vocab: int, temperature: float, profile: bool,
            output_kind: str = "FINAL_ONLY") -> dict[str, float]:
    from pagedrl.engine import sampling_params

    llm = build_llm(vocab, num_seqs)
    engine = llm.engine
    rng = random.Random(0)
    kinds = getattr(sampling_params, "RequestOutputKind", None)
    if kinds is None and output_kind != "CUMULATIVE":  # an engine from before output kinds
        raise SystemExit(f"this checkout has no output kinds: only CUMULATIVE, not {output_kind}")
    kind = {} if kinds is None else {"output_kind": kinds[output_kind]}
    params = sampling_params.SamplingParams(temperature=temperature, max_tokens=steps + 1, ignore_eos=True,
                                            seed=None, **kind)
    for _ in range(num_seqs):
        engine.add_request([rng.randrange(3, vocab) for _ in range(rng.randint(16, 64))], params)
    inner: list[float] = []

    def timed(fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            result = fn(*args, **kwargs)
            inner.append(time.perf_counter() - t)
            return result
        return wrapper

    model, runner = engine.model, engine.runner
    model.forward = timed(model.forward)
    runner.project = timed(runner.project)
    step_times, model_times = [], []
    profiler = cProfile.Profile() if profile else None
    while engine.has_unfinished_requests():
        decoding = len(engine.scheduler.running) == num_seqs and all(
            s.num_computed_tokens + 1 == s.num_tokens for s in engine.scheduler.running)
        inner.clear()
        if decoding and profiler is not None:
            profiler.enable()
        t = time.perf_counter()
        engine.step()
        elapsed = time.perf_counter() - t
        if decoding and profiler is not None:
            profiler.disable()
        if decoding:
            step_times.append(elapsed)
            model_times.append(sum(inner))
    if profiler is not None:
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)
    step = statistics.median(step_times)
    forward = statistics.median(model_times)
    overheads = [s - m for s, m in zip(step_times, model_times, strict=True)]
    return {"steps": len(step_times), "step_ms": 1000 * step, "forward_ms": 1000 * forward,
            "overhead_ms": 1000 * statistics.median(overheads)}


CONFIGS = [(0.0, "FINAL_ONLY"), (1.0, "FINAL_ONLY"), (0.0, "DELTA"), (1.0, "DELTA"), (0.0, "CUMULATIVE"),
           (1.0, "CUMULATIVE")]


def run_worker(src: str, args: argparse.Namespace, temperature: float, kind: str) -> dict[str, float]:
    """One measurement in a fresh process on the pagedrl sources under `src` (one thread)."""
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    cmd = [sys.executable, __file__, "--worker", "--num-seqs", str(args.num_seqs), "--steps", str(args.steps),
           "--vocab", str(args.vocab), "--temperature", str(temperature), "--output-kind", kind]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare(args: argparse.Namespace) -> None:
    ours_src = str(Path(__file__).resolve().parents[1] / "src")
    print(f"{args.num_seqs} sequences decoding, 1-layer tiny model, vocabulary {args.vocab}, one thread per process; "
          f"medians over the all-decode steps, then over {args.rounds} rounds of alternating processes")
    print(f"baseline: {args.baseline}")
    print("| temperature | outputs | overhead, baseline (ms) | overhead, this checkout (ms) | ratio | "
          "forward + logits, baseline / this (ms) |")
    print("|---|---|---|---|---|---|")
    for temperature, kind in [c for c in CONFIGS if c[1] in args.kinds.split(",")]:
        base, ours = [], []
        for _ in range(args.rounds):
            base.append(run_worker(args.baseline, args, temperature, kind))
            ours.append(run_worker(ours_src, args, temperature, kind))
        b = statistics.median(r["overhead_ms"] for r in base)
        o = statistics.median(r["overhead_ms"] for r in ours)
        bf = statistics.median(r["forward_ms"] for r in base)
        of = statistics.median(r["forward_ms"] for r in ours)
        print(f"| {temperature} | {kind} | {b:.2f} | {o:.2f} | **{b / o:.2f}x** | {bf:.2f} / {of:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=211)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="print where the decode steps' time goes")
    parser.add_argument("--baseline", help="src folder of another pagedrl checkout to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kinds", default="FINAL_ONLY,DELTA,CUMULATIVE",
                        help="output kinds to measure (an engine from before output kinds has CUMULATIVE only)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--temperature", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--output-kind", default="FINAL_ONLY", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        r = measure(args.num_seqs, args.steps, args.vocab, args.temperature, False, args.output_kind)
        print(json.dumps(r))
        return
    if args.baseline:
        compare(args)
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); {args.num_seqs} sequences decoding, "
          f"1-layer tiny model, vocabulary {args.vocab}; medians over the all-decode steps")
    for temperature, kind in [c for c in CONFIGS if c[1] in args.kinds.split(",")]:
        r = measure(args.num_seqs, args.steps, args.vocab, temperature, args.profile, kind)
        print(f"temperature {temperature}, {kind}: {r['steps']} steps | step {r['step_ms']:.2f} ms | model forward + "
              f"logits {r['forward_ms']:.2f} ms | engine overhead {r['overhead_ms']:.2f} ms "
              f"({r['overhead_ms'] / r['forward_ms']:.1f}x the forward)")


if __name__ == "__main__":
    main()
