"""How far the engine's sampled log-probs are from the trainer's recompute: GRPO's
`sampling/sampling_logp_difference/mean` on the default model, measured on one rollout (2 prompts x
G = 8 of the arithmetic task, 48 tokens, temperature 1):

- `as-is`: the default on a bf16 CPU: bf16 autocast on float32 master weights, both sides
  batch-invariant (`model/batch_invariant.py`);
- `plain`: bf16 as above with `batch_invariant=false`: the engine's decode batches and the
  trainer's packed batch run kernels that reduce in other orders, and bf16's roundings carry the
  difference to every layer;
- `float32`: no autocast at all.

Each variant runs in its own process.

    .venv/bin/python bench/bench_logp_gap.py [--variants as-is,plain,float32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile

VARIANTS = ("as-is", "plain", "float32")


def measure(variant: str) -> dict[str, float]:
    import torch

    from pagedrl.model.loader import load_model
    from pagedrl.train.algorithms.grpo import GRPO
    from pagedrl.train.distributed import DistInfo
    from pagedrl.train.rl.config import GRPOConfig

    bf16 = variant != "float32"
    with tempfile.TemporaryDirectory() as out:
        config = GRPOConfig(model="smollm2-135m-instruct", dataset="arithmetic", output_dir=out, task_num_eval=16,
                            num_generations=8, per_device_train_batch_size=16, gradient_accumulation_steps=1,
                            max_completion_length=48, temperature=1.0, bf16=bf16, beta=0.0, seed=0,
                            batch_invariant=False if variant == "plain" else None)
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
