"""How far the engine's sampled log-probs are from the trainer's recompute under bf16 autocast, and
what closes the gap: GRPO's `sampling/sampling_logp_difference/mean` on the default model, measured
on one rollout (2 prompts x G = 8 of the arithmetic task, 48 tokens, temperature 1), with the
model computed as pagedrl computes it and with parts of it made exact on both sides alike:

- `as-is`: bf16 autocast on float32 master weights, both sides (the default on a bf16 CPU);
- `head32`: the LM head from bf16-rounded operands with a float32 result (no bf16 rounding of logits);
- `+attn32`: also attention in float32 from bf16-rounded q, k, v, its output rounded to bf16;
- `+proj32`: also every projection in float32 from bf16-rounded operands, rounded to bf16 after
  (what a bf16 matmul with float32 accumulation computes, with a reduction order that does not
  depend on the batch);
- `float32`: no autocast at all.

Each variant runs in its own process. The gap that stays when every matmul is made exact is the
floor of bf16 itself: a token's row computed in the engine (one query against the cached keys) and
in the trainer (a packed batch) differs by float32 reduction order somewhere, a bf16 rounding of an
activation turns that into a one-unit-in-the-last-place difference now and then, and such
differences grow to the size of bf16's rounding within a few layers.

    .venv/bin/python bench/bench_logp_gap.py [--variants as-is,head32,+attn32,+proj32,float32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

VARIANTS = ("as-is", "head32", "+attn32", "+proj32", "float32")


def exact_parts(variant: str) -> None:
    """Patch torch's functions so that the named parts compute exactly on both sides."""
    import torch
    import torch.nn.functional as F

    from pagedrl.model.decoder import CausalLM

    level = VARIANTS.index(variant)
    bf16 = torch.bfloat16

    def rounded(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(bf16).float()

    if 1 <= level <= 3:
        def logits(self: CausalLM, hidden: torch.Tensor) -> torch.Tensor:
            if not torch.is_autocast_enabled("cpu"):
                return self.lm_head(hidden).float()
            with torch.autocast("cpu", enabled=False):
                return F.linear(rounded(hidden), rounded(self.lm_head.weight))

        CausalLM.logits = logits  # type: ignore[method-assign]
    if 2 <= level <= 3:
        sdpa = F.scaled_dot_product_attention

        def attention(q, k, v, *args, **kwargs):  # type: ignore[no-untyped-def]
            if not torch.is_autocast_enabled("cpu") and q.dtype != bf16:
                return sdpa(q, k, v, *args, **kwargs)
            mask = kwargs.get("attn_mask")
            if mask is not None and mask.dtype == bf16:
                kwargs["attn_mask"] = mask.float()
            with torch.autocast("cpu", enabled=False):
                return sdpa(rounded(q), rounded(k), rounded(v), *args, **kwargs).to(bf16)

        F.scaled_dot_product_attention = attention
    if level == 3:
        linear = F.linear

        def projection(x, w, b=None):  # type: ignore[no-untyped-def]
            if not torch.is_autocast_enabled("cpu"):
                return linear(x, w, b)
            with torch.autocast("cpu", enabled=False):
                return linear(rounded(x), rounded(w), rounded(b)).to(bf16)

        F.linear = projection


def measure(variant: str) -> dict[str, float]:
    import torch

    from pagedrl.model.loader import load_model
    from pagedrl.train.algorithms.grpo import GRPO
    from pagedrl.train.distributed import DistInfo
    from pagedrl.train.rl.config import GRPOConfig

    exact_parts(variant)
    bf16 = variant != "float32"
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(model="smollm2-135m-instruct", dataset="arithmetic", output_dir=out, task_num_eval=16,
                            num_generations=8, per_device_train_batch_size=16, gradient_accumulation_steps=1,
                            max_completion_length=48, temperature=1.0, bf16=bf16, beta=0.0, seed=0)
        loaded = load_model("smollm2-135m-instruct", dtype=torch.float32)
        algo = GRPO(config, loaded.model.train(), loaded.tokenizer, DistInfo(), eos_token_ids=loaded.eos_token_ids)
        total, count, worst = 0.0, 0, 0.0
        for b in algo.step_batches(1):
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                flat = algo.token_logps(algo.model, b).logps
            gap = (b.to_padded(flat) - b.sampling_logps).abs().masked_fill(~b.mask, 0)
            total, count, worst = total + float(gap.sum()), count + int(b.mask.sum()), max(worst, float(gap.max()))
        algo.close()
    return {"mean": total / count, "max": worst, "tokens": count}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--worker", default=None)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(measure(args.worker)))
        return
    print(f"{'variant':10} {'mean |dlogp|':>13} {'max':>9} {'tokens':>7}")
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"--variants: unknown {variant!r}; expected some of {', '.join(VARIANTS)}")
        run = subprocess.run([sys.executable, __file__, "--worker", variant], check=True, capture_output=True,
                             text=True)
        r = json.loads(run.stdout.strip().splitlines()[-1])
        print(f"{variant:10} {r['mean']:13.2e} {r['max']:9.2e} {r['tokens']:7d}")


if __name__ == "__main__":
    main()
