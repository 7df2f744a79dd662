"""Decode steps through the decoder's modules (`enforce_eager=True`) against the same steps as one
straight program of the kernels (`engine/cpu_decode.py`), and that program under `torch.compile`.
`--dtype float32` measures the float32 engine (the float32 kernel and the row-wise kernels' float32
forms); its side `modules-torch` is the modules with torch's own norms, SiLU and rotary embedding
(the float32 engine before the row-wise kernels took float32).

Each side runs in its own process, turns alternating `--rounds` times, best turn counted (a shared
machine only slows a turn down): the default model in `--dtype` (bf16), `--threads` (2), `--rows` sequences of 128
prompt tokens decoding together, the median of 60 decode steps after 20 (whole `LLMEngine.step`
calls: scheduling, forward, sampling, outputs; `compiled`: 5 after 3). Greedy tokens of the sides are compared.

`loop` is the float32 program with its layers as a Python loop of op calls (what `program` ran before its
layers went to the kernels in one call, `ops.decode_layers`). `--weights q4_1-a8` / `q8_0-a8`: the default
model's Q4_1 GGUF (or its Q8_0 requantization, `bench_vllm_cpu.gguf_file`) kept quantized, on 8-bit
activations (float32 engine).

`compiled` wraps the program's `forward` (its layers, after the weights are listed) in `torch.compile` (inductor, default options) and reports its
first call (the compile) apart. The engine keeps every layer's keys and values as views of one
buffer, as it allocates them.

    .venv/bin/python bench/bench_decode_program.py --rows 1,16,64 --rounds 3
    .venv/bin/python bench/bench_decode_program.py --rows 1 --rounds 1 --sides modules,program,compiled
    .venv/bin/python bench/bench_decode_program.py --dtype float32 --sides modules-torch,modules,program
    .venv/bin/python bench/bench_decode_program.py --weights q8_0-a8 --sides loop,program --rows 1,16 --threads 1
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


def worker(side: str, rows: int, dtype: str, threads: int, weights: str) -> dict:
    from pagedrl import LLM, SamplingParams
    from pagedrl.engine import cpu_decode, cpu_routes
    from pagedrl.model.routed import Routes

    torch.set_num_threads(threads)
    if side == "modules-torch":  # torch's own row-wise pieces in a float32 step
        none = cpu_routes._not_taken
        cpu_routes.FLOAT_ROUTES = Routes(linear=cpu_routes.float_rows, rms_norm=none, silu_mul=none, rope=none)
    if side == "loop":  # the program's layers as Python calls
        cpu_decode.flat_layers = lambda model, layers, bf16: None
    settings = dict(kv_cache_bytes=1 << 30, enable_prefix_caching=False, enforce_eager=side.startswith("modules"))
    if weights == "default":
        llm = LLM(dtype=getattr(torch, dtype), **settings)
    else:
        from bench_vllm_cpu import gguf_file

        llm = LLM(str(gguf_file(weights.removesuffix("-a8"))), quantization="gguf", dtype="float32",
                  activations="int8", **settings)
    engine = llm.engine
    program = engine.runner.program
    if not side.startswith("modules") and program is None:
        raise SystemExit("no decode program here (bf16 on a CPU without AVX512-BF16, or AMX)")
    compile_s = None
    if side == "compiled":
        register_fakes()
        program.forward = torch.compile(program.forward)
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    for i in range(rows):
        engine.add_request([100 + (7 * i + j) % 5000 for j in range(128)], params, request_id=str(i))
    engine.step()  # the prompts
    start = time.perf_counter()
    engine.step()  # the first decode step (the compile, when compiled)
    if side == "compiled":
        compile_s = time.perf_counter() - start
    warm, timed = (2, 5) if side == "compiled" else (19, 60)  # a compiled step may take seconds
    for _ in range(warm):
        engine.step()
    times = []
    for _ in range(timed):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    tokens = [list(engine.scheduler.running[0].token_ids[128:]) if engine.scheduler.running else []]
    return {"ms": 1e3 * times[len(times) // 2], "compile_s": compile_s, "tokens": tokens}


def register_fakes() -> None:
    """Output shapes of the kernels' ops, for the compiler's tracing (the engine itself compiles nothing)."""
    from torch.library import register_fake

    register_fake("pagedrl_cpu::rms_norm", lambda x, weight, eps: torch.empty_like(x))
    register_fake("pagedrl_cpu::pair_linear", lambda x, packed, n, bias: x.new_empty(x.shape[0], n))
    register_fake("pagedrl_cpu::pair_silu_mul", lambda x, packed: x.new_empty(x.shape[0], packed.shape[0] // 2 * 32))
    register_fake("pagedrl_cpu::silu_mul", lambda gate, up: torch.empty_like(gate))
    register_fake("pagedrl_cpu::rope", lambda q, k, cos, sin: (torch.empty_like(q), torch.empty_like(k)))
    register_fake("pagedrl_cpu::store_kv", lambda k, v, key_cache, value_cache, slots: None)
    register_fake("pagedrl_cpu::paged_attention", lambda q, kc, vc, tables, seqs, lens, scale, lse:
                  (torch.empty_like(q), q.new_empty(0, dtype=torch.float32)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sides", default="modules,program")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--weights", default="default", choices=["default", "q4_1-a8", "q8_0-a8"])
    parser.add_argument("--worker", nargs=2, metavar=("SIDE", "ROWS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args.dtype, args.threads, args.weights)))
        return
    sides = args.sides.split(",")
    rows_list = [int(r) for r in args.rows.split(",")]
    best: dict[tuple[str, int], dict] = {}
    for round_ in range(args.rounds):
        for rows in rows_list:
            for side in sides if round_ % 2 == 0 else sides[::-1]:
                out = subprocess.run([sys.executable, __file__, "--worker", side, str(rows), "--dtype", args.dtype,
                                      "--threads", str(args.threads), "--weights", args.weights],
                                     capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
                got = json.loads(out)
                print(f"round {round_ + 1}, {rows} rows, {side}: {got['ms']:.2f} ms a step"
                      + (f" (compile {got['compile_s']:.1f} s)" if got["compile_s"] is not None else ""), flush=True)
                if (side, rows) not in best or got["ms"] < best[side, rows]["ms"]:
                    best[side, rows] = got
    compared = "program" in sides[1:]  # the ratio column: the first side against the program, where both ran
    print("\n| rows | " + " | ".join(f"{s} (ms a step)" for s in sides) + (f" | {sides[0]} / program |" if compared else " |"))
    print("|---|" + "---|" * (len(sides) + compared))
    for rows in rows_list:
        cells = [f"{best[s, rows]['ms']:.2f}" for s in sides]
        if compared:
            cells.append(f"{best[sides[0], rows]['ms'] / best['program', rows]['ms']:.2f}x")
        same = all(best[s, rows]["tokens"] == best[sides[0], rows]["tokens"] for s in sides)
        print(f"| {rows} | " + " | ".join(cells) + " |" + ("" if same else " (tokens differ!)"))


if __name__ == "__main__":
    main()
