"""One gpt-oss MoE layer's decode step at gpt-oss-20b's shapes with its experts kept in MXFP4 against the
same experts dequantized (float32 and bf16).

Shapes: hidden 2880, 32 experts of intermediate 2880, 4 a token (gpt-oss-20b's). The layer: the router
(a 2880 -> 32 projection with a bias), the top 4 softmaxed, then the experts (`model/moe.py`'s grouped
run). Sides: `mxfp4` (`MXFP4Experts`, float32 rows on the `gguf_linear` kernel, 17 bytes a block of 32),
`float32` and `bf16` (`ClampedSwiGLUExperts` holding the dequantized values, torch's products). All three
hold the same random blocks' values. A step's tokens go to experts drawn anew each step (decode: no expert
stays in cache; the layer's float32 experts are 3.2 GB). Figure: the median of `--steps` steps after 3,
for 1 and 16 tokens, sides alternating in one process, best of `--rounds` rounds (a shared machine only
slows a turn down).

    .venv/bin/python bench/bench_mxfp4_experts.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 2880, 2880, 32, 4


def build() -> dict[str, torch.nn.Module]:
    from pagedrl.model.moe import ClampedSwiGLUExperts
    from pagedrl.model.mxfp4_experts import MXFP4Experts, hf_rows

    g = torch.Generator().manual_seed(0)

    def pair(rows: int, k: int) -> torch.Tensor:
        blocks = torch.randint(0, 256, (EXPERTS, rows, k // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(118, 124, (EXPERTS, rows, k // 32), generator=g, dtype=torch.uint8)
        return hf_rows(blocks, scales)

    kept = MXFP4Experts(pair(2 * INTERMEDIATE, HIDDEN), 0.01 * torch.randn(EXPERTS, 2 * INTERMEDIATE, generator=g),
                        pair(HIDDEN, INTERMEDIATE), 0.01 * torch.randn(EXPERTS, HIDDEN, generator=g),
                        alpha=1.702, limit=7.0).eval()
    floats = ClampedSwiGLUExperts(EXPERTS, HIDDEN, INTERMEDIATE, 1.702, 7.0).eval()
    with torch.no_grad():
        for name, value in kept.dequantized().items():
            getattr(floats, name).copy_(value)
    bf16 = ClampedSwiGLUExperts(EXPERTS, HIDDEN, INTERMEDIATE, 1.702, 7.0).eval()
    bf16.load_state_dict(floats.state_dict())
    return {"mxfp4": kept, "float32": floats, "bf16": bf16.to(torch.bfloat16)}


def step_time(experts: torch.nn.Module, router: torch.nn.Linear, tokens: int, steps: int, dtype: torch.dtype) -> float:
    g = torch.Generator().manual_seed(tokens)
    times = []
    with torch.no_grad():
        for i in range(steps + 3):
            x = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
            start = time.perf_counter()
            logits = router(x.float()).to(dtype)
            top, chosen = torch.topk(logits, TOP_K, dim=-1)
            experts(x, chosen, torch.softmax(top, dim=-1))
            if i >= 3:
                times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from pagedrl.kernels import isa, ops
    from pagedrl.model.mxfp4_experts import kept_bytes

    assert ops.available(), "the CPU kernels could not be built"
    sides = build()
    router = torch.nn.Linear(HIDDEN, EXPERTS)
    held, floats = kept_bytes(torch.nn.ModuleList([sides["mxfp4"]]))
    print(f"CPU class: {isa.describe()}, threads {args.threads}; experts' "
          f"bytes: MXFP4 {held / 2**30:.2f} GiB, float32 {floats / 2**30:.2f} GiB, bf16 {floats / 2**31:.2f} GiB")
    dtypes = {"mxfp4": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16}
    for tokens in (1, 16):
        best = {side: float("inf") for side in sides}
        for _ in range(args.rounds):
            for side, module in sides.items():
                best[side] = min(best[side], step_time(module, router, tokens, args.steps, dtypes[side]))
        print(f"tokens {tokens:2d}: mxfp4 {best['mxfp4']:.1f} ms, float32 {best['float32']:.1f} ms, "
              f"bf16 {best['bf16']:.1f} ms; float32 / mxfp4 {best['float32'] / best['mxfp4']:.2f}x, "
              f"bf16 / mxfp4 {best['bf16'] / best['mxfp4']:.2f}x")


if __name__ == "__main__":
    main()
