"""The engine's threads on a machine another process keeps busy: 1 or 2 OpenMP threads, bound to cores
or not, with and without a neighbour spinning on one core.

Each configuration runs in a fresh process (OpenMP reads its binding when torch loads): pagedrl's
default precision, the workloads of `bench_vllm_cpu.py` (`single`: one 128-token prompt, 64 greedy
tokens; `16x128`: 16 prompts of 32-512 tokens, 128 tokens each). The neighbour is a Python loop
pinned to the last core (`os.sched_setaffinity`), started before the engine and killed after it.
Binding is the engine's own (`PAGEDRL_CPU_THREADS_BIND=auto`, its default: thread i on core i, never
moved) against `nobind`; `--omp-bind` uses libgomp's `OMP_PROC_BIND=close OMP_PLACES=cores` instead.
Configurations take turns `--rounds` times; the best turn of each counts.

    .venv/bin/python bench/bench_threads.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import subprocess
import sys
import time

from bench_vllm_cpu import workload


def spin(core: int) -> None:
    os.sched_setaffinity(0, {core})
    while True:
        pass


def worker(names: list[str]) -> None:
    from pagedrl import LLM, SamplingParams

    llm = LLM(kv_cache_bytes=4 << 30, enable_prefix_caching=False)
    warm, _ = workload("16x128", llm.vocab_size, seed=99)
    llm.generate(warm[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    out = {}
    for name in names:
        prompts, max_tokens = workload(name, llm.vocab_size)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        out[name] = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    print("RESULT " + json.dumps(out))


def run(threads: int, bind: bool, neighbour: bool, names: list[str], omp_bind: bool = False) -> dict[str, float]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PAGEDRL_CPU_THREADS_BIND="auto" if bind else "nobind")
    if bind and omp_bind:
        env.update(OMP_PROC_BIND="close", OMP_PLACES="cores", PAGEDRL_CPU_THREADS_BIND="nobind")
    spinner = None
    if neighbour:
        spinner = multiprocessing.Process(target=spin, args=(os.cpu_count() - 1,), daemon=True)
        spinner.start()
    try:
        done = subprocess.run([sys.executable, __file__, "--worker", ",".join(names)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, timeout=1800)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.join()
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"worker failed with exit code {done.returncode}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default="single,16x128")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--omp-bind", action="store_true", help="bind with libgomp's variables, not the engine")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker.split(","))
        return
    names = args.workloads.split(",")
    configs = list(itertools.product((False, True), (1, 2), (False, True)))  # neighbour, threads, bind
    best: dict[tuple, dict[str, float]] = {c: {} for c in configs}
    print(f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}")
    for r in range(args.rounds):
        for neighbour, threads, bind in configs:
            result = run(threads, bind, neighbour, names, args.omp_bind)
            for name in names:
                best[(neighbour, threads, bind)][name] = max(best[(neighbour, threads, bind)].get(name, 0.0),
                                                             result[name])
            print(f"round {r + 1}: neighbour {'on ' if neighbour else 'off'}, {threads} thread(s), "
                  f"{'bound  ' if bind else 'unbound'}: " + ", ".join(f"{n} {result[n]:.1f} tok/s" for n in names),
                  flush=True)
    print("\n| neighbour spinning | threads | bound | " + " | ".join(f"{n} tok/s" for n in names) + " |")
    print("|---" * (3 + len(names)) + "|")
    for neighbour, threads, bind in configs:
        row = best[(neighbour, threads, bind)]
        print(f"| {'yes' if neighbour else 'no'} | {threads} | {'yes' if bind else 'no'} | "
              + " | ".join(f"{row[n]:.1f}" for n in names) + " |")


if __name__ == "__main__":
    main()
