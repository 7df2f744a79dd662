"""What a bf16 run's steps do to the weights it computes with: float32 masters under bf16 autocast,
plainly rounded and dithered (`train/dither.py`), against float32 training.

The default model learns one fixed batch of 16 arithmetic sentences ("Compute 23 + 45. Answer: The
sum of 23 and 45 is 68.") with AdamW at `--lr` (the GRPO example's 1e-5), gradients clipped at 1,
for `--steps` steps, three ways from the same start:

- `float32`: float32 forward and backward;
- `bf16`: bf16 autocast over float32 masters, as TRL's `bf16=True` trains;
- `bf16 dithered`: the same after `dither_masters`.

Each step prints the NLL (nats per token, on the trained batch and on 16 held-out sentences) of the
masters computed in float32, and of what a bf16 run computes with: the same masters under autocast
(rounded to bf16). This is a measurement of learning, not of speed: one thread, any load.

    .venv/bin/python bench/bf16_masters.py --steps 8
"""

from __future__ import annotations

import argparse
import random

import torch


def sentences(tokenizer, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = random.Random(seed)
    rows = []
    for _ in range(16):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append(tokenizer.encode(f"Compute {a} + {b}. Answer: The sum of {a} and {b} is {a + b}."))
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for r, row in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        mask[r, :len(row)] = True
    return ids, mask


def nll(model, batch: tuple[torch.Tensor, torch.Tensor], bf16: bool) -> torch.Tensor:
    ids, mask = batch
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model.logits(model(ids, attention_mask=mask))[:, :-1]
    logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    weight = mask[:, 1:].float()
    return -(logp * weight).sum() / weight.sum()


def run(way: str, steps: int, lr: float) -> list[tuple[float, float, float, float]]:
    from pagedrl.model.loader import load_model
    from pagedrl.train.dither import dither_masters

    torch.manual_seed(0)
    loaded = load_model("smollm2-135m-instruct", device="cpu", dtype=torch.float32)
    model, tokenizer = loaded.model, loaded.tokenizer
    train, held = sentences(tokenizer, 0), sentences(tokenizer, 1)
    if way == "bf16 dithered":
        dither_masters(model, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    rows = []
    for step in range(steps + 1):
        with torch.no_grad():
            rows.append(tuple(float(nll(model, b, bf16)) for b in (train, held) for bf16 in (False, True)))
        print(f"{way:>14} step {step:2d}  trained batch: masters {rows[-1][0]:.4f}  bf16 copy {rows[-1][1]:.4f}  "
              f"held out: masters {rows[-1][2]:.4f}  bf16 copy {rows[-1][3]:.4f}", flush=True)
        if step == steps:
            break
        optimizer.zero_grad()
        nll(model, train, way != "float32").backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {way: run(way, args.steps, args.lr) for way in ("float32", "bf16", "bf16 dithered")}
    start = results["float32"][0]
    print(f"\nafter {args.steps} steps (start: masters {start[0]:.4f}, bf16 copy {start[1]:.4f} on the trained batch)")
    print(f"{'training':>14}  {'what a run computes with':>26}  trained batch  held out  progress kept  "
          "copy - masters, steps 1..N (trained batch)")
    for way, rows in results.items():
        i = 0 if way == "float32" else 1  # a float32 run computes with its masters; a bf16 run with their copy
        gained = start[0] - rows[-1][i]
        reference = start[0] - results["float32"][-1][0]
        gaps = [row[1] - row[0] for row in rows[1:]]
        print(f"{way:>14}  {'float32 masters' if i == 0 else 'bf16 copy of the masters':>26}  "
              f"{rows[-1][i]:13.4f}  {rows[-1][i + 2]:8.4f}  {gained / reference:12.0%}  "
              f"{min(gaps):+.4f} .. {max(gaps):+.4f}, mean |gap| {sum(map(abs, gaps)) / len(gaps):.4f}")

if __name__ == "__main__":
    main()
