"""The projections of a decode step of one to three sequences, through the engine's own bf16 kernel.

A single chat stream decodes one row per step, so each of the model's matmuls is a pass over its
weights with almost no arithmetic: the step's speed is how fast the weights stream through the
cores. On this project's CPU (AMX and AVX512-BF16), oneDNN's bf16 kernel runs a one-row product of the
default model's 211 projections at 29-35 ms a step (2 threads), about half the memory bandwidth;
`csrc/decode_linear.cpp` streams the same weights in 18-20 ms. From four rows on oneDNN's AMX kernel
is as fast or faster, so the mode only takes steps of at most `MAX_ROWS` rows.

The mode is entered by the model runner around a step's forward and vocabulary projection, for a
bf16 model the engine owns (weights in bf16, no autocast) when the step is that small. A trainer's
rollouts (autocast over float32 masters) and batch-invariant engines keep torch's kernels: their
numbers must be the ones the trainer computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from pagedrl.engine import cpu_kernels

MAX_ROWS = 3  # measured crossover with oneDNN's bf16 kernel: 4 rows are as fast through either


def kernel(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """rows [M, K] bf16 @ weight [N, K].T (+ bias) -> [M, N] bf16 (`csrc/decode_linear.cpp`)."""
    return torch.ops.pagedrl_cpu.decode_linear(rows, weight, bias)


class _DecodeLinears(TorchFunctionMode):
    """Routes `F.linear` on bf16 CPU tensors to the kernel; every other call passes through."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            # The kernel has no backward: only where no gradient is recorded (the runner's inference mode).
            if x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16 and weight.dim() == 2 \
                    and x.device.type == "cpu" and weight.stride(-1) == 1 and not torch.is_grad_enabled() \
                    and (bias is None or bias.dtype == torch.bfloat16):
                rows = x.reshape(-1, x.shape[-1])
                if rows.shape[0] <= MAX_ROWS:
                    return kernel(rows, weight, bias).view(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


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
    """The mode around a step of `rows` query rows, when `on` and the step is small enough."""
    if not on or rows > MAX_ROWS:
        yield
        return
    with _DecodeLinears():
        yield
