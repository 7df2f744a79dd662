"""The decoder's pieces routed to the CPU kernels (`kernels/`) around a bf16 engine step (`model/routed.py`).

Row-wise pieces (`kernels/csrc/rowwise.cpp`), every step: RMSNorm, SiLU(gate) * up and the rotary
embedding, each one call and one pass over its rows where eager torch makes five to ten (a third of a
2048-token prefill chunk's time went to them, and some 25 operator calls a layer of a one-row decode
step). Projections go to the kernels' own products on copies of the weights in their layouts
(`kernels/products.py` says what was measured).

The model runner routes the decoder here around a step's forward and vocabulary projection, for a
bf16 model the engine owns (weights in bf16, no autocast). With AMX, projections of prefill chunks
(hundreds of rows) stay with oneDNN; without, every step's take the k-pairs kernel. A trainer's
rollouts (autocast over float32 masters) and batch-invariant engines keep torch's kernels, whose
numbers are the ones the trainer computes; packed weights give those same numbers, so the bf16 twin
of a trainer's rollout engine runs its products on them too (its batch-invariant steps through
`model/batch_invariant.py`, where a probe confirms it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from pagedrl.kernels import ops
from pagedrl.kernels.products import (
    PackedWeights,
    few_rows,
    float_experts,
    float_rows,
    max_rows,
    quantized_rows,
    takes,
    takes_float32,
)
from pagedrl.model.routed import Routes, routed_to


def _not_taken(*args: torch.Tensor | float) -> None:
    return None


def rowwise(takes_them: Callable[..., bool]) -> tuple[Callable, Callable, Callable]:
    """RMSNorm, SiLU x up and rope routed to the row-wise kernels for tensors `takes_them` accepts
    (bf16 or float32), each None (the decoder's own code) for any other."""

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        if not takes_them(x, weight) or not x.is_contiguous():
            return None
        return ops.rms_norm(x, weight, eps)

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
        if not takes_them(gate, up) or not gate.is_contiguous() or not up.is_contiguous():
            return None
        return ops.silu_mul(gate, up)

    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not takes_them(q, k, cos, sin) or not all(t.is_contiguous() for t in (q, k, cos, sin)):
            return None
        return ops.rope(q, k, cos, sin)

    return rms_norm, silu_mul, rope


rms_norm, silu_mul, rope = rowwise(takes)


def no_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    return None


def engine_routes(packed: PackedWeights) -> Routes:
    """A bf16 engine's own steps: every piece on the kernels, the products on `packed`'s copies."""
    return Routes(linear=packed.engine_linear, rms_norm=rms_norm, silu_mul=silu_mul, rope=rope, gate_up=packed.gate_up,
                  experts=packed.experts)


def products_only_routes(packed: PackedWeights) -> Routes:
    """A trainer's bf16 twin under autocast (its greedy evaluations): the products only, on
    `packed`'s oneDNN copies; the rest is the decoder's own code on float32 norms."""
    return Routes(linear=packed.linear, rms_norm=_not_taken, silu_mul=_not_taken, rope=_not_taken)


ROUTES = Routes(linear=few_rows, rms_norm=rms_norm, silu_mul=silu_mul, rope=rope)
ROWWISE_ONLY = Routes(linear=no_product, rms_norm=rms_norm, silu_mul=silu_mul, rope=rope)


rms_norm32, silu_mul32, rope32 = rowwise(takes_float32)


# A float32 step's routes: the products of a few rows on the float32 kernel (GGUF weights kept quantized
# on its quantized twin, same bits; a mixture of experts' expert by expert), norms, SiLU and the rotary
# embedding on the row-wise kernels' float32 forms (one call each where eager torch makes three to six).
FLOAT_ROUTES = Routes(linear=float_rows, rms_norm=rms_norm32, silu_mul=silu_mul32, rope=rope32,
                      quantized_linear=quantized_rows, experts=float_experts)


def usable(model: torch.nn.Module, autocast_dtype: torch.dtype | None, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether a runner's steps may use the kernels: a model of `dtype` on the CPU, run without
    autocast, with the kernels built (a batch-invariant step is excluded step by step: the flag can be
    set after the runner is made)."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cpu" or weight.dtype != dtype or autocast_dtype is not None:
        return False
    return ops.available()


@contextlib.contextmanager
def routed_step(rows: int, on: bool, packed: PackedWeights | None = None, products_only: bool = False,
                float32: bool = False) -> Iterator[None]:
    """The decoder routed to the kernels for a step of `rows` query rows, when `on`: for a float32
    model (`float32`) the products of a few rows (`float_rows`); else the row-wise pieces always (unless
    `products_only`), the projections on `packed`'s copies when given, else on the engine's kernel
    when the step is small enough."""
    if not on or (products_only and packed is None and not float32):
        yield
        return
    if float32:
        routes = FLOAT_ROUTES
    elif packed is not None:
        routes = products_only_routes(packed) if products_only else engine_routes(packed)
    else:
        routes = ROUTES if rows <= max_rows() else ROWWISE_ONLY
    with routed_to(routes):
        yield
