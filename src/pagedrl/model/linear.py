"""The decoder's linear layers: `nn.Linear`, whose product a scope may hand to another kernel.

Why not a `TorchFunctionMode` around the forward: a mode sees every torch call of the step (about
50 a layer), and on a one-row decode step of the default model that Python round trip cost 4 ms of
a 34 ms step. Here only the projections look, at one thread-local read each. The engine routes the
few-row products of its bf16 decode steps to its own kernel (`engine/decode_linear.py`); everywhere
else (training, a trainer's rollouts, batch-invariant steps) nothing is routed and the layer is
`F.linear`, so modes that rewrite `F.linear` still see it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

# (x, weight, bias) -> the product, or None where the kernel does not take this call
RowKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor | None]

_routed = threading.local()


class Linear(nn.Linear):
    """`nn.Linear` with the same parameters and state-dict names."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernel: RowKernel | None = getattr(_routed, "kernel", None)
        if kernel is not None:
            out = kernel(x, self.weight, self.bias)
            if out is not None:
                return out
        return F.linear(x, self.weight, self.bias)


@contextlib.contextmanager
def routed_to(kernel: RowKernel) -> Iterator[None]:
    """Projections of this thread's `Linear` layers offer their products to `kernel` inside."""
    previous = getattr(_routed, "kernel", None)
    _routed.kernel = kernel
    try:
        yield
    finally:
        _routed.kernel = previous
