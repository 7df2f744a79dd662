"""The engine's float32 projections against torch's `F.linear` (MKL's float32 GEMM), on the default
model's 211 projections (30 layers of q, k, v, o, gate, up, down and the LM head: 540 MB of float32
weights, read once per pass as a decode step reads them), at the row counts of decode steps and
prompt chunks; and the machine's memory copy bandwidth, the speed a pass over the weights could
reach. The engine's side is its route for the row count (`products.float_kernel`): `float_linear`
(`kernels/csrc/float_linear.cpp`) up to `MAX_ROWS_FLOAT` rows, `float_gemm` (`kernels/csrc/float_gemm.cpp`)
up to `MAX_ROWS_GEMM` where the CPU class has it, torch's above. Both sides in one process, turns alternating, best of `--rounds`; weights of the
model's shapes drawn at random (the speed does not depend on the values).

    .venv/bin/python bench/bench_float_linear.py [--rows 1,2,4,8,16,32,64] [--threads 2]
    .venv/bin/python -m pagedrl.kernels.isa run avx2 -- .venv/bin/python bench/bench_float_linear.py --rows 33,64,256,2048
    .venv/bin/python -m pagedrl.kernels.isa run avx2 -- .venv/bin/python bench/bench_float_linear.py
    .venv/bin/python bench/bench_float_linear.py --offset 40     # weights 40 bytes past a cache line

`--offset`: each weight starts that many bytes past a 64-byte line, as the buffers safetensors reads
tensors into do (40 bytes); a float32 model loaded without `checkpoint.cache_line_aligned` ran so.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from bench_decode_linear import LAYER, projection_weights

from pagedrl.kernels import isa, ops, products


def copy_bandwidth(megabytes: int = 512, rounds: int = 5) -> float:
    """GB/s of a large tensor copy (read and write counted), best of `rounds`."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best / 1e9


def offset_copy(w: torch.Tensor, offset: int) -> torch.Tensor:
    """`w`'s values in a buffer that starts `offset` bytes (a multiple of 4) past a 64-byte line."""
    buf = torch.empty(w.numel() + 16)
    start = (-buf.data_ptr() % 64 + offset) // 4
    out = buf[start:start + w.numel()].view_as(w).copy_(w)
    assert out.data_ptr() % 64 == offset % 64
    return out


def engine_product(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The product a float32 engine's step computes for these rows."""
    out = products.float_kernel(x, w, bias)
    return F.linear(x, w, bias) if out is None else out


def kernel_name(rows: int) -> str:
    if rows <= products.MAX_ROWS_FLOAT:
        return "float_linear"
    return "float_gemm" if rows <= products.MAX_ROWS_GEMM else "torch"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--offset", type=int, default=0, help="bytes past a 64-byte line each weight starts at")
    args = ap.parse_args()
    if args.offset % 4:
        raise SystemExit(f"--offset {args.offset}: a float32 weight starts on a multiple of 4 bytes")
    torch.set_num_threads(args.threads)
    if not ops.available():
        raise SystemExit("the engine's CPU kernels could not be built here")
    gen = torch.Generator().manual_seed(0)
    weights = [offset_copy(w, args.offset) for w in projection_weights(torch.float32, gen)]
    nbytes = sum(w.numel() * 4 for w in weights)
    print(f"{len(weights)} projections, {nbytes / 1e6:.0f} MB of float32 weights; {args.threads} threads; CPU class "
          f"{isa.describe()}; torch capability {torch.backends.cpu.get_cpu_capability()}; kernel lanes "
          f"{ops.float_linear_lanes()}; weights {args.offset} bytes past a cache line; memory copy {copy_bandwidth():.1f} GB/s")
    print("| rows | pagedrl kernel | torch F.linear (ms) | pagedrl (ms) | torch / pagedrl | pagedrl weights GB/s "
          "| pagedrl GFLOP/s |")
    print("|---|---|---|---|---|---|---|")
    sides = {"torch": F.linear, "pagedrl": engine_product}
    flops_per_row = 2 * sum(w.numel() for w in weights)
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in LAYER}}
        best = dict.fromkeys(sides, float("inf"))
        with torch.inference_mode():
            for _ in range(args.rounds):
                for name, product in sides.items():
                    start = time.perf_counter()
                    for w in weights:
                        product(inputs[w.shape[1]], w, None)
                    best[name] = min(best[name], time.perf_counter() - start)
        print(f"| {rows} | {kernel_name(rows)} | {best['torch'] * 1e3:.1f} | {best['pagedrl'] * 1e3:.1f} | "
              f"{best['torch'] / best['pagedrl']:.2f}x | {nbytes / best['pagedrl'] / 1e9:.1f} | "
              f"{flops_per_row * rows / best['pagedrl'] / 1e9:.0f} |")


if __name__ == "__main__":
    main()
