"""The engine's bf16 decode projections (`kernels/csrc/decode_linear.cpp`) against oneDNN's (`F.linear`,
which lays out the weights anew at every call) and oneDNN's on weights packed once (`oneDNN packed`,
what `kernels/products.PackedWeights` runs for products that must equal a trainer's) and the
k-pairs kernel on its packed copy (`kernels/csrc/pair_linear.cpp`, a bf16 engine's products where there is no AMX), on the default model's 211 projections (30 layers of q, k, v, o, gate, up, down and the LM head:
270 MB of bf16 weights, read once per pass as a decode step reads them), at the row counts of decode
steps. Both sides in one process, turns alternating, best of `--rounds`; weights of the model's
shapes drawn at random (the kernels' speed does not depend on the values).

    .venv/bin/python bench/bench_decode_linear.py [--rows 1,4,16,32,64,80] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from pagedrl.kernels import ops, products

LAYER = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)]  # (out, in)
LAYERS, VOCAB, HIDDEN = 30, 49152, 576


def projection_weights(dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    """Random weights of the default model's 211 projections, in `dtype`."""
    weights = [torch.randn(n, k, generator=gen).to(dtype) for _ in range(LAYERS) for n, k in LAYER]
    weights.append(torch.randn(VOCAB, HIDDEN, generator=gen).to(dtype))
    return weights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,32,64,80")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not ops.decode_linear_available():
        raise SystemExit("the engine's decode kernel is not built for this CPU (no AVX512-BF16)")
    amx = ops.decode_linear_amx()
    gen = torch.Generator().manual_seed(0)
    weights = projection_weights(torch.bfloat16, gen)
    megabytes = sum(w.numel() * 2 for w in weights) / 1e6
    print(f"{len(weights)} projections, {megabytes:.0f} MB of bf16 weights; {args.threads} threads; "
          f"AMX {'yes' if amx else 'no'}")
    packed = products.PackedWeights()
    for w in weights:
        packed.packed(w)
    pairs = products.pairs_available()
    if pairs:
        for w in weights:
            packed.packed(w, "pairs")
    print("| rows | oneDNN (ms) | oneDNN packed (ms) | pagedrl kernel (ms) | pagedrl k-pairs (ms) | packed / kernel "
          "| packed / k-pairs |")
    print("|---|---|---|---|---|---|---|")
    sides = {"oneDNN": F.linear, "packed": packed.product, "pagedrl": ops.decode_linear}
    if pairs:
        sides["pairs"] = packed.pairs_product
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=gen).bfloat16() for k in {k for _, k in LAYER}}
        best = dict.fromkeys(sides, float("inf"))
        with torch.inference_mode():
            for _ in range(args.rounds):
                for name, product in sides.items():
                    start = time.perf_counter()
                    for w in weights:
                        product(inputs[w.shape[1]], w, None)
                    best[name] = min(best[name], time.perf_counter() - start)
        pair_ms = f"{best['pairs'] * 1e3:.1f}" if pairs else "-"
        pair_ratio = f"{best['packed'] / best['pairs']:.2f}x" if pairs else "-"
        print(f"| {rows} | {best['oneDNN'] * 1e3:.1f} | {best['packed'] * 1e3:.1f} | {best['pagedrl'] * 1e3:.1f} | "
              f"{pair_ms} | {best['packed'] / best['pagedrl']:.2f}x | {pair_ratio} |")


if __name__ == "__main__":
    main()
