"""The CUDA path, checked and measured in one run on a machine with a GPU (a few minutes).

1. kernels: the Triton paged-attention kernels against the reference path on the GPU (float32,
   float16, bfloat16; SmolLM2's 9/3 heads of 64, Qwen3-tiny's 24-dim heads, 32/8 heads of 128; a
   batch of fresh prompts, a chunk over a cached prefix and decodes over partial blocks), and one
   layer's attention at 256 decoding sequences of 512 tokens: the kernels against the
   gather-then-SDPA fast path.
2. correctness (float32, TF32 off): for each tiny family of the reference tests (Gemma, gpt-oss and
   DeepSeek-V3 included: windows, caps, sinks and latent attention in the Triton kernels), greedy output
   against transformers' greedy `generate` on the same GPU, with CUDA graphs (the default), with
   `enforce_eager=True` and with the fast attention path; and the logprob contract (sampled-token
   log-probs against a dense recompute, temperature 0.7, top-p 0.8).
3. throughput (bfloat16): workload 1 of `bench_engine.py` (256 requests, prompts 16-512, outputs
   16-256, ignore_eos) through `LLM.generate` (with graphs and eager) and through transformers'
   static batches, on a SmolLM2-135M-shaped model; the ratio.
4. decode_step (bfloat16): 256 sequences decoding together (128-token prompts, 128 new tokens):
   the mean step, and within it the forward pass (graph replay or eager) and the engine's own
   work, with graphs and eager.
5. grpo: a few steps of `run_grpo` on the arithmetic task's batch (8 prompts x G=8, 64 tokens,
   bf16 autocast): step time, rollout time, peak memory, and the engine-trainer log-prob agreement.

    PYTHONPATH=src python3 bench/cuda_check.py [--model-dir DIR] [--parts kernels,correctness,...]
        [--out cuda_check.json]

A dry run of the script's logic on a CPU, small shapes and float32 (no CUDA graphs there):
`TRITON_INTERPRET=1 PYTHONPATH=src python3 bench/cuda_check.py --device cpu --out /tmp/dry.json`.

DIR holds `config.json`, the tokenizer and chat template of a model; when it has no weights, random
ones are written next to it (with `ignore_eos` the work is the same as with real weights). Without
DIR: the default model if its package is installed, else a SmolLM2-135M-shaped config with a small
byte-level tokenizer padded to its vocabulary. Each part runs on its own: one that fails prints
its traceback, is recorded under "errors" and the next one runs. The results so far are written to
the JSON file after every part.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import platform
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from cuda_grpo import grpo
from cuda_models import model_dir

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

DTYPE = torch.bfloat16
DEVICE = "cuda"  # --device cpu (with TRITON_INTERPRET=1) dry-runs the script's logic on small shapes


def log(part: str, text: str) -> None:
    print(f"[{part}] {text}", flush=True)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    """An engine holds reference cycles (its graphs keep a method of its runner): collect them, so the
    next engine's KV cache, sized from free memory, gets the memory back."""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- kernels
def kernels() -> dict[str, Any]:
    from pagedrl.engine.attention import PagedAttention
    from pagedrl.engine.kv_cache import KVCache

    out: dict[str, Any] = {}
    rng = random.Random(0)
    shapes = [(0, 70), (0, 5), (40, 33), (32, 17)] + [(rng.randint(1, 300), 1) for _ in range(12)]
    tolerance = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
    for dtype in (torch.float32, torch.float16, torch.bfloat16)[: 3 if DEVICE == "cuda" else 2]:
        for heads, kv_heads, dim in ((9, 3, 64), (6, 2, 24), (32, 8, 128)):
            gen = torch.Generator(device=DEVICE).manual_seed(0)
            cache = KVCache(1, 512, 16, kv_heads, dim, dtype, DEVICE)
            cache.data.normal_(generator=gen)
            free = list(range(512))
            rng.shuffle(free)
            seqs = [([free.pop() for _ in range(-(-(c + n) // 16))], c, n) for c, n in shapes]
            n = sum(s[2] for s in seqs)
            q, k, v = (torch.randn(1, n, h, dim, device=DEVICE, generator=gen, dtype=torch.float32).to(dtype)
                       for h in (heads, kv_heads, kv_heads))
            before = cache.data.clone()
            ref = PagedAttention.build(cache, 16, seqs, impl="reference").attend(0, q, k, v)
            after = cache.data.clone()
            cache.data.copy_(before)
            got = PagedAttention.build(cache, 16, seqs, impl="triton").attend(0, q, k, v)
            diff = (got.float() - ref.float()).abs().max().item()
            key = f"{str(dtype).removeprefix('torch.')}/{heads}x{kv_heads}x{dim}"
            out[key] = {"max_abs_diff": diff, "cache_equal": bool(torch.equal(cache.data, after)),
                        "ok": diff <= tolerance[dtype] and bool(torch.equal(cache.data, after))}
            log("kernels", f"{key}: max|diff| {diff:.2e}, cache equal {out[key]['cache_equal']}")
    # One layer's attention (KV store included) at 256 decoding sequences of 512 tokens, SmolLM2's heads.
    num_seqs, dtype = (256, torch.bfloat16) if DEVICE == "cuda" else (4, torch.float32)
    cache = KVCache(1, num_seqs * 33, 16, 3, 64, dtype, DEVICE)
    seqs = [(list(range(i * 33, i * 33 + 33)), 511, 1) for i in range(num_seqs)]
    q = torch.randn(1, num_seqs, 9, 64, device=DEVICE, dtype=dtype)
    k = v = torch.randn(1, num_seqs, 3, 64, device=DEVICE, dtype=dtype)
    for impl in ("fast", "triton"):
        meta = PagedAttention.build(cache, 16, seqs, impl=impl)
        for _ in range(3):
            meta.attend(0, q, k, v)
        sync()
        start = time.perf_counter()
        for _ in range(20):
            meta.attend(0, q, k, v)
        sync()
        out[f"decode_layer_ms/{impl}"] = 1000 * (time.perf_counter() - start) / 20
        log("kernels", f"one layer, {num_seqs} decodes x 512 keys, {dtype}, {impl}: "
            f"{out[f'decode_layer_ms/{impl}']:.3f} ms")
    out["ok"] = all(v["ok"] for v in out.values() if isinstance(v, dict))
    return out


# ------------------------------------------------------------------------------------------ correctness
def correctness() -> dict[str, Any]:
    from test_engine_greedy import prompts
    from tiny import DEEPSEEK_FAMILIES, FAMILIES, GEMMA_FAMILIES, GPT_OSS_FAMILIES, hf_model

    from pagedrl.engine.llm import LLM
    from pagedrl.engine.logits_processing import processed_logprobs
    from pagedrl.engine.sampling_params import SamplingParams
    from pagedrl.model.config import ModelConfig
    from pagedrl.model.decoder import CausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(DEVICE)
    variants = {"graphs": {}, "eager": {"enforce_eager": True}, "fast": {"attention_impl": "fast"}}
    out: dict[str, Any] = {}
    for name, raw in sorted({**FAMILIES, **GEMMA_FAMILIES, **GPT_OSS_FAMILIES, **DEEPSEEK_FAMILIES}.items()):
        hf = hf_model(raw).to(device)
        batch = prompts(hf.config.vocab_size)
        ref = []
        for ids in batch:
            with torch.no_grad():
                gen = hf.generate(torch.tensor([ids], device=device), max_new_tokens=12, do_sample=False,
                                  attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                                  pad_token_id=0)
            ref.append(gen[0, len(ids):].tolist())
        eos = hf.config.eos_token_id
        ref = [r[: r.index(eos) + 1] if eos in r else r for r in ref]
        model = CausalLM(ModelConfig.from_dict(hf.config.to_dict()))
        model.load_state_dict({k: v.cpu() for k, v in hf.state_dict().items()}, strict=False)
        model = model.to(device).eval()
        ids = torch.tensor([batch[5]], device=device)
        with torch.no_grad():
            logit_diff = (model.logits(model(ids)) - hf(ids).logits).abs().max().item()
        row: dict[str, Any] = {"logits_max_abs_diff": logit_diff}
        for variant, args in variants.items():
            llm = LLM.from_module(model, max_num_batched_tokens=37, kv_cache_tokens=1024, max_num_seqs=16, **args)
            outs = llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)
            row[f"greedy_equal/{variant}"] = sum(o.outputs[0].token_ids == r for o, r in zip(outs, ref, strict=True))
            if variant == "graphs":
                params = SamplingParams(temperature=0.7, top_p=0.8, max_tokens=16, seed=3, n=2, ignore_eos=True)
                worst = 0.0
                for prompt, o in zip(batch[:3], llm.generate(batch[:3], params, use_tqdm=False), strict=True):
                    for comp in o.outputs:
                        full = torch.tensor([prompt + comp.token_ids], device=device)
                        with torch.no_grad():
                            logits = model.logits(model(full))[0, len(prompt) - 1:-1]
                        dense = processed_logprobs(logits, torch.tensor(comp.token_ids, device=device),
                                                   temperature=0.7, top_p=0.8)
                        sampled = torch.tensor(comp.processed_logprobs, device=device)
                        worst = max(worst, (sampled - dense).abs().max().item())
                row["logprob_contract_max_abs_diff"] = worst
            del llm
        row["ok"] = all(row[f"greedy_equal/{v}"] == len(batch) for v in variants)
        out[name] = row
        log("correctness", f"{name:20s} logits max|diff| {logit_diff:.2e} | greedy equal to transformers "
            + ", ".join(f"{v} {row[f'greedy_equal/{v}']}/{len(batch)}" for v in variants)
            + f" | logprob contract max|diff| {row['logprob_contract_max_abs_diff']:.2e}")
    out["ok"] = all(r["ok"] for r in out.values())
    torch.backends.cuda.matmul.allow_tf32 = True
    return out


# ------------------------------------------------------------------------------------------------- gguf
def gguf() -> dict[str, Any]:
    """GGUF weights kept quantized on the device (`quantization="gguf"`): a tiny model holding every
    supported type, its greedy tokens against the same file dequantized at load, in float32 (TF32 off)
    and bf16, with CUDA graphs and eager."""
    from test_gguf import write_tiny_gguf
    from test_gguf_engine import TYPES, WIDE
    from tiny import hf_model

    from pagedrl.engine.llm import LLM
    from pagedrl.engine.sampling_params import SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    path = write_tiny_gguf(Path(tempfile.mkdtemp()) / "types.gguf", hf_model(WIDE, seed=5), types=TYPES)
    rng = random.Random(1)
    prompts = [[rng.randrange(5, WIDE["vocab_size"]) for _ in range(n)] for n in (3, 17, 40, 9, 28, 33)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out: dict[str, Any] = {}
    for dtype in ("float32", "bfloat16")[: 2 if DEVICE == "cuda" else 1]:  # a CPU keeps float32 (its kernels')
        plain = LLM(str(path), device=DEVICE, dtype=dtype)
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        del plain
        free_memory()
        for variant, extra in (("graphs", {}), ("eager", {"enforce_eager": True})):
            llm = LLM(str(path), device=DEVICE, dtype=dtype, quantization="gguf", **extra)
            got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            key = f"{dtype}/{variant}"
            out[key] = {"greedy_equal": sum(a == b for a, b in zip(got, want, strict=True)), "of": len(prompts),
                        "decode_path": llm.engine.decode_path(),
                        "weight_bytes": llm.engine.metrics_snapshot().weight_bytes}
            log("gguf", f"{key}: greedy equal to the dequantized model on {out[key]['greedy_equal']}/{len(prompts)}; "
                f"{out[key]['decode_path']}")
            del llm
            free_memory()
    torch.backends.cuda.matmul.allow_tf32 = True
    out["ok"] = all(v["greedy_equal"] == v["of"] for v in out.values() if isinstance(v, dict))
    return out


# ------------------------------------------------------------------------------------------- throughput
def throughput(folder: Path, batch_size: int) -> dict[str, Any]:
    import bench_engine
    import transformers

    from pagedrl import LLM

    out: dict[str, Any] = {}
    outputs = {}
    for variant, args in (("graphs", {}), ("eager", {"enforce_eager": True})):
        start = time.perf_counter()
        llm = LLM(model=str(folder), dtype=DTYPE, device=DEVICE, **args)
        out[f"{variant}/startup_s"] = time.perf_counter() - start
        vocab = llm.vocab_size
        workload = bench_engine.make_workload(*((256, 1.0) if DEVICE == "cuda" else (8, 0.05)), vocab)
        llm.generate([[100, 200, 300]], bench_engine.SamplingParams(max_tokens=4), use_tqdm=False)
        sync()
        run = bench_engine.run_pagedrl(llm, workload)
        outputs[variant] = run.outputs
        stats = llm.stats()
        out[variant] = {"seconds": run.seconds, "steps": len(run.kv_live), "output_tps": run.output_tps,
                        "total_tps": run.total_tps, "preemptions": stats["num_preemptions"],
                        "kv_tokens": llm.stats()["num_blocks_total"] * llm.block_size}
        log("throughput", f"pagedrl {variant}: {run.seconds:.1f} s, {len(run.kv_live)} steps "
            f"({1000 * run.seconds / len(run.kv_live):.1f} ms/step), {run.output_tps:.0f} output tok/s, "
            f"start-up {out[f'{variant}/startup_s']:.1f} s, {stats['num_preemptions']} preemptions")
        del llm
        free_memory()
    same = sum(a == b for a, b in zip(outputs["graphs"], outputs["eager"], strict=True))
    out["graphs_equal_eager_requests"] = same
    log("throughput", f"graphs and eager agree on {same}/{len(workload)} requests (bf16: batch shapes may "
        "round differently)")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=DTYPE).to(DEVICE).eval()
    bench_engine.run_transformers(hf, workload[:2], 2, 0)
    peer, peer_kv = bench_engine.run_transformers(hf, workload, batch_size, 0)
    out["transformers"] = {"seconds": peer.seconds, "output_tps": peer.output_tps, "total_tps": peer.total_tps,
                           "batch_size": batch_size, "kv_rows_live": peer_kv}
    for variant in ("graphs", "eager"):
        out[f"ratio/{variant}"] = out[variant]["output_tps"] / peer.output_tps
    log("throughput", f"transformers static batches of {batch_size}: {peer.seconds:.1f} s, "
        f"{peer.output_tps:.0f} output tok/s | ratio graphs {out['ratio/graphs']:.2f}x, "
        f"eager {out['ratio/eager']:.2f}x")
    del hf
    free_memory()
    return out


def decode_step(folder: Path, num_seqs: int = 256) -> dict[str, Any]:
    from pagedrl import LLM, SamplingParams

    out: dict[str, Any] = {}
    num_seqs, new_tokens = (num_seqs, 128) if DEVICE == "cuda" else (4, 4)
    for variant, args in (("graphs", {}), ("eager", {"enforce_eager": True})):
        llm = LLM(model=str(folder), dtype=DTYPE, device=DEVICE, max_num_seqs=num_seqs,
                  max_num_batched_tokens=8192, **args)
        engine = llm.engine
        rng = random.Random(1)
        vocab = engine.model.config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        for _ in range(num_seqs):
            engine.add_request([rng.randrange(16, vocab) for _ in range(128)], params)
        execute = engine.runner.execute
        forward: list[float] = []

        def timed(*a, execute=execute, forward=forward):
            sync()
            t = time.perf_counter()
            result = execute(*a)
            sync()
            forward.append(time.perf_counter() - t)
            return result

        engine.runner.execute = timed
        steps, forwards = [], []
        while engine.has_unfinished_requests():
            running = engine.scheduler.running
            full = len(running) == num_seqs and not engine.scheduler.waiting \
                and all(s.num_computed_tokens + 1 == s.num_tokens for s in running)
            sync()
            t = time.perf_counter()
            engine.step()
            sync()
            if full:
                steps.append(time.perf_counter() - t)
                forwards.append(forward[-1])
        step_ms, fwd_ms = 1000 * sum(steps) / len(steps), 1000 * sum(forwards) / len(forwards)
        out[variant] = {"decode_steps": len(steps), "mean_step_ms": step_ms, "mean_forward_ms": fwd_ms,
                        "mean_engine_ms": step_ms - fwd_ms}
        log("decode_step", f"{variant}: {len(steps)} steps of {num_seqs} decodes: {step_ms:.2f} ms per step, "
            f"of which the forward (with logits) {fwd_ms:.2f} ms, the engine's own work {step_ms - fwd_ms:.2f} ms")
        del llm, engine
        free_memory()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=None)
    parser.add_argument("--parts", default="kernels,correctness,throughput,decode_step,grpo,gguf")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--grpo-steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("cuda_check.json"))
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE, DTYPE
    DEVICE, DTYPE = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    results: dict[str, Any] = {"errors": {}, "seconds": {}}
    needed = ("triton", "transformers", "tokenizers", "safetensors", "gguf", "jinja2", "yaml", "tqdm", "numpy",
              "pytest")  # pytest: the correctness part reuses the greedy tests' prompts
    missing = [name for name in needed if importlib.util.find_spec(name) is None]
    if missing:  # parts that need them fail and are recorded; the others still run
        results["errors"]["missing_packages"] = missing
        print(f"missing packages: {missing}", flush=True)
    try:
        import transformers
        import triton

        results["env"] = {"torch": torch.__version__, "triton": triton.__version__,
                          "transformers": transformers.__version__, "python": platform.python_version(),
                          "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE}
        print(results["env"], flush=True)
    except Exception:
        results["errors"]["env"] = traceback.format_exc()
        print(results["errors"]["env"], flush=True)
    folder: list[Path] = []

    def models() -> Path:
        if not folder:
            folder.append(model_dir(args.model_dir, log))
        return folder[0]

    parts = {
        "kernels": kernels,
        "correctness": correctness,
        "throughput": lambda: throughput(models(), args.hf_batch_size),
        "decode_step": lambda: decode_step(models()),
        "grpo": lambda: grpo(models(), args.grpo_steps, DEVICE, log),
        "gguf": gguf,
    }
    for name in args.parts.split(","):
        start = time.perf_counter()
        try:
            results[name] = parts[name]()
        except Exception:
            results["errors"][name] = traceback.format_exc()
            print(results["errors"][name], flush=True)
        finally:
            free_memory()
        results["seconds"][name] = time.perf_counter() - start
        log(name, f"took {results['seconds'][name]:.1f} s")
        args.out.write_text(json.dumps(results, indent=2, default=str))
    sys.exit(1 if results["errors"] else 0)


if __name__ == "__main__":
    main()
