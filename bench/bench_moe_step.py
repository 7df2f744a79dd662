"""A decode step of a tiny mixture of experts through the engine against one of a dense model with the
same active parameters per token.

Both models are random, built here (nothing is downloaded): 4 layers, hidden 256, 8 heads (2 of keys
and values), a 4096-token vocabulary. `moe`: a Mixtral layout, 8 experts of width 512, 2 per token;
`dense`: the same decoder with one SwiGLU of width 1024 = 2 x 512, so each token multiplies by as many
weights on both sides. 64 sequences of 32 prompt tokens decode together; a side's figure is the median
of 40 whole `LLMEngine.step` calls (scheduling, forward, sampling, outputs) after 10. `dense-eager`:
the dense model through its modules (`enforce_eager=True`), the path the mixture of experts takes (no
decode program for sparse layers), so the ratio to it is the sparse layer's own cost.

Each side runs in its own process, turns alternating `--rounds` times, best turn counted (a shared
machine only slows a turn down).

    .venv/bin/python bench/bench_moe_step.py --rounds 3
    .venv/bin/python bench/bench_moe_step.py --rounds 3 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

SIDES = ("moe", "dense", "dense-eager")
ROWS, PROMPT, WARM, TIMED = 64, 32, 10, 40
EXPERT_WIDTH = 512


def config(side: str) -> dict:
    base = dict(vocab_size=4096, hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if side == "moe":
        return dict(base, architectures=["MixtralForCausalLM"], intermediate_size=EXPERT_WIDTH, num_local_experts=8,
                    num_experts_per_tok=2)
    return dict(base, architectures=["LlamaForCausalLM"], intermediate_size=2 * EXPERT_WIDTH)


def active_parameters(model: torch.nn.Module) -> int:
    """Weights a token multiplies by: all but the experts it is not routed to (and the embedding table)."""
    cfg = model.config
    total = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    if cfg.num_experts:
        experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
        total -= experts * (cfg.num_experts - cfg.num_experts_per_tok) // cfg.num_experts
    return total


def worker(side: str, dtype: str, threads: int) -> dict:
    from pagedrl.engine.llm import LLM
    from pagedrl.engine.sampling_params import SamplingParams
    from pagedrl.model.config import ModelConfig
    from pagedrl.model.decoder import CausalLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = CausalLM(ModelConfig.from_dict(config(side))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05)
    model = model.to(getattr(torch, dtype))
    llm = LLM.from_module(model, kv_cache_tokens=ROWS * 128, enable_prefix_caching=False,
                          enforce_eager=side == "dense-eager", max_num_seqs=ROWS)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=WARM + TIMED + 4, ignore_eos=True)
    for i in range(ROWS):
        engine.add_request([3 + (7 * i + j) % 4000 for j in range(PROMPT)], params, request_id=str(i))
    while any(s.num_computed_tokens < PROMPT for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # the prompts
    for _ in range(WARM):
        engine.step()
    times = []
    for _ in range(TIMED):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"ms": 1e3 * times[len(times) // 2], "active": active_parameters(model),
            "path": engine.runner.decode_path()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", metavar="SIDE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.dtype, args.threads)))
        return
    best: dict[str, dict] = {}
    for round_ in range(args.rounds):
        for side in SIDES if round_ % 2 == 0 else SIDES[::-1]:
            out = subprocess.run([sys.executable, __file__, "--worker", side, "--dtype", args.dtype,
                                  "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"round {round_ + 1}, {side}: {got['ms']:.2f} ms a step ({got['path']})", flush=True)
            if side not in best or got["ms"] < best[side]["ms"]:
                best[side] = got
    print(f"\n{ROWS} sequences, {args.dtype}, {args.threads} threads; active parameters a token: "
          + ", ".join(f"{side} {best[side]['active'] / 1e6:.2f} M" for side in SIDES))
    print("| side | ms a decode step | moe / side |")
    print("|---|---|---|")
    for side in SIDES:
        print(f"| {side} | {best[side]['ms']:.2f} | {best['moe']['ms'] / best[side]['ms']:.2f}x |")


if __name__ == "__main__":
    main()
