"""Adapters per request on a mixture of experts' weights against the same adapter merged: a decode step.

A random Mixtral layout built here (nothing is downloaded; the MoE of `bench_moe_step.py`: 4 layers,
hidden 256, 8 experts of width 512, 2 per token) and a rank-8 LoRA adapter on every expert's
`gate_up_proj` and `down_proj` (PEFT's `target_parameters`, B drawn so it matters), saved as a trainer
saves it. The peer is that adapter merged into the weights (`LLM(model, adapter=...)`): the expert
kernel on float weights, no adapter work at all. Ours is `LLM(model, enable_lora=True)` with the adapter
in a slot (`engine/expert_slots.py`), three ways: every request on the adapter (`all`), every other one
(`half`: the base's rows keep the expert kernel, the adapter's take the products plus their update),
and none (`base`: what serving adapters costs a request that names none). 64 sequences of 32 prompt
tokens decode together; a side's figure is the median of 30 whole `LLMEngine.step` calls after 8.
Sides take turns in one process, the order reversed each round; the best turn of each counts (a
shared machine only ever slows a turn down).

    .venv/bin/python bench/bench_expert_slots.py --rounds 3
    .venv/bin/python bench/bench_expert_slots.py --rounds 3 --dtype float32
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from pagedrl import LLM, LoRARequest, SamplingParams
from pagedrl.kernels import isa
from pagedrl.model.adapter import save_adapter
from pagedrl.model.checkpoint import save_checkpoint
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import CausalLM
from pagedrl.model.lora import LoRAConfig, apply_lora

ROWS, PROMPT, WARM, TIMED, RANK = 64, 32, 8, 30, 8
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
CONFIG = dict(architectures=["MixtralForCausalLM"], vocab_size=4096, hidden_size=256, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=2, intermediate_size=512, num_local_experts=8,
              num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1,
              eos_token_id=2, pad_token_id=0)


def write_model_and_adapter(root: Path) -> tuple[Path, Path]:
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05)
    save_checkpoint(model, root / "base")
    apply_lora(model, LoRAConfig(r=RANK, lora_alpha=2 * RANK, lora_dropout=0.0, target_parameters=EXPERTS),
               torch.Generator().manual_seed(1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    return root / "base", save_adapter(model, root / "adapter")


def step_ms(llm: LLM, requests: list[LoRARequest | None]) -> float:
    """Median ms of a whole engine step while ROWS sequences decode, each with its request's adapter."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=WARM + TIMED + 4, ignore_eos=True)
    for i, lora in enumerate(requests):
        engine.add_request([3 + (7 * i + j) % 4000 for j in range(PROMPT)], params, request_id=f"r{time.monotonic_ns()}-{i}",
                           lora_request=lora)
    while engine.scheduler.waiting or any(s.num_computed_tokens < PROMPT for s in engine.scheduler.running):
        engine.step()
    for _ in range(WARM):
        engine.step()
    times = []
    for _ in range(TIMED):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        base, adapter = write_model_and_adapter(Path(tmp))
        common = dict(dtype=dtype, kv_cache_tokens=ROWS * 128, enable_prefix_caching=False, max_num_seqs=ROWS)
        merged = LLM(str(base), adapter=str(adapter), **common)
        slots = LLM(str(base), enable_lora=True, max_loras=1, max_lora_rank=RANK, **common)
        lora = LoRARequest("experts", 1, str(adapter))
        sides = {"merged": (merged, [None] * ROWS), "all": (slots, [lora] * ROWS),
                 "half": (slots, [lora, None] * (ROWS // 2)), "base": (slots, [None] * ROWS)}
        best: dict[str, float] = {}
        for round_ in range(args.rounds):
            for side in list(sides) if round_ % 2 == 0 else list(sides)[::-1]:
                ms = step_ms(*sides[side])
                print(f"round {round_ + 1}, {side}: {ms:.2f} ms a step", flush=True)
                best[side] = min(best.get(side, ms), ms)
    print(f"\n{ROWS} sequences decoding, {args.dtype}, {args.threads} threads, CPU class {isa.cpu_class()}")
    print("| side | ms a decode step | merged / side |")
    print("|---|---|---|")
    for side in sides:
        print(f"| {side} | {best[side]:.2f} | {best['merged'] / best[side]:.2f}x |")


if __name__ == "__main__":
    main()
