"""The projections of a decode step of one to three sequences, through the engine's own bf16 kernel.

A single chat stream decodes one row per step, so each of the model's matmuls is a pass over its
weights with almost no arithmetic: the step's speed is how fast the weights stream through the
cores. On this project's CPU (AMX and AVX512-BF16), oneDNN's bf16 kernel runs a one-row product of the
default model's 211 projections at 29-35 ms a step (2 threads), about half the memory bandwidth;
`csrc/decode_linear.cpp` streams the same weights in 18-20 ms. From four rows on oneDNN's AMX kernel
is as fast or faster, so the runner only routes steps of at most `MAX_ROWS` rows.

The model runner routes the decoder's projections (`model/linear.py`) here around a step's forward and
vocabulary projection, for a bf16 model the engine owns (weights in bf16, no autocast) when the step
is that small. A trainer's
rollouts (autocast over float32 masters) and batch-invariant engines keep torch's kernels: their
numbers must be the ones the trainer computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pagedrl.engine import cpu_kernels
from pagedrl.model.linear import routed_to

MAX_ROWS = 3  # measured crossover with oneDNN's bf16 kernel: 4 rows are as fast through either


def kernel(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, K] bf16 @ weight [N, K].T (+ bias) -> [M, N] bf16 (`csrc/decode_linear.cpp`)."""
    return torch.ops.pagedrl_cpu.decode_linear(rows, weight, bias)


def few_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """A projection's product through the kernel when it takes it: bf16 on the CPU, at most `MAX_ROWS`
    rows, and no gradient recorded (the kernel has no backward; the runner runs in inference mode).
    None otherwise: the layer then runs `F.linear`."""
    if x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16 or x.device.type != "cpu" \
            or weight.stride(-1) != 1 or torch.is_grad_enabled() or (bias is not None and bias.dtype != torch.bfloat16):
        return None
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] > MAX_ROWS:
        return None
    return kernel(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])


def usable(model: torch.nn.Module, autocast_dtype: torch.dtype | None) -> bool:
    """Whether a runner's steps may use the kernel: a bf16 model on the CPU, run without autocast,
    with the kernel built for this CPU (a batch-invariant step is excluded step by step: the flag
    can be set after the runner is made)."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or autocast_dtype is not None:
        return False
    return cpu_kernels.decode_linear_available()


@contextlib.contextmanager
def rows_through_kernel(rows: int, on: bool) -> Iterator[None]:
    """The decoder's projections routed to the kernel for a step of `rows` query rows, when `on` and
    the step is small enough."""
    if not on or rows > MAX_ROWS:
        yield
        return
    with routed_to(few_rows):
        yield
