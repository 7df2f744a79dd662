"""The decoder's pieces an inference step may hand to other kernels: projections, RMSNorm,
SiLU(gate) * up, the rotary embedding and a mixture of experts' products.

Why here, and not a `TorchFunctionMode` around the forward: a mode sees every torch call of the step
(about 50 a layer), and on a one-row decode step of the default model that Python round trip cost
4 ms of a 34 ms step. Here each piece looks once, at one thread-local read. The engine routes its
bf16 steps on a CPU to its own kernels (`engine/cpu_routes.py`); everywhere else (training, a
trainer's rollouts, batch-invariant steps) nothing is routed and the decoder runs its torch code, so
modes that rewrite `F.linear` still see it. A route returns None for a call it does not take.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Tensor = torch.Tensor


@dataclass(frozen=True)
class Routes:
    linear: Callable[[Tensor, Tensor, Tensor | None], Tensor | None]  # (x, weight, bias)
    rms_norm: Callable[[Tensor, Tensor, float], Tensor | None]  # (x, weight, eps)
    silu_mul: Callable[[Tensor, Tensor], Tensor | None]  # (gate, up) -> silu(gate) * up
    rope: Callable[[Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor] | None]  # (q, k, cos, sin)
    # (x, gate weight, up weight) -> silu(x @ gate.T) * (x @ up.T): an MLP's two products and their
    # product in one pass, for plain projections without bias (None: no such route).
    gate_up: Callable[[Tensor, Tensor, Tensor], Tensor | None] | None = None
    # (x, GGUF blocks [N, row_bytes] uint8, GGML type, input features, bias): a projection whose weight
    # stays quantized (`model/gguf_modules.py`; None: no such route, the weight is dequantized).
    quantized_linear: Callable[[Tensor, Tensor, int, int, Tensor | None], Tensor | None] | None = None
    # (rows grouped by expert, each expert's row count, stacked gate_up [E, 2I, H], stacked down [E, H, I])
    # -> down(silu(gate) * up) of each expert over its rows, in their order: a mixture of experts'
    # products (`model/moe.py`; None: no such route).
    experts: Callable[[Tensor, list[int], Tensor, Tensor], Tensor | None] | None = None


_routed = threading.local()


def current() -> Routes | None:
    """This thread's routes, or None (the decoder's own code)."""
    return getattr(_routed, "routes", None)


@contextlib.contextmanager
def routed_to(routes: Routes) -> Iterator[None]:
    """The decoder's pieces run on this thread offer their calls to `routes` inside."""
    previous = current()
    _routed.routes = routes
    try:
        yield
    finally:
        _routed.routes = previous


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same state-dict names) whose product a route may take."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routes = current()
        if routes is not None:
            out = routes.linear(x, self.weight, self.bias)
            if out is not None:
                return out
        return F.linear(x, self.weight, self.bias)
