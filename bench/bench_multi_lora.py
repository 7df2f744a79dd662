"""Many adapters in one engine against one merged checkpoint: throughput of the same requests.

The default SmolLM2-135M-Instruct with `--adapters` random LoRA adapters (rank `--rank`, PEFT's
default targets q_proj/v_proj, or `--targets all-linear`) saved in PEFT's format. The peer is the
merged base: the first adapter folded into the weights (`LLM(model, adapter=...)`), which decodes at
the base model's speed, running every request. Ours is `LLM(model, enable_lora=True,
max_loras=--adapters)` with the requests spread round-robin over the adapters, so each step mixes
all of them (each adapter's rows updated from its slot after the base matmul). Both sides: the same
token ids (the engine benchmark's workload: prompts 16-512 tokens, outputs 16-256, times `--scale`),
greedy, `ignore_eos`, the chosen precision (`auto`), 2 threads, one engine at a time, turns
alternating `--rounds` times; the best turn of each side is compared (a shared machine only ever
slows a turn down).

On a base kept quantized (`--quantization int4`, `int8`, or `gguf`: the default model's own Q4_1 file)
no adapter can be folded in, so the peer is that quantized base serving the requests without adapters
(`LLM(model, quantization=...)`, its decode steps as the CPU program), and ours the same base with
`enable_lora` and each request's adapter (every step through the modules, the base's products on the
block kernels, each adapter's update added). `--workload single` is one stream as
`bench_vllm_cpu.py` runs it: one 128-token prompt, 64 tokens generated.

    .venv/bin/python bench/bench_multi_lora.py                       # the run recorded in RESULTS.md
    .venv/bin/python bench/bench_multi_lora.py --targets all-linear
    .venv/bin/python bench/bench_multi_lora.py --quantization int4 --workload single --adapters 1 --threads 1 --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path

import torch

from pagedrl import LLM, LoRARequest, SamplingParams
from pagedrl.demo.paged import make_workload
from pagedrl.kernels import isa
from pagedrl.model.adapter import save_adapter
from pagedrl.model.loader import load_model
from pagedrl.model.lora import LoRAConfig, apply_lora, lora_layers
from pagedrl.model.precision import QUANTIZATIONS
from pagedrl.model.resolve import resolve_model_path


def write_adapters(base: Path, folder: Path, count: int, rank: int, targets: list[str] | None) -> list[Path]:
    """`count` adapters on the default model, B drawn so each one changes the model."""
    out = []
    for i in range(count):
        loaded = load_model(base, device="cpu", dtype=torch.float32)
        apply_lora(loaded.model, LoRAConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                            base_model_name_or_path=str(base)),
                   torch.Generator().manual_seed(i))
        g = torch.Generator().manual_seed(1000 + i)
        with torch.no_grad():
            for _, layer in lora_layers(loaded.model):
                layer.lora_B.weight.copy_(torch.randn(layer.lora_B.weight.shape, generator=g) * 0.01)
        out.append(save_adapter(loaded.model, folder / f"adapter{i}"))
        del loaded
    return out


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], loras: list | None) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.outputs[0].token_ids) for o in outs)


def single_stream(vocab_size: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """One 128-token prompt of random ids, 64 tokens generated (`bench_vllm_cpu.py`'s `single`)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, vocab_size, (128,), generator=g).tolist()
    return [prompt], [SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=None, help="all-linear, or a comma list (default: q_proj,v_proj)")
    ap.add_argument("--scale", type=float, default=0.5, help="prompt and output lengths times this")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--quantization", choices=QUANTIZATIONS, default=None,
                    help="the base kept quantized; the peer is then that base without adapters")
    ap.add_argument("--workload", choices=("batch", "single"), default="batch",
                    help="batch: --num-requests of the engine benchmark's lengths; single: one stream")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    targets = None if args.targets is None else (["all-linear"] if args.targets == "all-linear"
                                                  else args.targets.split(","))
    quantized = {} if args.quantization is None else {"quantization": args.quantization, "dtype": "float32"}
    with tempfile.TemporaryDirectory() as tmp:
        base = resolve_model_path(None)
        folders = write_adapters(base, Path(tmp), args.adapters, args.rank, targets)
        source = None if args.quantization == "gguf" else str(base)  # gguf: the default model's own file
        probe = LLM(source, kv_cache_tokens=1024, **quantized)
        precision = probe.precision.describe()
        if args.workload == "single":
            prompts, params = single_stream(probe.vocab_size)
        else:
            workload = make_workload(args.num_requests, args.scale, probe.vocab_size, seed=0)
            prompts = [r.prompt for r in workload]
            params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload]
        del probe
        loras = [LoRARequest(f"adapter{i}", i + 1, str(f)) for i, f in enumerate(folders)]
        spread = [loras[i % len(loras)] for i in range(len(prompts))]
        peer = "merged" if args.quantization is None else "base"
        print(f"{len(prompts)} requests, {sum(p.max_tokens for p in params)} output tokens; {args.adapters} adapters "
              f"of rank {args.rank} on {args.targets or 'q_proj,v_proj'}; {precision}; {args.threads} threads; "
              f"CPU class {isa.describe()}; load average {os.getloadavg()[0]:.2f}")
        best = {peer: 0.0, "multi": 0.0}
        for round_ in range(args.rounds):
            for side in (peer, "multi"):
                if side == "merged":
                    llm = LLM(str(base), adapter=str(folders[0]))
                    seconds, tokens = timed(llm, prompts, params, None)
                elif side == "base":
                    llm = LLM(source, **quantized)
                    seconds, tokens = timed(llm, prompts, params, None)
                else:
                    llm = LLM(source, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **quantized)
                    seconds, tokens = timed(llm, prompts, params, spread)
                tps = tokens / seconds
                best[side] = max(best[side], tps)
                print(f"round {round_ + 1} {side:>6}: {tokens} tokens in {seconds:6.1f} s = {tps:6.1f} output tokens/s")
                del llm
                gc.collect()
    if peer == "merged":
        print(f"\nmerged base alone (peer): {best['merged']:.1f} output tokens/s")
    else:
        print(f"\n{args.quantization} base without adapters (peer): {best['base']:.1f} output tokens/s")
    print(f"{args.adapters} adapters in one engine: {best['multi']:.1f} output tokens/s")
    print(f"ratio: {best['multi'] / best[peer]:.2f}x (goal >= 0.8x)")


if __name__ == "__main__":
    main()
