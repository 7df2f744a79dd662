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

    .venv/bin/python bench/bench_multi_lora.py                       # the run recorded in RESULTS.md
    .venv/bin/python bench/bench_multi_lora.py --targets all-linear
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
from pagedrl.model.adapter import save_adapter
from pagedrl.model.loader import load_model
from pagedrl.model.lora import LoRAConfig, apply_lora, lora_layers
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--targets", default=None, help="all-linear, or a comma list (default: q_proj,v_proj)")
    ap.add_argument("--scale", type=float, default=0.5, help="prompt and output lengths times this")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(2)
    targets = None if args.targets is None else (["all-linear"] if args.targets == "all-linear"
                                                  else args.targets.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        base = resolve_model_path(None)
        folders = write_adapters(base, Path(tmp), args.adapters, args.rank, targets)
        probe = LLM(str(base), kv_cache_tokens=1024)
        workload = make_workload(args.num_requests, args.scale, probe.vocab_size, seed=0)
        precision = probe.precision.describe()
        del probe
        prompts = [r.prompt for r in workload]
        params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in workload]
        loras = [LoRARequest(f"adapter{i}", i + 1, str(f)) for i, f in enumerate(folders)]
        spread = [loras[i % len(loras)] for i in range(len(prompts))]
        print(f"{len(prompts)} requests, {sum(p.max_tokens for p in params)} output tokens; {args.adapters} adapters "
              f"of rank {args.rank} on {args.targets or 'q_proj,v_proj'}; {precision}; 2 threads; "
              f"load average {os.getloadavg()[0]:.2f}")
        best = {"merged": 0.0, "multi": 0.0}
        for round_ in range(args.rounds):
            for side in ("merged", "multi"):
                if side == "merged":
                    llm = LLM(str(base), adapter=str(folders[0]))
                    seconds, tokens = timed(llm, prompts, params, None)
                else:
                    llm = LLM(str(base), enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank)
                    seconds, tokens = timed(llm, prompts, params, spread)
                tps = tokens / seconds
                best[side] = max(best[side], tps)
                print(f"round {round_ + 1} {side:>6}: {tokens} tokens in {seconds:6.1f} s = {tps:6.1f} output tokens/s")
                del llm
                gc.collect()
    print(f"\nmerged base alone (peer): {best['merged']:.1f} output tokens/s")
    print(f"{args.adapters} adapters in one engine: {best['multi']:.1f} output tokens/s")
    print(f"ratio: {best['multi'] / best['merged']:.2f}x (goal >= 0.8x)")


if __name__ == "__main__":
    main()
