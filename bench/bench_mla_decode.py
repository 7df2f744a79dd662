"""Latent attention's decode step: transformers' DeepseekV3Attention against pagedrl's, one layer.

DeepSeek-V3's attention shapes (hidden 7168, q_lora_rank 1536, kv_lora_rank 512, 128 + 64 query/key
features, 128 value features a head) with fewer heads (default 16 of its 128, so a CPU runs it), on
`--seqs` sequences of `--context` cached tokens decoding one token each. Both caches hold the latent
(576 numbers a token and layer): transformers' DynamicCache in one tensor per sequence, pagedrl's in
16-token blocks. transformers up-projects every cached latent through kv_b_proj at every step;
pagedrl folds kv_b_proj into the queries and attends over the latents where they lie (its `fast`
impl), or up-projects them as transformers does (`reference`). Prints the three timings (median of
`--repeats` steps, one run), the ratios, and the largest difference of the outputs.

    .venv/bin/python bench/bench_mla_decode.py [--heads 16] [--context 1024] [--seqs 8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_mla

from pagedrl.engine.attention import PagedAttention
from pagedrl.engine.kv_cache import KVCache
from pagedrl.kernels import isa
from pagedrl.model.config import ModelConfig
from pagedrl.model.decoder import RMSNorm
from pagedrl.model.mla import LatentAttention
from pagedrl.model.rope import rope_cos_sin, rope_inv_freq

BLOCK = 16


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    raw = dict(architectures=["DeepseekV3ForCausalLM"], vocab_size=1000, hidden_size=7168, intermediate_size=64,
               num_hidden_layers=1, num_attention_heads=args.heads, num_key_value_heads=args.heads,
               n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, moe_intermediate_size=16,
               max_position_embeddings=4 * args.context, rope_interleave=True)
    hf_config = transformers.DeepseekV3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    hf_config._attn_implementation = "sdpa"  # what its model uses by default (a bare layer names none)
    theirs = hf_mla.DeepseekV3Attention(hf_config, 0).to(dtype).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    cfg = ModelConfig.from_dict(raw)
    ours = LatentAttention(cfg, 0, RMSNorm).to(dtype).eval()
    ours.load_state_dict(theirs.state_dict())
    rotary = hf_mla.DeepseekV3RotaryEmbedding(hf_config)

    S, B, W = args.context, args.seqs, cfg.deepseek.latent_width
    prompt = torch.randn(B, S, cfg.hidden_size, dtype=dtype)
    cache = transformers.DynamicCache(config=hf_config)
    with torch.no_grad():  # transformers' prefill fills its cache; pagedrl's blocks get the same latents
        positions = torch.arange(S)[None].expand(B, S)
        theirs(prompt, rotary(prompt, positions), None, cache=cache)
    blocks_per_seq = -(-(S + 1) // BLOCK)
    kv = KVCache(1, B * blocks_per_seq, BLOCK, 1, W, dtype, values=False)
    tables = [list(range(s * blocks_per_seq, (s + 1) * blocks_per_seq)) for s in range(B)]
    latents = torch.cat((cache.layers[0].keys, cache.layers[0].values), dim=-1)[:, 0]  # [B, S, W]
    flat = kv.key_cache[0].view(-1, W)
    for s in range(B):
        slots = torch.tensor([tables[s][p // BLOCK] * BLOCK + p % BLOCK for p in range(S)])
        flat[slots] = latents[s]

    x = torch.randn(B, 1, cfg.hidden_size, dtype=dtype)
    position = torch.full((B, 1), S)
    hf_cos_sin = rotary(x, position)
    inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope_cos_sin(position.reshape(1, B), inv_freq, dtype)

    def transformers_step() -> torch.Tensor:
        if cache.get_seq_length() > S:
            cache.crop(-1)  # the last step's token out: every step decodes position S
        return theirs(x, hf_cos_sin, None, cache=cache)[0]

    def pagedrl_step(impl: str) -> torch.Tensor:
        meta = PagedAttention.build(kv, BLOCK, [(t, S, 1) for t in tables], impl=impl,
                                    scale=cfg.deepseek.softmax_scale)
        return ours(x.reshape(1, B, -1), cos, sin, meta).reshape(B, 1, -1)

    with torch.inference_mode():
        ref = transformers_step()
        gaps = {impl: float((pagedrl_step(impl).float() - ref.float()).abs().max()) for impl in ("fast", "reference")}
        peer = timed(transformers_step, args.repeats)
        folded = timed(lambda: pagedrl_step("fast"), args.repeats)
        expanded = timed(lambda: pagedrl_step("reference"), args.repeats)
    print(f"one DeepSeek-V3 MLA layer ({args.heads} heads), {B} sequences x {S} cached tokens, one decode step, "
          f"{args.dtype}, {torch.get_num_threads()} threads, CPU class {isa.describe()}")
    print(f"  transformers (latents up-projected each step): {peer * 1e3:8.2f} ms")
    print(f"  pagedrl fast (kv_b_proj folded into queries):  {folded * 1e3:8.2f} ms  "
          f"({peer / folded:.1f}x transformers; max |diff| {gaps['fast']:.2e})")
    print(f"  pagedrl reference (latents up-projected):      {expanded * 1e3:8.2f} ms  "
          f"({peer / expanded:.1f}x transformers; max |diff| {gaps['reference']:.2e})")
    print(f"  cache per token and layer: {W} numbers (full keys and values: "
          f"{args.heads * (cfg.deepseek.qk_head_dim + cfg.deepseek.v_head_dim)})")


if __name__ == "__main__":
    main()
