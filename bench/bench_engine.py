"""The engine benchmarks of issue 3, on the default SmolLM2-135M-Instruct, in one run, in each
precision of `--dtypes` (default: the chosen one, `auto`, and float32; transformers runs in the same
dtype as pagedrl each time, and the last line compares pagedrl's precisions).

1. Throughput: the same requests through `LLM.generate` and through transformers' `generate` in
   static batches (requests in order, each batch left-padded and run to its longest output, with
   `min_new_tokens = max_new_tokens` so EOS cannot end it early: the usual static baseline).
   Output and total (prompt + output) tokens/s over the whole run, prefill included. pagedrl runs
   twice: with `LLM()`'s defaults (a 4 GiB KV cache on a CPU), and with a KV cache that holds
   every request at once (what a GPU's free memory would give), so nothing waits or is preempted.
2. Roofline: decode FLOP/s at `--roofline-seqs` concurrent sequences against the matmul peak of
   this machine in the first dtype of `--dtypes` (best `torch.mm` of large square matrices),
   measured in the same process.
   FLOPs are every matmul the step runs: 2 * (decoder-layer parameters + the LM head's) per token,
   plus attention (4 * keys * heads * head_dim per token and layer); the figure without the LM head
   is shown too.
3. KV memory: over workload 1, each step, the tokens whose keys and values are in the cache over
   the slots of the blocks held (blocks used * block_size), averaged over steps. The peer's figure
   is what the static batches of part 1 held: each row padded to its batch's longest prompt and
   longest output, a finished row held to the end.
4. Shared prefix: one 512-token prompt, n=16 samples of 128 tokens: peak blocks held, against the
   ideal (the prompt's blocks once + 16 completions' blocks) and against no sharing (16 separate
   requests, prefix caching off).

Absolute times drift on a shared machine (the load average is printed); ratios hold better.

    .venv/bin/python bench/bench_engine.py --no-fit          # the run recorded in RESULTS.md
    .venv/bin/python bench/bench_engine.py --num-requests 32 --scale 0.25 --parts throughput,kv
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import random
import time
from dataclasses import dataclass

import torch

from pagedrl import LLM, SamplingParams
from pagedrl.demo.paged import (
    Request,
    Run,
    load_transformers_model,
    make_workload,
    prefix_sharing,
    run_pagedrl,
    run_transformers,
)
from pagedrl.model.resolve import resolve_model_path

PARTS = ("throughput", "roofline", "kv", "prefix")


def hf_kv_bytes(config, workload: list[Request], batch_size: int, element_size: int) -> int:
    """Keys and values the largest static batch holds at its last step."""
    rows = max(min(batch_size, len(workload) - i) * (max(len(r.prompt) for r in workload[i:i + batch_size])
                                                     + max(r.max_tokens for r in workload[i:i + batch_size]))
               for i in range(0, len(workload), batch_size))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return rows * config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element_size


def matmul_peak(sizes: tuple[int, ...] = (2048, 4096), repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best FLOP/s of `torch.mm` on large square matrices in `dtype`."""
    best = 0.0
    for n in sizes:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        torch.mm(a, b, out=out)
        for _ in range(repeats):
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            best = max(best, 2 * n**3 / (time.perf_counter() - start))
    return best


@dataclass
class Roofline:
    num_seqs: int
    mean_context: float
    step_seconds: float
    flops: float  # per step: 2 * decoder-layer params * tokens + attention
    head_flops: float  # per step: the LM head's projection, not counted in `flops`


def roofline(model, tokenizer, num_seqs: int, context: int, steps: int, vocab: int) -> Roofline:
    """Median time of a decode step with `num_seqs` sequences of about `context` tokens each."""
    cfg = model.config
    budget = 2048  # max_num_batched_tokens
    # Long enough that the first sequences admitted are still decoding when the last prompt is in.
    max_tokens = steps + 8 + 2 * math.ceil(num_seqs * context / budget)
    llm = LLM.from_module(model, tokenizer, max_num_seqs=num_seqs, max_num_batched_tokens=budget,
                          kv_cache_tokens=num_seqs * (context + max_tokens + 16))
    engine = llm.engine
    rng = random.Random(1)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(num_seqs):
        engine.add_request([rng.randrange(16, vocab) for _ in range(context)], params)
    while engine.scheduler.waiting or any(s.num_output_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    running = engine.scheduler.running
    assert len(running) == num_seqs, f"only {len(running)} of {num_seqs} sequences run at once"
    # The decoder layers' weights (norms included, a rounding error): the embedding is a lookup, and
    # the LM head's projection is counted apart whether or not it is tied to the embedding.
    layer_params = sum(p.numel() for n, p in model.named_parameters()
                       if not n.startswith(("model.embed_tokens.", "lm_head.")))
    times, flops, contexts = [], [], []
    for _ in range(steps):
        keys = [s.num_computed_tokens + 1 for s in running]  # each query's key count this step
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        attention = sum(cfg.num_hidden_layers * 4 * k * cfg.num_attention_heads * cfg.head_dim for k in keys)
        flops.append(2 * layer_params * num_seqs + attention)
        contexts.append(sum(keys) / num_seqs)
        assert len(engine.scheduler.running) == num_seqs
    order = sorted(range(steps), key=times.__getitem__)
    mid = order[steps // 2]
    head = 2 * cfg.hidden_size * cfg.vocab_size * num_seqs
    result = Roofline(num_seqs, contexts[mid], times[mid], flops[mid], head)
    for rid in list(engine.requests):
        engine.abort_request(rid)
    return result


def shared_prefix(model, tokenizer, vocab: int, prompt_len: int = 512, n: int = 16, max_tokens: int = 128) -> None:
    rng = random.Random(2)
    prompt = [rng.randrange(16, vocab) for _ in range(prompt_len)]
    p = prefix_sharing(model, tokenizer, prompt, n, max_tokens)
    gc.collect()
    print(f"[prefix] n={n} x {max_tokens} tokens from one {prompt_len}-token prompt, block_size {p.block_size}")
    print(f"[prefix]   no sharing ({n} requests, prefix caching off): peak {p.unshared} blocks")
    print(f"[prefix]   ideal (prompt once + {n} completions):         {p.ideal} blocks")
    print(f"[prefix]   pagedrl (n={n}, forked prompt):                peak {p.shared} blocks")
    print(f"[prefix]   pagedrl / ideal = {p.shared / p.ideal:.3f} (goal <= 1.05); no sharing / pagedrl = "
          f"{p.unshared / p.shared:.2f}x")


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def load_avg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def throughput_and_kv(llm: LLM, args: argparse.Namespace, parts: set[str], vocab: int) -> float:
    """Parts 1 and 3 for one engine (and transformers in the engine's dtype); pagedrl's output tok/s
    with LLM()'s defaults (0 when only the KV part ran)."""
    model, tokenizer = llm.engine.model, llm.tokenizer
    llm.generate([[100, 200, 300]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    result = 0.0
    if parts & {"throughput", "kv"}:
        workload = make_workload(args.num_requests, args.scale, vocab)
        prompt_tokens = sum(len(r.prompt) for r in workload)
        output_tokens = sum(r.max_tokens for r in workload)
        print(f"[workload] {len(workload)} requests, {prompt_tokens} prompt + {output_tokens} output tokens "
              f"(scale {args.scale}), ignore_eos, greedy")
        # Two KV budgets: LLM()'s CPU default, and one that holds every request at once (what a
        # GPU's free memory would give), so that no request waits for memory or is preempted.
        block = llm.block_size
        fit = sum(math.ceil((len(r.prompt) + r.max_tokens) / block) * block for r in workload)
        configs = {"defaults": llm}
        if not args.no_fit:
            configs["KV fits all"] = LLM.from_module(model, tokenizer, kv_cache_tokens=fit)
        ours: dict[str, Run] = {}
        for name, engine_llm in configs.items():
            cfg = engine_llm.engine.config
            kv_tokens = engine_llm.engine.kv_manager.num_blocks_total * cfg.block_size
            kv_gib = engine_llm.engine.kv_cache.nbytes / 2**30
            ours[name] = run = run_pagedrl(engine_llm, workload)
            print(f"[pagedrl, {name}] {kv_tokens} KV tokens ({kv_gib:.2f} GiB), max_num_seqs {cfg.max_num_seqs}, "
                  f"max_num_batched_tokens {cfg.max_num_batched_tokens}: {run.seconds:.1f} s, "
                  f"{len(run.kv_live)} steps, {engine_llm.stats()['num_preemptions']} preemptions, "
                  f"load average {load_avg()}")
        del configs
        gc.collect()
        peer_kv = None
        if "throughput" in parts:
            hf, pad = load_transformers_model(resolve_model_path(None), model.dtype)
            run_transformers(hf, workload[:2], 2, pad)  # warm-up
            peer, peer_kv = run_transformers(hf, workload, args.hf_batch_size, pad)
            hf_gib = hf_kv_bytes(hf.config, workload, args.hf_batch_size, model.dtype.itemsize) / 2**30
            print(f"[transformers] static batches of {args.hf_batch_size} (largest holds {hf_gib:.2f} GiB of KV): "
                  f"{peer.seconds:.1f} s, load average {load_avg()}")
            for name, run in ours.items():
                agree = sum(common_prefix(x, y) for x, y in zip(run.outputs, peer.outputs, strict=True))
                print(f"[throughput] pagedrl ({name}) and transformers agree on {agree / output_tokens:.1%} of "
                      f"output tokens up to the first difference (rounding differs)")
            for name, run in ours.items():
                print(f"[throughput] output tok/s: transformers {peer.output_tps:.1f} | pagedrl ({name}) "
                      f"{run.output_tps:.1f} | ratio {run.output_tps / peer.output_tps:.2f}x (goal >= 3x)")
                print(f"[throughput] total tok/s:  transformers {peer.total_tps:.1f} | pagedrl ({name}) "
                      f"{run.total_tps:.1f} | ratio {run.total_tps / peer.total_tps:.2f}x")
            del hf
            gc.collect()
        result = ours["defaults"].output_tps
        for name, run in ours.items():
            line = (f"[kv] live tokens / allocated slots, mean over {len(run.kv_live)} steps: pagedrl ({name}) "
                    f"{run.kv_utilisation:.1%}")
            if peer_kv is not None:
                line += f" | static batches (transformers) {peer_kv:.1%}"
            print(line + " (goal >= 95%)")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies prompt and output lengths")
    parser.add_argument("--hf-batch-size", type=int, default=32, help="static batch size of the baseline")
    parser.add_argument("--roofline-seqs", type=int, default=256)
    parser.add_argument("--roofline-context", type=int, default=128)
    parser.add_argument("--roofline-steps", type=int, default=5)
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--dtypes", default="auto,float32",
                        help="comma-separated precisions to run the throughput part in (auto, float32, bfloat16)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16"),
                        help="pagedrl's KV cache (bfloat16: a float32 engine's cache in bf16; transformers' stays its own)")
    parser.add_argument("--no-fit", action="store_true",
                        help="run workload 1 with LLM()'s defaults only, not also with a KV cache that fits it")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        raise ValueError(f"--parts must be a subset of {PARTS}, got {sorted(parts)}")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {load_avg()}")

    dtypes = args.dtypes.split(",")
    first = LLM(dtype=dtypes[0])
    model, tokenizer = first.engine.model, first.tokenizer
    vocab = model.config.vocab_size
    peak = matmul_peak(dtype=model.dtype)
    print(f"[roofline] {model.dtype} matmul peak (torch.mm 2048/4096, best of 5): {peak / 1e9:.1f} GFLOP/s")
    del first
    by_dtype: dict[str, float] = {}
    for name in dtypes:
        llm = LLM(dtype=name, kv_cache_dtype=args.kv_cache_dtype)
        print(f"[precision] {name}: {llm.precision.describe()}; KV cache in {llm.engine.kv_cache.dtype}")
        by_dtype[str(llm.engine.model.dtype)] = throughput_and_kv(llm, args, parts, vocab)
        del llm
        gc.collect()
    if len(by_dtype) == 2 and "throughput" in parts:
        (low, low_tps), (high, high_tps) = sorted(by_dtype.items(), key=lambda kv: -kv[1])
        print(f"[precision] pagedrl output tok/s: {low} {low_tps:.1f} | {high} {high_tps:.1f} | "
              f"ratio {low_tps / high_tps:.2f}x")

    if "roofline" in parts:
        r = roofline(model, tokenizer, args.roofline_seqs, args.roofline_context, args.roofline_steps, vocab)
        achieved = (r.flops + r.head_flops) / r.step_seconds
        layers_only = r.flops / r.step_seconds
        print(f"[roofline] decode step, {r.num_seqs} sequences, mean context {r.mean_context:.0f}: "
              f"{r.step_seconds * 1e3:.0f} ms (median of {args.roofline_steps})")
        print(f"[roofline] achieved {achieved / 1e9:.1f} GFLOP/s (every matmul of the step: 2 x (decoder-layer "
              f"params + LM head) per token, plus attention) | peak {peak / 1e9:.1f} | {achieved / peak:.1%} of peak "
              f"(goal >= 60%)")
        print(f"[roofline]   without the LM head's projection: {layers_only / 1e9:.1f} GFLOP/s, "
              f"{layers_only / peak:.1%} of peak")
        gc.collect()

    if "prefix" in parts:
        shared_prefix(model, tokenizer, vocab)
    print(f"load average at the end {load_avg()}")


if __name__ == "__main__":
    main()
