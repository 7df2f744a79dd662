"""Which kernel multiplies int8 / int4 weights made at load (`model/weight_only.py`): the candidates on the
default model's 210 projections (30 layers of q, k, v, o, gate, up, down), its float weights quantized by
the project's rules, at a decode step's row counts and a prefill chunk's:

- `f32 float_linear`: the float32 engine's kernel on the float weights (the unquantized baseline);
- `int8 in Q8_0` / `int4 in Q4_1`: the float32 engine's route for blocks (`products.quantized_rows`: the
  GGUF kernels up to `MAX_ROWS_QUANTIZED` rows, dequantize then `float_linear` above), what runs;
- `torch int8pack`: torch's `_weight_int8pack_mm` (int8, one scale per output channel);
- `torch int4pack`: torch's `_weight_int4pack_mm_for_cpu` on `_convert_weight_to_int4pack_for_cpu`'s
  layout, groups of 32, scale and zero (the same values as `int4 in Q4_1`);
  both on float32 rows (what a float32 engine feeds; `--float32-torch-rows`, above which they are not run:
  tens of seconds a pass) and on bf16 rows (what a bf16 engine would);
- `bf16 pairs`: the bf16 engine's kernel on bf16 float weights (`csrc/pair_linear.cpp`).

One process, sides taking turns, best of `--rounds`, `--threads` threads (default 1).

    .venv/bin/python bench/bench_weight_only.py [--rows 1,16,64,512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch
from bench_gguf_linear import cpu_name
from gguf import GGMLQuantizationType as Q

from pagedrl.kernels import isa, ops
from pagedrl.kernels.products import packed_weights, quantized_rows
from pagedrl.model.default import default_gguf_path
from pagedrl.model.weight_only import Q4_1, Q8_0, int4_blocks, int4_rule, int8_blocks, int8_rule


def float_projections() -> list[torch.Tensor]:
    """The default model's projections as float32 (its GGUF's blocks dequantized)."""
    out = []
    for t in gguf.GGUFReader(default_gguf_path()).tensors:
        if t.name.startswith("blk.") and t.tensor_type != Q.F32:
            k = int(t.shape[0])
            out.append(ops.gguf_dequantize(torch.from_numpy(np.array(t.data)), int(t.tensor_type), k))
    return out


def torch_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = int8_rule(w)
    return torch.from_numpy(q), torch.from_numpy(s.astype(np.float32))


def torch_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 rule's values in torch's layout: w = (q - 8) * scale + zero, so zero = m + 8 d."""
    q, d, m = int4_rule(w)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.from_numpy(q.astype(np.int32)), 1)
    d32, m32 = torch.from_numpy(d.astype(np.float32)), torch.from_numpy(m.astype(np.float32))
    return packed, torch.stack([d32, m32 + 8 * d32], -1).transpose(0, 1).contiguous()


@torch.no_grad()  # as an engine's steps run
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,16,64,512")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--float32-torch-rows", type=int, default=16)
    args = ap.parse_args()
    if not ops.available():
        raise SystemExit("the engine's CPU kernels could not be built here")
    torch.set_num_threads(args.threads)
    weights = float_projections()
    i8 = [(int8_blocks(w), w.shape[1]) for w in weights]
    i4 = [(int4_blocks(w), w.shape[1]) for w in weights]
    t8 = [torch_int8(w) for w in weights]
    t4 = [torch_int4(w) for w in weights]
    bf16 = [w.to(torch.bfloat16) for w in weights]
    packed = packed_weights()
    bf = torch.bfloat16

    def t8_side(xs: dict, dtype: torch.dtype) -> list:
        return [torch._weight_int8pack_mm(xs[w.shape[1]].to(dtype), q, s.to(dtype)) for w, (q, s) in zip(weights, t8, strict=True)]

    def t4_side(xs: dict, dtype: torch.dtype) -> list:
        return [torch.ops.aten._weight_int4pack_mm_for_cpu(xs[w.shape[1]].to(dtype), q, 32, sz.to(dtype))
                for w, (q, sz) in zip(weights, t4, strict=True)]

    sides = {
        "f32 float_linear": lambda xs: [ops.float_linear(xs[w.shape[1]], w, None) for w in weights],
        "int8 in Q8_0": lambda xs: [quantized_rows(xs[k], b, Q8_0, k, None) for b, k in i8],
        "int4 in Q4_1": lambda xs: [quantized_rows(xs[k], b, Q4_1, k, None) for b, k in i4],
        "torch int8pack f32": lambda xs: t8_side(xs, torch.float32),
        "torch int4pack f32": lambda xs: t4_side(xs, torch.float32),
        "bf16 pairs": lambda xs: [packed.pairs_product(xs[w.shape[1]].to(bf), w, None) for w in bf16],
        "torch int8pack bf16": lambda xs: t8_side(xs, bf),
        "torch int4pack bf16": lambda xs: t4_side(xs, bf),
    }
    print(f"{cpu_name()}; CPU class {isa.describe()}; {args.threads} thread(s); the default model's 210 projections, "
          f"ms a pass, best of {args.rounds}")
    print("| rows | " + " | ".join(sides) + " |")
    print("|---" * (len(sides) + 1) + "|")
    gen = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=gen) for k in {w.shape[1] for w in weights}}
        run = {n: f for n, f in sides.items() if "f32" not in n or "torch" not in n or rows <= args.float32_torch_rows}
        best = dict.fromkeys(run, float("inf"))
        for _ in range(args.rounds):
            for name, side in run.items():
                start = time.perf_counter()
                side(xs)
                best[name] = min(best[name], time.perf_counter() - start)
        print(f"| {rows} | " + " | ".join(f"{best[n] * 1e3:.1f}" if n in best else "-" for n in sides) + " |", flush=True)


if __name__ == "__main__":
    main()
