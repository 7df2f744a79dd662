"""One AdamW step of `optim: adamw_torch` against `adamw_torch_fused` (torch's fused kernel, transformers 5's
default) on the CPU: the milliseconds of a step over `--params` million float32 parameters (four square
matrices), interleaved, the fastest and the median of `--repeats`, and the largest difference the two
leave in the weights after those steps (the fused kernel rounds otherwise: not zero).

    .venv/bin/python bench/bench_fused_adamw.py --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=16.8, help="millions of parameters")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    side = int((args.params * 1e6 / 4) ** 0.5)
    optimizers, weights = {}, {}
    for name, fused in (("adamw_torch", None), ("adamw_torch_fused", True)):
        torch.manual_seed(0)
        weights[name] = [torch.nn.Parameter(torch.randn(side, side)) for _ in range(4)]
        for p in weights[name]:
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
        optimizers[name] = torch.optim.AdamW(weights[name], lr=1e-3, weight_decay=0.1, fused=fused)
        optimizers[name].step()  # the moments exist before timing
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(args.repeats):
        for name, optimizer in optimizers.items():
            start = time.perf_counter()
            optimizer.step()
            times[name].append((time.perf_counter() - start) * 1e3)
    print(f"{4 * side * side / 1e6:.1f}M parameters, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    for name, ms in times.items():
        print(f"{name:18s} fastest {min(ms):8.1f} ms   median {statistics.median(ms):8.1f} ms")
    gap = max((a - b).abs().max().item() for a, b in zip(*weights.values(), strict=True))
    print(f"largest weight difference after {args.repeats + 1} steps: {gap:.3g}")


if __name__ == "__main__":
    main()
