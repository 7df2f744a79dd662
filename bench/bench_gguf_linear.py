"""GGUF weights kept quantized (`kernels/csrc/gguf_linear.cpp`) against the float32 decode kernel
(`kernels/csrc/float_linear.cpp`) on the same weights dequantized, and the same blocks with 8-bit
activations (`kernels/csrc/gguf_int8_dot.cpp`): the default model's 210 projections
(30 layers of q, k, v, o, gate, up, down; the LM head apart) as its GGUF stores them (Q4_1), and the
same weights quantized to Q8_0 by `gguf.quants.quantize`, at a decode step's row counts, on 1 and 2
threads. A pass reads every weight once, as a decode step does: the quantized side streams the blocks,
the float side 425 MB of float32. Both sides in one process, turns alternating, best of `--rounds`;
the float and gguf sides give the same bits (tests/test_gguf_linear.py); the int8 side rounds its inputs.

    .venv/bin/python bench/bench_gguf_linear.py [--rows 1,2,16] [--threads 1,2]
    .venv/bin/python -m pagedrl.kernels.isa run avx2 -- .venv/bin/python bench/bench_gguf_linear.py
"""

from __future__ import annotations

import argparse
import platform
import time
from dataclasses import dataclass

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as Q

from pagedrl.kernels import isa, ops
from pagedrl.kernels.products import quantized_rows
from pagedrl.model.default import default_gguf_path


@dataclass
class Projection:
    blocks: torch.Tensor  # [N, row_bytes] uint8, as the file lays them out
    qtype: int
    k: int
    weight: torch.Tensor  # [N, k] float32, the same values dequantized


def projections(qtype: Q) -> list[Projection]:
    """The default model's projections: the file's own blocks, or their dequantized values quantized to
    `qtype` by gguf."""
    out = []
    for t in gguf.GGUFReader(default_gguf_path()).tensors:
        if not t.name.startswith("blk.") or t.tensor_type == Q.F32:
            continue
        k = int(t.shape[0])
        blocks = torch.from_numpy(np.array(t.data))
        if t.tensor_type != qtype:
            weight = ops.gguf_dequantize(blocks, int(t.tensor_type), k).numpy()
            blocks = torch.from_numpy(gguf.quants.quantize(weight, qtype))
        out.append(Projection(blocks, int(qtype), k, ops.gguf_dequantize(blocks, int(qtype), k)))
    return out


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"


@torch.no_grad()  # as an engine's steps run (the engine's route takes no call that records a gradient)
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--types", default="Q4_1,Q8_0")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if not ops.available():
        raise SystemExit("the engine's CPU kernels could not be built here")
    print(f"{cpu_name()}; CPU class {isa.describe()}; kernel lanes {ops.float_linear_lanes()}")
    print("| weights | threads | rows | float_linear (ms) | gguf_linear (ms) | float / gguf | bytes a pass "
          "(float, gguf MB) | GB/s (float, gguf) | engine's route (ms) | MKL on the float weights (ms) | "
          "int8 activations (ms, GB/s, GFLOP/s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name in args.types.split(","):
        layers = projections(Q[name])
        float_bytes = sum(p.weight.numel() * 4 for p in layers)
        gguf_bytes = sum(p.blocks.numel() for p in layers)
        sides = {
            "float": lambda xs, layers=layers: [ops.float_linear(xs[p.k], p.weight, None) for p in layers],
            "gguf": lambda xs, layers=layers: [ops.gguf_linear(xs[p.k], p.blocks, p.qtype, p.k, None) for p in layers],
            # the same blocks with 8-bit activations (`activations="int8"`: llama.cpp's arithmetic)
            "int8": lambda xs, layers=layers: [ops.gguf_linear_int8(xs[p.k], p.blocks, p.qtype, p.k, None)
                                               for p in layers],
            # what a quantized engine's step runs (`products.quantized_rows`: above MAX_ROWS_QUANTIZED rows it
            # dequantizes, then `float_linear`), and what a float32 engine's runs above MAX_ROWS_FLOAT rows
            "route": lambda xs, layers=layers: [quantized_rows(xs[p.k], p.blocks, p.qtype, p.k, None) for p in layers],
            "mkl": lambda xs, layers=layers: [torch.nn.functional.linear(xs[p.k], p.weight) for p in layers],
        }
        for threads in (int(t) for t in args.threads.split(",")):
            torch.set_num_threads(threads)
            for rows in (int(r) for r in args.rows.split(",")):
                xs = {k: torch.randn(rows, k, generator=gen) for k in {p.k for p in layers}}
                flops = 2 * rows * sum(p.weight.numel() for p in layers)
                best = dict.fromkeys(sides, float("inf"))
                for _ in range(args.rounds):
                    for side, run in sides.items():
                        start = time.perf_counter()
                        run(xs)
                        best[side] = min(best[side], time.perf_counter() - start)
                print(f"| {name} | {threads} | {rows} | {best['float'] * 1e3:.1f} | {best['gguf'] * 1e3:.1f} | "
                      f"{best['float'] / best['gguf']:.2f}x | {float_bytes / 1e6:.0f}, {gguf_bytes / 1e6:.0f} | "
                      f"{float_bytes / best['float'] / 1e9:.1f}, {gguf_bytes / best['gguf'] / 1e9:.1f} | "
                      f"{best['route'] * 1e3:.1f} | {best['mkl'] * 1e3:.1f} | {best['int8'] * 1e3:.1f}, "
                      f"{gguf_bytes / best['int8'] / 1e9:.1f}, {flops / best['int8'] / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
